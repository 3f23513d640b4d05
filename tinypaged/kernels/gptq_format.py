"""The GPTQ checkpoint format (AutoGPTQ / GPTQModel): packing, unpacking, the torch references and
the repacking of 4-bit weights into the AWQ layout the int4 kernels read.

A linear with K inputs, N outputs, b bits (4 or 8, so P = 32 / b values per int32) and group
size G (G = K when the checkpoint says -1, one group per output column) is stored as
    qweight int32 [K/P, N]     packed along the INPUT dim: row P*i + j of q at bits b*j of word i
    qzeros  int32 [K/G, N/P]   packed along the OUTPUT dim: column P*i + j at bits b*j
    scales  fp16  [K/G, N]
    g_idx   int32 [K]          the group of each input row
    W[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]                  # [K, N]
    y = x @ W
Nibbles are in natural order (no interleave, unlike AWQ). The "gptq" checkpoint format (v1)
stores z - 1 in qzeros (an AutoGPTQ convention), wrapped to b bits; GPTQModel's "gptq_v2"
stores z itself. With act-order (desc_act) the quantizer visited the input rows by decreasing
Hessian diagonal, so g_idx is a permutation of the sorted k // G: groups are not contiguous.
"""

from __future__ import annotations

import torch

from tinypaged.kernels.awq_format import pack_awq


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in 0 .. 2^32 - 1 -> two's complement int32."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Ints [R, C] in 0 .. 2^bits - 1 -> int32 [R / (32/bits), C] (qweight's packing)."""
    per = 32 // bits
    v = values.to(torch.int64).reshape(values.shape[0] // per, per, values.shape[1])
    shifts = (bits * torch.arange(per, device=values.device)).view(1, per, 1)
    return _to_int32((v << shifts).sum(dim=1))


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] -> ints as int32 [R * 32/bits, C] (masked: drops the sign bits)."""
    per = 32 // bits
    shifts = (bits * torch.arange(per, dtype=torch.int32, device=packed.device)).view(1, per, 1)
    return ((packed.unsqueeze(1) >> shifts) & (2**bits - 1)).reshape(-1, packed.shape[1])


def pack_cols(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Ints [R, C] -> int32 [R, C / (32/bits)] (qzeros' packing)."""
    return pack_rows(values.t(), bits).t().contiguous()


def unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] -> ints as int32 [R, C * 32/bits]."""
    return unpack_rows(packed.t(), bits).t()


def stored_zeros(zeros: torch.Tensor, bits: int, version: int) -> torch.Tensor:
    """The zero points z as a checkpoint stores them: z - 1 (wrapped) for v1, z for v2."""
    return (zeros - 1) & (2**bits - 1) if version == 1 else zeros


def true_zeros(stored: torch.Tensor, bits: int, version: int) -> torch.Tensor:
    """The inverse of stored_zeros."""
    return (stored + 1) & (2**bits - 1) if version == 1 else stored


def gptq_dequantize_reference(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                              g_idx: torch.Tensor, bits: int, version: int) -> torch.Tensor:
    """W [K, N] = (q - z[g_idx]) * s[g_idx] in fp32: the format's definition."""
    q = unpack_rows(qweight, bits)  # [K, N]
    z = true_zeros(unpack_cols(qzeros, bits), bits, version)  # [K/G, N]
    g = g_idx.long()
    return (q - z[g]).float() * scales.float()[g]


def act_order_perm(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """The permutation that makes groups contiguous (row i of W[perm] is in group i // G), or
    None when they already are. ValueError when g_idx holds groups of unequal sizes."""
    K = g_idx.numel()
    sorted_groups = torch.arange(K, device=g_idx.device) // group_size
    if torch.equal(g_idx.long(), sorted_groups):
        return None
    perm = torch.argsort(g_idx.long(), stable=True)
    if not torch.equal(g_idx.long()[perm], sorted_groups):
        raise ValueError(f"GPTQ: g_idx does not assign exactly group_size={group_size} input rows "
                         "to each group; the checkpoint's g_idx and group_size disagree")
    return perm


def gptq_to_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                perm: torch.Tensor | None, group_size: int, version: int,
                awq_group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit GPTQ tensors -> AWQ (qweight [K, N/8], qzeros [K/G', N/8], scales [K/G', N]) of
    W[perm] (x[:, perm] @ W[perm] = x @ W). G' = awq_group_size divides group_size: each GPTQ
    group's scales and zeros are repeated group_size / G' times (per-channel G = K runs as 128)."""
    q = unpack_rows(qweight, 4)  # [K, N]
    if perm is not None:
        q = q[perm]
    z = true_zeros(unpack_cols(qzeros, 4), 4, version)  # [K/G, N]
    repeat = group_size // awq_group_size
    z = z.repeat_interleave(repeat, dim=0)
    s = scales.repeat_interleave(repeat, dim=0).to(torch.float16)
    qweight_awq, qzeros_awq = pack_awq(q, z)
    return qweight_awq, qzeros_awq, s.contiguous()


def pack_gptq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
              bits: int, version: int) -> dict[str, torch.Tensor]:
    """q [K, N], zeros [K/G, N] (ints 0 .. 2^bits - 1), scales [K/G, N], g_idx [K] -> the four
    checkpoint tensors of one linear, as AutoGPTQ (version 1) or GPTQModel (2) write them."""
    top = 2**bits - 1
    for name, t in (("q", q), ("zeros", zeros)):
        if t.is_floating_point() or t.numel() and (t.min() < 0 or t.max() > top):
            raise ValueError(f"pack_gptq: {name} must hold integers in 0..{top}, got {t.dtype}")
    return {
        "qweight": pack_rows(q, bits),
        "qzeros": pack_cols(stored_zeros(zeros.to(torch.int64), bits, version), bits),
        "scales": scales.to(torch.float16).contiguous(),
        "g_idx": g_idx.to(torch.int32).contiguous(),
    }
