"""GGUF block-quantized matmul: y [M, N] = x [M, K] @ W^T with W kept in its GGUF blocks.

W is the uint8 `qweight [N, row_bytes]` of one GGML type (gguf_format.py has the layouts): row n
holds output feature n as K / block_elems blocks. Every type is read the same way: a program
takes BLOCK_N rows and walks K in chunks of 256 weights (one k-quant super-block, or 8 legacy
blocks of 32), viewing a chunk as [SUBS, SUBLEN] sub-blocks that each share one scale and min:

    W[n, 256 c + SUBLEN s + j] = scale[n, c, s] * q[n, c, s, j] + min[n, c, s]

(`_chunk_parts` decodes q, scale and min from the bytes of each type). The decode GEMV
(M <= GEMV_MAX_M) never writes W out: at M = 1 each thread accumulates (scale * q + min) * x
for its weights and reduces once at the end; for 2 <= M <= 8 the M rows share each decoded
chunk through, per sub-block,

    y[m, n] += scale * sum_j q[j] x[m, j] + min * sum_j x[m, j]

so the packed bytes are read once per step whatever M. Larger M (prefill) dequantizes W into
x's dtype with `_gguf_dequantize_kernel` and multiplies with cuBLAS, where the matmul, not the
weight read, is the cost.

The weight bytes reach the kernels through three views of the same memory (uint8, int8 and
fp16), so that signed quants and fp16 fields load with their own type; every fp16 field sits at
an even byte offset, since all block sizes are even.
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import cdiv, jit, next_power_of_2, tl, use_triton
from tinypaged.kernels.gguf_format import (
    DENSE_TYPES,
    ggml_type,
    gguf_dequantize_reference,
    gguf_linear_reference,
    row_bytes,
)

GEMV_MAX_M = 8  # up to this many rows of x the GEMV streams W; more: dequantize + cuBLAS
CHUNK = 256
# type id -> (SUBS, SUBLEN): the sub-blocks of a 256-weight chunk that share a scale (and min)
LAYOUTS = {2: (8, 32), 3: (8, 32), 8: (8, 32), 12: (8, 32), 13: (8, 32), 14: (16, 16)}


@jit
def _f16_at(f16_ptr, byte_offsets, mask):
    return tl.load(f16_ptr + byte_offsets // 2, mask=mask, other=0.0).to(tl.float32)


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
def _chunk_parts(u8_ptr, i8_ptr, f16_ptr, row_off, c, s, j, mask,
                 QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    # Chunk c of the rows starting at byte row_off [BN, 1, 1]; s [1, SUBS, 1] sub-block,
    # j [1, 1, SUBLEN] weight within it, mask [BN, SUBS, 1] the sub-blocks that exist.
    # -> q [BN, SUBS, SUBLEN], scale and min [BN, SUBS, 1], all fp32: w = scale * q + min.
    if QTYPE == 12 or QTYPE == 13 or QTYPE == 14:  # k-quants: one super-block a chunk
        blk = row_off + c * BLOCK_BYTES + 0 * s  # [BN, SUBS, 1]
    else:  # legacy: 8 blocks a chunk, sub-block s is block 8c + s
        blk = row_off + (c * 8 + s) * BLOCK_BYTES
    if QTYPE == 8:  # Q8_0: d | int8 q[32]
        scale = _f16_at(f16_ptr, blk, mask)
        q = tl.load(i8_ptr + blk + 2 + j, mask=mask, other=0).to(tl.float32)
        mn = tl.zeros_like(scale)
    elif QTYPE == 2 or QTYPE == 3:  # Q4_0: d | qs[16]; Q4_1: d | m | qs[16]
        QS: tl.constexpr = 2 if QTYPE == 2 else 4
        scale = _f16_at(f16_ptr, blk, mask)
        byte = tl.load(u8_ptr + blk + QS + j % 16, mask=mask, other=0).to(tl.int32)
        q = ((byte >> (j // 16 * 4)) & 0xF).to(tl.float32)
        if QTYPE == 2:
            mn = -8.0 * scale
        else:
            mn = _f16_at(f16_ptr, blk + 2, mask)
    elif QTYPE == 12 or QTYPE == 13:  # Q4_K / Q5_K: d | dmin | sc[12] | (qh[32]) | qs[128]
        QS: tl.constexpr = 16 if QTYPE == 12 else 48
        d = _f16_at(f16_ptr, blk, mask)
        dmin = _f16_at(f16_ptr, blk + 2, mask)
        sc, m = _k_scale_min(u8_ptr, blk + 4, s, mask)
        byte = tl.load(u8_ptr + blk + QS + s // 2 * 32 + j, mask=mask, other=0).to(tl.int32)
        qi = (byte >> (s % 2 * 4)) & 0xF
        if QTYPE == 13:
            high = tl.load(u8_ptr + blk + 16 + j, mask=mask, other=0).to(tl.int32)
            qi = qi | (((high >> s) & 1) << 4)
        q = qi.to(tl.float32)
        scale = d * sc
        mn = -dmin * m
    else:  # Q6_K: ql[128] | qh[64] | int8 sc[16] | d; sub-block s = 8 n + 2 i + t
        n = s // 8
        i = s % 8 // 2
        pos = s % 2 * 16 + j  # l of the format description (gguf_format.py), 0..31
        low = tl.load(u8_ptr + blk + n * 64 + i % 2 * 32 + pos, mask=mask, other=0).to(tl.int32)
        high = tl.load(u8_ptr + blk + 128 + n * 32 + pos, mask=mask, other=0).to(tl.int32)
        qi = ((low >> (i // 2 * 4)) & 0xF) | (((high >> (2 * i)) & 3) << 4)
        q = qi.to(tl.float32) - 32.0
        sc = tl.load(i8_ptr + blk + 192 + s, mask=mask, other=0).to(tl.float32)
        scale = _f16_at(f16_ptr, blk + 208, mask) * sc
        mn = tl.zeros_like(scale)
    return q, scale, mn


@jit
def _sub_block_mask(rows, N, c, s, K, SUBLEN: tl.constexpr):
    # [BN, SUBS, 1]: the row exists and the sub-block starts before K (legacy rows of 576)
    return (rows < N)[:, None, None] & (c * 256 + s * SUBLEN < K)


@jit(do_not_specialize=("M",))
def _gguf_gemv_kernel(
    x_ptr, u8_ptr, i8_ptr, f16_ptr, y_ptr,  # x [M, K]; qweight [N, stride_w] bytes; y [M, N]
    M, N, K, stride_xm, stride_w, stride_ym,
    QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr, SUBS: tl.constexpr, SUBLEN: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
):
    # grid: (cdiv(N, BLOCK_N),). Each program owns BLOCK_N rows of W and all M rows of x.
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_off = (rows.to(tl.int64) * stride_w)[:, None, None]  # [BN, 1, 1]
    s = tl.arange(0, SUBS)[None, :, None]
    j = tl.arange(0, SUBLEN)[None, None, :]
    m_idx = tl.arange(0, BLOCK_M)[None, :]
    if BLOCK_M == 1:
        # batch 1: every thread keeps its own running products, and the sums that cross
        # threads (shuffles) happen once at the end instead of once per chunk
        acc3 = tl.zeros((BLOCK_N, SUBS, SUBLEN), tl.float32)
        for c in range(tl.cdiv(K, 256)):
            mask = _sub_block_mask(rows, N, c, s, K, SUBLEN)
            q, scale, mn = _chunk_parts(u8_ptr, i8_ptr, f16_ptr, row_off, c, s, j, mask,
                                        QTYPE, BLOCK_BYTES)
            k = c * 256 + s * SUBLEN + j  # [1, SUBS, SUBLEN]
            x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            acc3 += (q * scale + mn) * x
        acc = tl.sum(tl.sum(acc3, axis=2), axis=1)[:, None]  # [BN, 1]
    else:
        # M rows of x share each decoded chunk: y[m] += scale * (q . x[m]) + min * sum(x[m])
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for c in range(tl.cdiv(K, 256)):
            mask = _sub_block_mask(rows, N, c, s, K, SUBLEN)
            q, scale, mn = _chunk_parts(u8_ptr, i8_ptr, f16_ptr, row_off, c, s, j, mask,
                                        QTYPE, BLOCK_BYTES)
            k = c * 256 + s * SUBLEN + j
            for mi in tl.static_range(BLOCK_M):
                x = tl.load(x_ptr + mi * stride_xm + k, mask=(k < K) & (mi < M),
                            other=0.0).to(tl.float32)
                qx = tl.sum(q * x, axis=2, keep_dims=True)  # [BN, SUBS, 1]
                xs = tl.sum(x, axis=2, keep_dims=True)  # [1, SUBS, 1]
                part = tl.sum(tl.sum(qx * scale + mn * xs, axis=2), axis=1)  # [BN]
                acc += tl.where(m_idx == mi, part[:, None], 0.0)
    y_mask = (rows < N)[:, None] & (m_idx < M)
    tl.store(y_ptr + m_idx * stride_ym + rows[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=y_mask)


@jit
def _gguf_dequantize_kernel(
    u8_ptr, i8_ptr, f16_ptr, w_ptr,  # qweight [N, stride_w] bytes -> w [N, K]
    N, K, stride_w,
    QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr, SUBS: tl.constexpr, SUBLEN: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # grid: (cdiv(N, BLOCK_N), cdiv(K, 256)): one chunk of BLOCK_N rows per program
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.program_id(1)
    row_off = (rows.to(tl.int64) * stride_w)[:, None, None]
    s = tl.arange(0, SUBS)[None, :, None]
    j = tl.arange(0, SUBLEN)[None, None, :]
    mask = _sub_block_mask(rows, N, c, s, K, SUBLEN)
    q, scale, mn = _chunk_parts(u8_ptr, i8_ptr, f16_ptr, row_off, c, s, j, mask,
                                QTYPE, BLOCK_BYTES)
    k = c * 256 + s * SUBLEN + j
    w = scale * q + mn  # [BN, SUBS, SUBLEN]
    tl.store(w_ptr + rows.to(tl.int64)[:, None, None] * K + k, w.to(w_ptr.dtype.element_ty),
             mask=mask & (k < K))


def _views(qweight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qweight = qweight.contiguous()
    return qweight, qweight.view(torch.int8), qweight.view(torch.float16)


def _check(qweight: torch.Tensor, type_id: int, K: int, what: str) -> None:
    expected = row_bytes(type_id, K)
    if qweight.dim() != 2 or qweight.dtype != torch.uint8 or qweight.shape[1] != expected:
        raise ValueError(f"{what}: a {ggml_type(type_id).name} weight with K={K} is uint8 "
                         f"[N, {expected}]; got {qweight.dtype} {list(qweight.shape)}")


def gguf_dequantize(qweight: torch.Tensor, type_id: int, K: int,
                    dtype: torch.dtype = torch.float32, block_n: int = 16) -> torch.Tensor:
    """W [N, K] in `dtype` from qweight uint8 [N, row_bytes] of GGML type `type_id`."""
    _check(qweight, type_id, K, "gguf_dequantize")
    if type_id in DENSE_TYPES:
        return qweight.contiguous().view(DENSE_TYPES[type_id]).to(dtype)
    if not use_triton(qweight):
        return gguf_dequantize_reference(qweight, type_id, K).to(dtype)
    N = qweight.shape[0]
    w = torch.empty(N, K, dtype=dtype, device=qweight.device)
    subs, sublen = LAYOUTS[type_id]
    _gguf_dequantize_kernel[(cdiv(N, block_n), cdiv(K, CHUNK))](
        *_views(qweight), w, N, K, qweight.shape[1], QTYPE=type_id,
        BLOCK_BYTES=ggml_type(type_id).block_bytes, SUBS=subs, SUBLEN=sublen, BLOCK_N=block_n,
    )
    return w


def gguf_gemv(x: torch.Tensor, qweight: torch.Tensor, type_id: int, block_n: int = 8,
              num_warps: int = 4) -> torch.Tensor:
    """The decode GEMV: y [M, N] = x [M, K] @ W^T for M <= GEMV_MAX_M, fp32 accumulation."""
    M, K = x.shape
    if M > GEMV_MAX_M:
        raise ValueError(f"gguf_gemv takes at most {GEMV_MAX_M} rows of x, got {M}")
    _check(qweight, type_id, K, "gguf_gemv")
    x = x.contiguous()
    N = qweight.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    subs, sublen = LAYOUTS[type_id]
    _gguf_gemv_kernel[(cdiv(N, block_n),)](
        x, *_views(qweight), y, M, N, K, x.stride(0), qweight.shape[1], y.stride(0),
        QTYPE=type_id, BLOCK_BYTES=ggml_type(type_id).block_bytes, SUBS=subs, SUBLEN=sublen,
        BLOCK_N=block_n, BLOCK_M=next_power_of_2(M), num_warps=num_warps,
    )
    return y


def gguf_linear(x: torch.Tensor, qweight: torch.Tensor, type_id: int) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T in x's dtype: the GEMV for decode-sized M, else dequantize +
    cuBLAS; the torch reference off the GPU."""
    K = x.shape[-1]
    _check(qweight, type_id, K, "gguf_linear")
    if type_id in DENSE_TYPES:
        return x @ gguf_dequantize(qweight, type_id, K, x.dtype).T
    if not use_triton(x):
        return gguf_linear_reference(x, qweight, type_id)
    if x.shape[0] == 0:
        return x.new_empty(0, qweight.shape[0])
    if x.shape[0] <= GEMV_MAX_M:
        return gguf_gemv(x, qweight, type_id)
    return x @ gguf_dequantize(qweight, type_id, K, x.dtype).T
