"""GGUF block-quantized matmul: y [M, N] = x [M, K] @ W^T with W kept in its GGUF blocks.

W is the uint8 `qweight [N, row_bytes]` of one GGML type in the device layout: the file's blocks
regrouped into planes at load (gguf_layout.py; gguf_format.py has the block formats). Decode
and speculative verification (x of up to ROWS_MAX_M = 64 rows) run the kernel DECODE_PATHS picks
per type and M: the GEMV of gguf_gemv.py, which streams the packed bytes once, or from a few
rows gguf_rows.py (each weight dequantized once in registers, the rows on tensor cores); the
Q4_K linears that would take gguf_rows take gguf_subdot.py instead up to 16 rows (one product
per sub-block; $TINYPAGED_GGUF_SUBDOT=0 keeps gguf_rows, SUBDOT_CONFIGS lists the types);
$TINYPAGED_GGUF_ROWS=1 sends 2 to 64 rows of every type to gguf_rows. Larger M
(prefill) dequantizes W into x's dtype with `_gguf_dequantize_kernel` and multiplies with cuBLAS,
where the matmul, not the weight read, is the cost. The dequantize kernel (also the embedding's
row lookup) takes BLOCK_N rows and a chunk of 256 weights (one k-quant super-block, or 8 legacy
blocks of 32) per program, viewed as [SUBS, SUBLEN] sub-blocks that share a scale and min:

    W[n, 256 c + SUBLEN s + j] = scale[n, c, s] * q[n, c, s, j] + min[n, c, s]

(`_chunk_parts` decodes q, scale and min, finding each file byte in its plane with `_plane`).
The weight bytes reach it through three views of the same memory (uint8, int8 and fp16), so
that signed quants and fp16 fields load with their own type; every fp16 field sits at an even
byte offset, since all planes have even sizes.
"""

from __future__ import annotations

import torch

from tinypaged import envs
from tinypaged.kernels._triton import cdiv, jit, tl, use_triton
from tinypaged.kernels.gguf_format import DENSE_TYPES, check_qweight, gguf_dequantize_reference
from tinypaged.kernels.gguf_gemv import GEMV_MAX_M, gemv_supported, gguf_gemv
from tinypaged.kernels.gguf_layout import to_device_layout, to_file_layout
from tinypaged.kernels.gguf_mma import MMA_MAX_M, MMA_TYPES, gguf_mma
from tinypaged.kernels.gguf_rows import ROWS_MAX_M, gguf_rows, rows_supported
from tinypaged.kernels.gguf_subdot import SUBDOT_MAX_M, gguf_subdot, subdot_supported

__all__ = ["DECODE_PATHS", "GEMV_MAX_M", "decode_path", "dequantize_reference", "gguf_dequantize",
           "gguf_gemv", "gguf_linear", "gguf_mma", "gguf_rows", "gguf_subdot",
           "linear_reference", "rows_config", "subdot_config", "to_device_layout",
           "to_file_layout"]

# Decode-sized x: per GGML type, rows (max M, kernel, its keyword arguments), the first whose
# max M >= M wins; an M past the last row (prefill) dequantizes and calls cuBLAS. "gemv":
# gguf_gemv.py (CUDA cores, one FMA a weight and row of x); "mma": gguf_mma.py (tensor cores,
# a cost that does not grow with M). Q6_K's GEMV takes prefetch and PTX byte permutes (its
# decode is instruction-bound, and they cut the instructions a weight; Q4_K's would spill
# registers); at a few rows the tensor-core kernel beats the GEMV, whose FMAs grow with M, and
# dequantize + cuBLAS loses to both (it writes and reads a bf16 copy). "rows": gguf_rows.py
# (each weight dequantized once, the rows on tensor cores; its tiles from ROWS_CONFIGS): on the
# H200 it beat the GEMV from 4 rows and gguf_mma at every size for Q4_K and Q6_K, on the sum of
# the Llama-3-8B layers (the o projection alone lost at 4 and 16 rows; benchmarks/gguf_gemv.py
# --only rows, figures in benchmarks/RESULTS.md); 3 rows is interpolated between 2 and 4. The
# legacy types (Q4_0, Q4_1, Q8_0) take the GEMV to GEMV_MAX_M rows, from 2 rows with one warp
# a program (8 rows of W): there it multiplies all rows of x at once (gguf_gemv_step.py), and
# on the H200 the small tiles beat the default on the SmolLM2-135M layers at 2-8 rows
# (speculative decoding verifies 5 rows a sequence; benchmarks/RESULTS.md). Other types take
# the GEMV to GEMV_MAX_M rows with its defaults. Past those, up to ROWS_MAX_M rows (a batch-8
# verification's 40), the k-quants take gguf_rows, which reads W's blocks once where dequantize
# + cuBLAS writes and reads a bf16 copy of W in two launches: on the H200, at 40 and 64 rows of
# the Llama-3-8B layers, 1.2-2.6x faster for Q4_K and Q5_K; Q6_K's 1.0-1.3x at 40 rows, but at
# 64 it lost on 3 of 5 linears, so Q6_K stops at 40. The legacy types keep dequantize + cuBLAS
# there: on the SmolLM2-135M layers gguf_rows took 11-25 us a linear at 40 rows, it 5-9.
_LEGACY = ((1, "gemv", {}), (GEMV_MAX_M, "gemv", {"num_warps": 1}))
DECODE_PATHS: dict[int, tuple[tuple[int, str, dict], ...]] = {
    12: ((3, "gemv", {}), (ROWS_MAX_M, "rows", {})),
    14: ((1, "gemv", {"prefetch": True, "asm": True}), (3, "gemv", {}), (40, "rows", {})),
    2: _LEGACY, 3: _LEGACY, 8: _LEGACY,
}
_GEMV_ONLY = ((GEMV_MAX_M, "gemv", {}), (ROWS_MAX_M, "rows", {}))
# gguf_rows' tiles (DECODE_PATHS' "rows", and 2..ROWS_MAX_M rows of every type with
# $TINYPAGED_GGUF_ROWS=1): per type, rows (max M, tile keyword arguments), the first whose max
# M >= M wins; a type or M not listed takes gguf_rows' defaults. benchmarks/gguf_gemv.py --only
# rows --sweep-rows prints this table (the H200's best at 8 rows).
ROWS_CONFIGS: dict[int, tuple[tuple[int, dict], ...]] = {
    12: (  # Q4_K
        (8, dict(block_n=64, num_warps=4, num_stages=3, asm=True)),
    ),
    14: (  # Q6_K
        (8, dict(block_n=64, num_warps=4, num_stages=3)),
    ),
}
# gguf_subdot's tiles, read as ROWS_CONFIGS: with $TINYPAGED_GGUF_SUBDOT=1 (the default) the
# linears of the types listed here that DECODE_PATHS gives gguf_rows take gguf_subdot instead
# (where subdot_supported). From benchmarks/gguf_gemv.py --only subdot on an H200: Q4_K's join
# mode beat gguf_rows on every Llama-3-8B layer at 4-16 rows; Q6_K lost to gguf_rows in every
# mode swept, so gguf_subdot no longer takes it and Q6_K keeps gguf_rows.
SUBDOT_CONFIGS: dict[int, tuple[tuple[int, dict], ...]] = {
    12: (  # Q4_K
        (16, dict(block_n=64, num_warps=4, num_stages=3, asm=True, join=True)),
    ),
}

CHUNK = 256
# type id -> (SUBS, SUBLEN): the sub-blocks of a 256-weight chunk that share a scale (and min)
LAYOUTS = {2: (8, 32), 3: (8, 32), 8: (8, 32), 12: (8, 32), 13: (8, 32), 14: (16, 16)}


@jit
def _plane(row_off, nb, blk, p, BEFORE: tl.constexpr, SIZE: tl.constexpr, KIND: tl.constexpr):
    # the device-layout byte of byte p of block blk's field that has SIZE bytes a block and
    # comes after BEFORE bytes a block of other planes (gguf_layout.PLANES). KIND 0: as in the
    # file; 1 (T): 16-byte chunks transposed as 4 x 4 bytes; 2 (TH): also chunk 2g + half moved
    # to 4 half + g; 3 (TQ): also chunks 2 and 4, 3 and 5 swapped; 4 (S6): Q6_K's scale
    # 8n + 2i + lh at byte 4 (2n + lh) + i
    if KIND == 4:
        p = p // 8 * 8 + p % 2 * 4 + p % 8 // 2
    elif KIND != 0:
        chunk = p // 16
        if KIND == 2:
            chunk = chunk % 2 * 4 + chunk // 2
        elif KIND == 3:
            chunk = chunk % 2 + chunk // 4 % 2 * 2 + chunk // 2 % 2 * 4
        p = chunk * 16 + p % 4 * 4 + p % 16 // 4
    return row_off + nb * BEFORE + blk * SIZE + p


@jit
def _k_scale_min(u8_ptr, sc_off, s, mask):
    # Q4_K / Q5_K: the 6-bit scale and min of sub-block s (0..7) from the 12 bytes at sc_off
    b_idx = s % 4
    a = tl.load(u8_ptr + sc_off + b_idx, mask=mask, other=0).to(tl.int32)  # bytes 0-3
    b = tl.load(u8_ptr + sc_off + 4 + b_idx, mask=mask, other=0).to(tl.int32)  # bytes 4-7
    c = tl.load(u8_ptr + sc_off + 8 + b_idx, mask=mask, other=0).to(tl.int32)  # bytes 8-11
    low = s < 4
    sc = tl.where(low, a & 63, (c & 0xF) | ((a >> 6) << 4))
    m = tl.where(low, b & 63, (c >> 4) | ((b >> 6) << 4))
    return sc.to(tl.float32), m.to(tl.float32)


@jit
def _chunk_parts(u8_ptr, i8_ptr, f16_ptr, row_off, nb, c, s, j, mask, QTYPE: tl.constexpr):
    # Chunk c of the rows starting at byte row_off [BN, 1, 1] (nb blocks a row); s [1, SUBS, 1]
    # sub-block, j [1, 1, SUBLEN] weight within it, mask [BN, SUBS, 1] the sub-blocks that exist.
    # -> q [BN, SUBS, SUBLEN], scale and min [BN, SUBS, 1], all fp32: w = scale * q + min.
    if QTYPE == 12 or QTYPE == 13 or QTYPE == 14:  # k-quants: one super-block a chunk
        blk = c + 0 * s  # [1, SUBS, 1]
    else:  # legacy: 8 blocks a chunk, sub-block s is block 8c + s
        blk = c * 8 + s
    if QTYPE == 8:  # Q8_0: d | int8 q[32]
        scale = tl.load(f16_ptr + _plane(row_off, nb, blk, 0, 32, 2, 0) // 2, mask=mask,
                        other=0.0).to(tl.float32)
        q = tl.load(i8_ptr + _plane(row_off, nb, blk, j, 0, 32, 1), mask=mask,
                    other=0).to(tl.float32)
        mn = tl.zeros_like(scale)
    elif QTYPE == 2 or QTYPE == 3:  # Q4_0: d | qs[16]; Q4_1: d | m | qs[16]
        scale = tl.load(f16_ptr + _plane(row_off, nb, blk, 0, 16, 2, 0) // 2, mask=mask,
                        other=0.0).to(tl.float32)
        byte = tl.load(u8_ptr + _plane(row_off, nb, blk, j % 16, 0, 16, 1), mask=mask,
                       other=0).to(tl.int32)
        q = ((byte >> (j // 16 * 4)) & 0xF).to(tl.float32)
        if QTYPE == 2:
            mn = -8.0 * scale
        else:
            mn = tl.load(f16_ptr + _plane(row_off, nb, blk, 0, 18, 2, 0) // 2, mask=mask,
                         other=0.0).to(tl.float32)
    elif QTYPE == 12 or QTYPE == 13:  # Q4_K / Q5_K: d | dmin | sc[12] | (qh[32]) | qs[128]
        HDR: tl.constexpr = 128 if QTYPE == 12 else 160
        hdr = _plane(row_off, nb, blk, 0, HDR, 16, 0)
        d = tl.load(f16_ptr + hdr // 2, mask=mask, other=0.0).to(tl.float32)
        dmin = tl.load(f16_ptr + hdr // 2 + 1, mask=mask, other=0.0).to(tl.float32)
        sc, m = _k_scale_min(u8_ptr, hdr + 4, s, mask)
        byte = tl.load(u8_ptr + _plane(row_off, nb, blk, s // 2 * 32 + j, 0, 128, 2),
                       mask=mask, other=0).to(tl.int32)
        qi = (byte >> (s % 2 * 4)) & 0xF
        if QTYPE == 13:
            high = tl.load(u8_ptr + _plane(row_off, nb, blk, j, 128, 32, 1), mask=mask,
                           other=0).to(tl.int32)
            qi = qi | (((high >> s) & 1) << 4)
        q = qi.to(tl.float32)
        scale = d * sc
        mn = -dmin * m
    else:  # Q6_K: ql[128] | qh[64] | int8 sc[16] | d; sub-block s = 8 n + 2 i + t
        n = s // 8
        i = s % 8 // 2
        pos = s % 2 * 16 + j  # l of the format description (gguf_format.py), 0..31
        low = tl.load(u8_ptr + _plane(row_off, nb, blk, n * 64 + i % 2 * 32 + pos, 0, 128, 3),
                      mask=mask, other=0).to(tl.int32)
        high = tl.load(u8_ptr + _plane(row_off, nb, blk, n * 32 + pos, 128, 64, 1),
                       mask=mask, other=0).to(tl.int32)
        qi = ((low >> (i // 2 * 4)) & 0xF) | (((high >> (2 * i)) & 3) << 4)
        q = qi.to(tl.float32) - 32.0
        sc = tl.load(i8_ptr + _plane(row_off, nb, blk, s, 192, 16, 4), mask=mask,
                     other=0).to(tl.float32)
        d = tl.load(f16_ptr + _plane(row_off, nb, blk, 0, 208, 2, 0) // 2, mask=mask,
                    other=0.0).to(tl.float32)
        scale = d * sc
        mn = tl.zeros_like(scale)
    return q, scale, mn


@jit
def _gguf_dequantize_kernel(
    u8_ptr, i8_ptr, f16_ptr, w_ptr,  # qweight [N, stride_w] bytes (device layout) -> w [N, K]
    N, K, stride_w,
    QTYPE: tl.constexpr, SUBS: tl.constexpr, SUBLEN: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # grid: (cdiv(N, BLOCK_N), cdiv(K, 256)): one chunk of BLOCK_N rows per program
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.program_id(1)
    nb = K // (256 if QTYPE == 12 or QTYPE == 13 or QTYPE == 14 else 32)
    row_off = (rows.to(tl.int64) * stride_w)[:, None, None]
    s = tl.arange(0, SUBS)[None, :, None]
    j = tl.arange(0, SUBLEN)[None, None, :]
    # the row exists and the sub-block starts before K (legacy rows of 576)
    mask = (rows < N)[:, None, None] & (c * 256 + s * SUBLEN < K)
    q, scale, mn = _chunk_parts(u8_ptr, i8_ptr, f16_ptr, row_off, nb, c, s, j, mask, QTYPE)
    k = c * 256 + s * SUBLEN + j
    w = scale * q + mn  # [BN, SUBS, SUBLEN]
    tl.store(w_ptr + rows.to(tl.int64)[:, None, None] * K + k, w.to(w_ptr.dtype.element_ty),
             mask=mask & (k < K))


def dequantize_reference(qweight: torch.Tensor, type_id: int, K: int) -> torch.Tensor:
    """The torch reference of gguf_dequantize: device-layout qweight -> float32 W [N, K]."""
    return gguf_dequantize_reference(to_file_layout(qweight, type_id, K), type_id, K)


def linear_reference(x: torch.Tensor, qweight: torch.Tensor, type_id: int) -> torch.Tensor:
    """The torch reference of gguf_linear: y [M, N] = x [M, K] @ W^T in fp32, in x's dtype."""
    return (x.float() @ dequantize_reference(qweight, type_id, x.shape[-1]).T).to(x.dtype)


def gguf_dequantize(qweight: torch.Tensor, type_id: int, K: int,
                    dtype: torch.dtype = torch.float32, block_n: int = 16) -> torch.Tensor:
    """W [N, K] in `dtype` from qweight uint8 [N, row_bytes] (device layout) of type `type_id`."""
    check_qweight(qweight, type_id, K, "gguf_dequantize")
    if type_id in DENSE_TYPES:
        return qweight.contiguous().view(DENSE_TYPES[type_id]).to(dtype)
    if not use_triton(qweight):
        return dequantize_reference(qweight, type_id, K).to(dtype)
    qweight = qweight.contiguous()
    N = qweight.shape[0]
    w = torch.empty(N, K, dtype=dtype, device=qweight.device)
    subs, sublen = LAYOUTS[type_id]
    _gguf_dequantize_kernel[(cdiv(N, block_n), cdiv(K, CHUNK))](
        qweight, qweight.view(torch.int8), qweight.view(torch.float16), w, N, K,
        qweight.shape[1], QTYPE=type_id, SUBS=subs, SUBLEN=sublen, BLOCK_N=block_n,
    )
    return w


def gguf_linear(x: torch.Tensor, qweight: torch.Tensor, type_id: int) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T in x's dtype: a decode kernel for decode-sized M
    (DECODE_PATHS), else dequantize + cuBLAS; the torch reference off the GPU."""
    K = x.shape[-1]
    check_qweight(qweight, type_id, K, "gguf_linear")
    if type_id in DENSE_TYPES:
        return x @ gguf_dequantize(qweight, type_id, K, x.dtype).T
    if not use_triton(x):
        return linear_reference(x, qweight, type_id)
    if x.shape[0] == 0:
        return x.new_empty(0, qweight.shape[0])
    path = decode_path(type_id, K, x.shape[0])
    if path is not None:
        kernel, config = path
        if kernel == "mma":
            return gguf_mma(x, qweight, type_id, **config)
        if kernel == "rows":
            return gguf_rows(x, qweight, type_id, **config)
        if kernel == "subdot":
            return gguf_subdot(x, qweight, type_id, **config)
        return gguf_gemv(x, qweight, type_id, **config)
    return x @ gguf_dequantize(qweight, type_id, K, x.dtype).T


def decode_path(type_id: int, K: int, M: int) -> tuple[str, dict] | None:
    """(kernel, keyword arguments) for an M-row x: gguf_rows for 2..ROWS_MAX_M rows when
    $TINYPAGED_GGUF_ROWS is 1, else the row of DECODE_PATHS; None: dequantize + cuBLAS. With
    $TINYPAGED_GGUF_SUBDOT=1, gguf_subdot where either would give gguf_rows up to
    SUBDOT_MAX_M rows of a type that SUBDOT_CONFIGS lists."""
    path = _decode_path(type_id, K, M)
    if (path is not None and path[0] == "rows" and envs.TINYPAGED_GGUF_SUBDOT
            and M <= SUBDOT_MAX_M and type_id in SUBDOT_CONFIGS and subdot_supported(type_id, K)):
        return "subdot", subdot_config(type_id, M)
    return path


def _decode_path(type_id: int, K: int, M: int) -> tuple[str, dict] | None:
    rows = 2 <= M <= ROWS_MAX_M and rows_supported(type_id, K)
    if rows and envs.TINYPAGED_GGUF_ROWS:
        return "rows", rows_config(type_id, M)
    if not gemv_supported(type_id, K):
        return None
    for max_m, kernel, config in DECODE_PATHS.get(type_id, _GEMV_ONLY):
        if M <= max_m:
            if kernel == "rows":
                if rows:
                    return "rows", rows_config(type_id, M)
                if type_id in MMA_TYPES and M <= MMA_MAX_M:
                    return "mma", {"xs_dot": True}
                return None
            return kernel, config
    return None


def rows_config(type_id: int, M: int) -> dict:
    """gguf_rows' tile keyword arguments for M rows of a type_id weight (ROWS_CONFIGS)."""
    for max_m, config in ROWS_CONFIGS.get(type_id, ()):
        if M <= max_m:
            return config
    return {}


def subdot_config(type_id: int, M: int) -> dict:
    """gguf_subdot's keyword arguments for M rows of a type_id weight (SUBDOT_CONFIGS)."""
    for max_m, config in SUBDOT_CONFIGS.get(type_id, ()):
        if M <= max_m:
            return config
    return {}
