"""The AutoAWQ int4 checkpoint format: packing, unpacking and the torch references.

AutoAWQ "GEMM" checkpoint layout for a linear with K inputs, N outputs and group size G:
    qweight int32 [K, N/8]     4-bit weights q in 0..15, eight per int32
    qzeros  int32 [K/G, N/8]   4-bit zero points z, packed the same way
    scales  fp16  [K/G, N]     one scale s per group of G input rows and output column
    W[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]                      # [K, N]
    y = x @ W                                                 # x [M, K] -> y [M, N]

The nibble at bits 4i..4i+3 of qweight[k, j] holds column 8j + AWQ_PACK_ORDER[i]; the interleaved
order [0, 2, 4, 6, 1, 3, 5, 7] made AutoAWQ's CUDA unpacking cheap, and we keep it for checkpoint
compatibility. So column 8j + c sits at shift
    4 * AWQ_PACK_ORDER.index(c) = 4 * [0, 4, 1, 5, 2, 6, 3, 7][c].
Words are two's complement int32: a top nibble >= 8 makes the word negative, so unpacking masks
each shifted nibble with 0xF to drop the sign bits an arithmetic shift drags along.

The references here are plain torch (fp32 math): the Triton kernels in awq.py are checked against
them, and awq.awq_gemm falls back to them off the GPU.
"""

from __future__ import annotations

import torch

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_PACK_ORDER[i]


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """Ints 0..15 [R, C] -> int32 [R, C/8] with AWQ's interleaved nibble order."""
    R, C = values.shape
    v = values.to(torch.int64).reshape(R, C // 8, 8)
    packed = torch.zeros(R, C // 8, dtype=torch.int64, device=values.device)
    for nibble, column in enumerate(AWQ_PACK_ORDER):
        packed |= v[:, :, column] << (4 * nibble)
    # reinterpret as two's complement int32: a top nibble >= 8 makes the word negative
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> ints 0..15 as int32 [R, 8 * C] in natural column order."""
    shifts = torch.tensor([4 * AWQ_PACK_ORDER.index(c) for c in range(8)], dtype=torch.int32,
                          device=packed.device)
    # the arithmetic shift drags the sign bit along; the mask drops it
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(packed.shape[0], -1)


def pack_awq(intweight: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """intweight [K, N], zeros [K/G, N], ints 0..15 -> (qweight [K, N/8], qzeros [K/G, N/8])."""
    for name, t in (("intweight", intweight), ("zeros", zeros)):
        if t.dim() != 2 or t.shape[1] % 8 != 0:
            raise ValueError(f"pack_awq: {name} must be 2-D with a multiple of 8 columns, got "
                             f"shape {tuple(t.shape)}")
        if t.is_floating_point() or t.numel() and (t.min() < 0 or t.max() > 15):
            raise ValueError(f"pack_awq: {name} must hold integers in 0..15, got {t.dtype} "
                             f"in [{t.min().item()}, {t.max().item()}]")
    if intweight.shape[1] != zeros.shape[1]:
        raise ValueError(f"pack_awq: intweight has {intweight.shape[1]} columns but zeros has "
                         f"{zeros.shape[1]}; both are [*, N]")
    return pack_int4(intweight), pack_int4(zeros)


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight [K, N/8], qzeros [K/G, N/8]) -> (intweight [K, N], zeros [K/G, N]) as int32."""
    return unpack_int4(qweight), unpack_int4(qzeros)


def awq_dequantize_reference(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                             group_size: int) -> torch.Tensor:
    """W [K, N] = (q - z) * s in fp32."""
    q, z = unpack_awq(qweight, qzeros)
    z = z.repeat_interleave(group_size, dim=0)  # [K, N]
    s = scales.float().repeat_interleave(group_size, dim=0)  # [K, N]
    return (q - z).float() * s


def awq_gemm_reference(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
                       scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W [K, N], fp32 math, in x's dtype."""
    w = awq_dequantize_reference(qweight, qzeros, scales, group_size)  # [K, N]
    return (x.float() @ w).to(x.dtype)
