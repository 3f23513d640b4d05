"""GGUF (llama.cpp) weight block formats and their torch reference dequantizers.

A GGUF matrix with N rows (output features) and K columns (input features) is stored row by
row; each row is K / block_elems blocks of block_bytes bytes, so on the device it stays a
uint8 tensor [N, K / block_elems * block_bytes] (`qweight`). fp16 fields are little-endian.

    type  elems bytes  block layout                        weight
    Q8_0   32    34    d f16 | q int8[32]                   d * q
    Q4_0   32    18    d f16 | qs u8[16]                    d * (q - 8)
    Q4_1   32    20    d f16 | m f16 | qs u8[16]            d * q + m
    Q4_K  256   144    d f16 | dmin f16 | sc u8[12] | qs u8[128]       d*sc_s*q - dmin*m_s
    Q5_K  256   176    d f16 | dmin f16 | sc u8[12] | qh u8[32] | qs u8[128]   (q += 16 * bit)
    Q6_K  256   210    ql u8[128] | qh u8[64] | sc int8[16] | d f16       d * sc_s * (q - 32)

Legacy 4-bit blocks: element j < 16 is the low nibble of qs[j], element j >= 16 the high nibble
of qs[j - 16]. Q4_K / Q5_K: 8 sub-blocks s of 32; sub-block s reads nibble s % 2 of
qs[32 * (s // 2) + l] (Q5_K adds bit s of qh[l] as the fifth bit), and its 6-bit scale sc_s and
min m_s are packed into 12 bytes (`k_scale_min`). Q6_K: 16 sub-blocks of 16; element
128 n + 32 i + l (half n, quarter i) takes nibble i // 2 of ql[64 n + 32 (i % 2) + l] and bits
2i..2i+1 of qh[32 n + l], scaled by sc[8 n + 2 i + l // 16].
F32, F16 and BF16 matrices are plain floats (block of 1) and pass through as dense weights.

The references below are plain torch in fp32; the `gguf` package's `gguf.quants.dequantize` is
their oracle in the tests; the kernels read the device layout (gguf_layout.py), and their
references (gguf.py) convert back and call these.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GGMLType:
    name: str
    type_id: int  # GGMLQuantizationType value
    block_elems: int
    block_bytes: int


GGML_TYPES = {t.type_id: t for t in (
    GGMLType("F32", 0, 1, 4),
    GGMLType("F16", 1, 1, 2),
    GGMLType("BF16", 30, 1, 2),
    GGMLType("Q4_0", 2, 32, 18),
    GGMLType("Q4_1", 3, 32, 20),
    GGMLType("Q8_0", 8, 32, 34),
    GGMLType("Q4_K", 12, 256, 144),
    GGMLType("Q5_K", 13, 256, 176),
    GGMLType("Q6_K", 14, 256, 210),
)}
DENSE_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}
QUANTIZED_TYPES = sorted(t for t in GGML_TYPES if t not in DENSE_TYPES)


def ggml_type(type_id: int) -> GGMLType:
    if type_id not in GGML_TYPES:
        names = ", ".join(t.name for t in GGML_TYPES.values())
        raise ValueError(f"GGUF tensor type {type_id} is not supported; supported: {names}")
    return GGML_TYPES[type_id]


def row_bytes(type_id: int, K: int) -> int:
    """Bytes of one stored row of K weights; ValueError when K is not whole blocks."""
    t = ggml_type(type_id)
    if K % t.block_elems:
        raise ValueError(f"a {t.name} row holds whole blocks of {t.block_elems} weights; "
                         f"got a row of {K}")
    return K // t.block_elems * t.block_bytes


def check_qweight(qweight: torch.Tensor, type_id: int, K: int, what: str) -> None:
    """ValueError, naming `what`, unless qweight holds rows of K weights: uint8 [N, row_bytes]."""
    expected = row_bytes(type_id, K)
    if qweight.dim() != 2 or qweight.dtype != torch.uint8 or qweight.shape[1] != expected:
        raise ValueError(f"{what}: a {ggml_type(type_id).name} weight with K={K} is uint8 "
                         f"[N, {expected}]; got {qweight.dtype} {list(qweight.shape)}")


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Pairs of bytes [..., 2] -> float32 [..., 1] (little-endian fp16)."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., B] bytes -> [..., 2, B]: low nibbles, then high nibbles."""
    return torch.stack([qs & 0xF, qs >> 4], dim=-2)


def k_scale_min(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 scale bytes of a Q4_K / Q5_K block [..., 12] -> 6-bit (scales, mins) [..., 8].
    Sub-blocks 0-3: low 6 bits of bytes 0-3 (scale) and 4-7 (min); sub-blocks 4-7: a nibble of
    bytes 8-11 plus the top 2 bits of bytes 0-3 (scale) or 4-7 (min) as bits 4-5."""
    s = sc.to(torch.int32)
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    scales = torch.cat([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], dim=-1)
    mins = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=-1)
    return scales.float(), mins.float()


def _dequantize_blocks(b: torch.Tensor, name: str) -> torch.Tensor:
    """uint8 blocks [..., block_bytes] -> float32 weights [..., block_elems]."""
    if name == "Q8_0":
        return _f16(b[..., :2]) * b[..., 2:].contiguous().view(torch.int8).float()
    if name == "Q4_0":
        return _f16(b[..., :2]) * (_nibbles(b[..., 2:]).flatten(-2).float() - 8)
    if name == "Q4_1":
        return _f16(b[..., :2]) * _nibbles(b[..., 4:]).flatten(-2).float() + _f16(b[..., 2:4])
    if name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # [..., 1]
        scales, mins = k_scale_min(b[..., 4:16])  # [..., 8]
        qs = b[..., -128:].reshape(*b.shape[:-1], 4, 32)
        q = _nibbles(qs).flatten(-3, -2).float()  # [..., 8, 32]: sub-block 2g + nibble
        if name == "Q5_K":
            shifts = torch.arange(8, dtype=torch.uint8, device=b.device)[:, None]
            q += 16 * ((b[..., 16:48].unsqueeze(-2) >> shifts) & 1).float()
        w = (d * scales)[..., None] * q - (dmin * mins)[..., None]
        return w.flatten(-2)
    if name == "Q6_K":
        lead = b.shape[:-1]
        ql = b[..., 0:128].reshape(*lead, 2, 64)  # [half n, 32 * (i % 2) + l]
        qh = b[..., 128:192].reshape(*lead, 2, 1, 32)  # [half n, 1, l]
        sc = b[..., 192:208].contiguous().view(torch.int8).float().reshape(*lead, 2, 4, 2, 1)
        low = _nibbles(ql).reshape(*lead, 2, 4, 32)  # quarter i = 2 * nibble + i % 2
        shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=b.device)[:, None]
        q = (low | (((qh >> shifts) & 3) << 4)).float() - 32  # [..., 2, 4, 32]
        w = _f16(b[..., 208:210])[..., None, None, None] * sc * q.reshape(*lead, 2, 4, 2, 16)
        return w.flatten(-4)
    raise ValueError(f"no block dequantizer for {name}")


def gguf_dequantize_reference(qweight: torch.Tensor, type_id: int, K: int) -> torch.Tensor:
    """qweight uint8 [N, row_bytes] of GGML type `type_id` -> float32 W [N, K]."""
    t = ggml_type(type_id)
    N = qweight.shape[0]
    if tuple(qweight.shape) != (N, row_bytes(type_id, K)) or qweight.dtype != torch.uint8:
        raise ValueError(f"a {t.name} matrix with K={K} is uint8 [N, {row_bytes(type_id, K)}]; "
                         f"got {qweight.dtype} {list(qweight.shape)}")
    if type_id in DENSE_TYPES:
        return qweight.contiguous().view(DENSE_TYPES[type_id]).float()
    blocks = qweight.reshape(N, K // t.block_elems, t.block_bytes)
    return _dequantize_blocks(blocks, t.name).reshape(N, K)
