"""GPTQ int8 matmul: y [M, N] = x [M, K] @ W, W dequantized from 8-bit integers on the fly.

The layer's layout (quantization/gptq.py builds it once at load from the checkpoint's packing):
    qweight uint8 [K, N]      q, input rows in the order the kernels read them
    qzeros  uint8 [K/G, N]    z
    scales        [K/G, N]    s
    perm    int   [K] | None  act-order: row k of qweight is input perm[k] (the rows were
                              permuted once at load so that groups are contiguous)
    W[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]
    y = x[:, perm] @ W                                                      # [M, N]
At M = 1 the GEMV gathers the activations itself (perm[k] read beside the weight rows), not by a
separate gather per call.

Three ways to compute y (fp32 accumulation, result in x's dtype), picked by gptq_int8_gemm:
- M = 1 (_int8_gemv1_kernel): the weights read as int32 words [K, N/4] (byte c of word w is
  column 4w + c) in 16-byte loads. Each word is shifted four ways so that byte c sits at bits
  15..22; OR-ed into the mantissa of 1.0 that is 1 + q/256 exactly, in one LOP3 (no int-to-float
  conversion), and one FFMA adds x * (1 + q/256) to the thread's sum. Per step and column
  s * (sum x (1 + q/256) - (1 + z/256) sum x) = s * sum x (q - z) / 256 takes the zero point
  off. K is split so ~3 programs per SM stream weights.
- 2 <= M < DENSE_MIN_M (_int8_gemm_kernel): [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] tl.dot on
  weight tiles dequantized in registers to x's dtype (q through fp32's 2**23 trick, no I2F);
  split K for decode batches (M <= 16), whose few column blocks alone do not fill the SMs.
  Under act-order x is gathered once before it.
- M >= DENSE_MIN_M (prefill): dequantize once (_int8_dequantize_kernel) and call cuBLAS.
Split-K partial sums go by atomics to the shared zeroed fp32 workspace; the last program of a
tile (an arrival counter) writes y and re-zeroes it, so a call is one launch (split_k.py).
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import cdiv, dot_precision, jit, tl, use_triton
from tinypaged.kernels.awq_gemv import _gemv1_tile
from tinypaged.kernels.split_k import (
    programs_target,
    split_k_finish,
    split_k_range,
    split_k_store,
    split_k_workspace,
)

__all__ = ["DENSE_MIN_M", "GEMV_MAX_M", "gptq_int8_dequantize", "gptq_int8_dequantize_reference",
           "gptq_int8_gemm", "gptq_int8_gemm_reference", "int8_gemv_scales"]

GEMV_MAX_M = 16  # up to here K is split (decode batches)
DENSE_MIN_M = 128  # from here dequantize once and use torch.matmul


@jit
def _byte_partial(shifted, zero_shifted, x, x_sum, scale, one):
    # s * sum_r x_r (1 + q_r/256) - (1 + z/256) sum_r x_r over the thread's rows, [T, R, W] ->
    # [T, 1, W], for the byte at bits 15..22 of `shifted`. `one` (0x3F800000) arrives at run time
    # so ptxas keeps it in a register and fuses mask and OR into one LOP3.
    f = ((shifted & 0x7F8000) | one).to(tl.float32, bitcast=True)  # 1 + q / 256
    z = ((zero_shifted & 0x7F8000) | one).to(tl.float32, bitcast=True)  # [1, 1, W]
    return (tl.sum(x * f, axis=1, keep_dims=True) - z * x_sum) * scale


@jit
def _store_byte_column(acc, y_ptr, partial_ptr, w, c: tl.constexpr, w_mask, SPLIT: tl.constexpr):
    # column 4w + c of y: the [T, 1, W] sums reduced over T, times 256 (undoes the 1/256)
    col = tl.sum(acc, axis=0, keep_dims=True) * 256.0
    if not SPLIT:
        tl.store(y_ptr + 4 * w + c, col.to(y_ptr.dtype.element_ty), mask=w_mask)
    else:
        tl.atomic_add(partial_ptr + 4 * w + c, col, mask=w_mask, sem="relaxed")


@jit(do_not_specialize=("split_k",))
def _int8_gemv1_kernel(
    x_ptr, perm_ptr, qweight_ptr, qzeros_ptr, scales_ptr, y_ptr,  # x: [K]; words: [K, N/4]
    partial_ptr, count_ptr,  # fp32 [N] and int32 [cdiv(N, 4 * WORDS)], zero before and after
    N, K, stride_q, stride_sg, stride_sc, stride_sw, one, split_k,
    GROUP_SIZE: tl.constexpr, T: tl.constexpr, R: tl.constexpr, WORDS: tl.constexpr,
    HAS_PERM: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr,
):
    # grid: (cdiv(N / 4, WORDS), split_k). A step reads a [T * R, WORDS] tile of words (T * R
    # rows of one group) held as [T, R, WORDS]: lanes and warps cover T and WORDS (4 words = 16
    # bytes a load), each thread owns R rows. Per weight: one shift, one LOP3, one FFMA.
    pid_n = tl.program_id(0)
    BLOCK_K: tl.constexpr = T * R
    offs_w = pid_n * WORDS + tl.arange(0, WORDS)
    w_mask = (offs_w < stride_q)[None, None, :]  # [1, 1, WORDS]; stride_q = N / 4 words
    w = offs_w[None, None, :]
    rows = tl.arange(0, T)[:, None] * R + tl.arange(0, R)[None, :]  # [T, R]
    steps = K // BLOCK_K
    first, last = split_k_range(steps, split_k)
    acc0 = tl.zeros((T, 1, WORDS), tl.float32)  # column 4w + c of each word in acc<c>
    acc1 = tl.zeros((T, 1, WORDS), tl.float32)
    acc2 = tl.zeros((T, 1, WORDS), tl.float32)
    acc3 = tl.zeros((T, 1, WORDS), tl.float32)
    for step in tl.range(first, last, num_stages=STAGES):
        k0 = step * BLOCK_K
        g = k0 // GROUP_SIZE
        if HAS_PERM:
            src = tl.load(perm_ptr + k0 + rows)  # [T, R] the inputs these rows multiply
        else:
            src = k0 + rows
        x = tl.load(x_ptr + src).to(tl.float32)[:, :, None]  # [T, R, 1]
        words = tl.load(qweight_ptr + (k0 + rows[:, :, None]) * stride_q + w, mask=w_mask,
                        other=0)  # [T, R, WORDS]
        zw = tl.load(qzeros_ptr + g * stride_q + w, mask=w_mask, other=0)  # [1, 1, WORDS]
        sp = scales_ptr + g * stride_sg + w * stride_sw
        s0 = tl.load(sp, mask=w_mask).to(tl.float32)
        s1 = tl.load(sp + stride_sc, mask=w_mask).to(tl.float32)
        s2 = tl.load(sp + 2 * stride_sc, mask=w_mask).to(tl.float32)
        s3 = tl.load(sp + 3 * stride_sc, mask=w_mask).to(tl.float32)
        x_sum = tl.sum(x, axis=1, keep_dims=True)  # [T, 1, 1]
        # byte c (bits 8c..8c+7) to bits 15..22; >> is arithmetic, the mask drops the sign
        acc0 += _byte_partial(words << 15, zw << 15, x, x_sum, s0, one)
        acc1 += _byte_partial(words << 7, zw << 7, x, x_sum, s1, one)
        acc2 += _byte_partial(words >> 1, zw >> 1, x, x_sum, s2, one)
        acc3 += _byte_partial(words >> 9, zw >> 9, x, x_sum, s3, one)
    _store_byte_column(acc0, y_ptr, partial_ptr, w, 0, w_mask, SPLIT)
    _store_byte_column(acc1, y_ptr, partial_ptr, w, 1, w_mask, SPLIT)
    _store_byte_column(acc2, y_ptr, partial_ptr, w, 2, w_mask, SPLIT)
    _store_byte_column(acc3, y_ptr, partial_ptr, w, 3, w_mask, SPLIT)
    if SPLIT:
        offs_n = pid_n * WORDS * 4 + tl.arange(0, WORDS * 4)
        split_k_finish(y_ptr, partial_ptr, count_ptr, pid_n, split_k, offs_n, offs_n < N)


@jit(do_not_specialize=("M", "split_k"))
def _int8_gemm_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, y_ptr,  # x: [M, K] (permuted); y: [M, N]
    partial_ptr, count_ptr,  # with split K: fp32 [M, N], int32 [tiles], zero before and after
    M, N, K, stride_xm, stride_sg, stride_sc, stride_sw, split_k,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # grid: (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), split_k); GROUP_SIZE % BLOCK_K == 0, so a K
    # step has one row of zeros and scales
    tile = tl.program_id(0)
    n_blocks = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = tile // n_blocks, tile % n_blocks
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    s_cols = (offs_n % 4) * stride_sc + (offs_n // 4) * stride_sw  # [BLOCK_N] in scales
    steps = K // BLOCK_K
    first, last = split_k_range(steps, split_k)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for step in tl.range(first, last, num_stages=STAGES):
        k = step * BLOCK_K + offs_k
        g = step * BLOCK_K // GROUP_SIZE
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        q = tl.load(qweight_ptr + k[:, None] * N + offs_n[None, :], mask=n_mask[None, :],
                    other=0)  # uint8 [BLOCK_K, BLOCK_N]
        z = tl.load(qzeros_ptr + g * N + offs_n, mask=n_mask, other=0)  # uint8 [BLOCK_N]
        s = tl.load(scales_ptr + g * stride_sg + s_cols, mask=n_mask, other=0.0).to(tl.float32)
        # 2**23 + q exactly as fp32 by OR-ing q into 2**23's mantissa; minus 2**23 + z
        q_f = (q.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True)
        w = (q_f - (z.to(tl.float32) + 8388608.0)[None, :]) * s[None, :]
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
    at = offs_m[:, None] * N + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    split_k_store(acc, y_ptr, partial_ptr, at, mask, SPLIT)
    if SPLIT:
        split_k_finish(y_ptr, partial_ptr, count_ptr, tile, split_k, at, mask)


@jit
def _int8_dequantize_kernel(qweight_ptr, qzeros_ptr, scales_ptr, w_ptr, N, stride_sg, stride_sc,
                            stride_sw, GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr,
                            BLOCK_N: tl.constexpr):
    # grid: (K / BLOCK_K, cdiv(N, BLOCK_N)); w [K, N] = (q - z) * s
    k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    g = tl.program_id(0) * BLOCK_K // GROUP_SIZE
    q = tl.load(qweight_ptr + k[:, None] * N + offs_n[None, :], mask=n_mask[None, :], other=0)
    z = tl.load(qzeros_ptr + g * N + offs_n, mask=n_mask, other=0).to(tl.float32)
    s_cols = (offs_n % 4) * stride_sc + (offs_n // 4) * stride_sw
    s = tl.load(scales_ptr + g * stride_sg + s_cols, mask=n_mask, other=0.0).to(tl.float32)
    w = (q.to(tl.float32) - z[None, :]) * s[None, :]
    tl.store(w_ptr + k[:, None] * N + offs_n[None, :], w.to(w_ptr.dtype.element_ty),
             mask=n_mask[None, :])


# ----------------------------------------------------------------------------- launchers


def int8_gemv_scales(scales: torch.Tensor) -> torch.Tensor:
    """scales [K/G, N] -> [K/G, 4, N/4] with out[g, c, w] = scales[g, 4w + c]: the M = 1 kernel
    reads column 4w + c of a tile's words w in one coalesced load per c. Built once per layer."""
    G, N = scales.shape
    return scales.reshape(G, N // 4, 4).transpose(1, 2).contiguous()


def _scale_strides(scales, scales_t, N):
    """(tensor, stride_g, stride_c, stride_w): the scale of column 4w + c in group g."""
    if scales_t is None:
        return scales, N, 1, 4
    return scales_t, N, N // 4, 1


def _gemv1(x, qweight, qzeros, scales, perm, scales_t, block_n=128, rows=8, split_k=None,
           num_warps=4, num_stages=2):
    """M = 1: block_n columns (block_n / 4 words) per program, `rows` rows per thread a step."""
    K, N = qweight.shape
    G = K // qzeros.shape[0]
    T, R, words = _gemv1_tile(block_n, 4, num_warps, G, rows, "gptq_int8 GEMV")
    n_blocks = cdiv(N, block_n)
    steps = K // (T * R)
    if split_k is None:  # ~3 programs per SM, as the AWQ GEMV
        split_k = max(1, min(steps, cdiv(3 * programs_target(x.device) // 4, n_blocks)))
    split_k = cdiv(steps, cdiv(steps, split_k))  # drop splits that would get no step
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    partial, count = split_k_workspace(x.device, N, n_blocks)
    s, sg, sc, sw = _scale_strides(scales, scales_t, N)
    _int8_gemv1_kernel[(n_blocks, split_k)](
        x, x if perm is None else perm, qweight.view(torch.int32), qzeros.view(torch.int32), s, y,
        partial, count, N, K, N // 4, sg, sc, sw, 0x3F800000, split_k,
        GROUP_SIZE=G, T=T, R=R, WORDS=words, HAS_PERM=perm is not None, SPLIT=split_k > 1,
        STAGES=num_stages, num_warps=num_warps,
    )
    return y


def _gemm(x, qweight, qzeros, scales, scales_t, block_m=None, block_n=None, block_k=64,
          split_k=None, num_warps=4, num_stages=3):
    """2 <= M: tiled tl.dot on x already permuted; K split while M <= GEMV_MAX_M."""
    M, K = x.shape
    N = qweight.shape[1]
    G = K // qzeros.shape[0]
    block_m = block_m or (16 if M <= GEMV_MAX_M else 64)
    block_n = block_n or 128
    block_k = min(block_k, G)
    tiles = cdiv(M, block_m) * cdiv(N, block_n)
    steps = K // block_k
    if split_k is None:  # ~2 programs per SM for decode batches, no split above
        split_k = max(1, min(steps, cdiv(programs_target(x.device) // 2, tiles))) \
            if M <= GEMV_MAX_M else 1
    split_k = cdiv(steps, cdiv(steps, split_k))
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    partial, count = split_k_workspace(x.device, M * N, tiles) if split_k > 1 else (y, y)
    s, sg, sc, sw = _scale_strides(scales, scales_t, N)
    _int8_gemm_kernel[(tiles, split_k)](
        x, qweight, qzeros, s, y, partial, count, M, N, K, x.stride(0), sg, sc, sw, split_k,
        GROUP_SIZE=G, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT=split_k > 1, STAGES=num_stages,
        DOT_PRECISION=dot_precision(x.dtype), num_warps=num_warps,
    )
    return y


def _check(x, qweight, qzeros, scales, perm) -> None:
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.shape[1] % 4:
        raise ValueError(f"gptq_int8_gemm: qweight must be uint8 [K, N] with N a multiple of 4, "
                         f"got {qweight.dtype} of shape {list(qweight.shape)}")
    K, N = qweight.shape
    groups = qzeros.shape[0]
    if qzeros.dtype != torch.uint8 or groups == 0 or K % groups or list(qzeros.shape) != \
            [groups, N] or list(scales.shape) != [groups, N] or (K // groups) % 16:
        raise ValueError(f"gptq_int8_gemm: qzeros (uint8) and scales must be [K/G, N] with G a "
                         f"multiple of 16 dividing K={K}, got {qzeros.dtype} "
                         f"{list(qzeros.shape)} and {list(scales.shape)}")
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"gptq_int8_gemm: x must be [M, K={K}], got {list(x.shape)}")
    if perm is not None and perm.shape != (K,):
        raise ValueError(f"gptq_int8_gemm: perm must hold K={K} input indices, got "
                         f"{list(perm.shape)}")


def gptq_int8_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
                   scales: torch.Tensor, perm: torch.Tensor | None = None,
                   scales_t: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x[:, perm] [M, K] @ ((q - z) * s), fp32 accumulation, in x's dtype.

    scales_t: optionally int8_gemv_scales(scales), which the M = 1 kernel reads faster."""
    _check(x, qweight, qzeros, scales, perm)
    if not use_triton(x):
        return gptq_int8_gemm_reference(x, qweight, qzeros, scales, perm, scales_t)
    M = x.shape[0]
    if M == 0:
        return x.new_empty(0, qweight.shape[1])
    x = x if x.stride(1) == 1 else x.contiguous()
    if M == 1:
        return _gemv1(x, qweight, qzeros, scales, perm, scales_t)
    # M >= 2 gathers x once: a tiled kernel reading x through perm makes every load of x wait
    # for a load of perm, which stalls its pipeline; the M = 1 GEMV's many rows per program
    # hide that latency, so it gathers inside
    x = x if perm is None else x.index_select(1, perm)
    if M < DENSE_MIN_M:
        return _gemm(x, qweight, qzeros, scales, scales_t)
    return x @ gptq_int8_dequantize(qweight, qzeros, scales, x.dtype)


def gptq_int8_gemm_reference(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
                             scales: torch.Tensor, perm: torch.Tensor | None = None,
                             scales_t: torch.Tensor | None = None) -> torch.Tensor:
    """The definition, in fp32: x[:, perm] @ gptq_int8_dequantize_reference(...)."""
    x32 = x.float() if perm is None else x.float().index_select(1, perm)
    return (x32 @ gptq_int8_dequantize_reference(qweight, qzeros, scales)).to(x.dtype)


def gptq_int8_dequantize_reference(qweight: torch.Tensor, qzeros: torch.Tensor,
                                   scales: torch.Tensor) -> torch.Tensor:
    """W [K, N] = (q - z[k // G]) * s[k // G] in fp32."""
    G = qweight.shape[0] // qzeros.shape[0]
    z = qzeros.float().repeat_interleave(G, dim=0)
    return (qweight.float() - z) * scales.float().repeat_interleave(G, dim=0)


def gptq_int8_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                         dtype: torch.dtype) -> torch.Tensor:
    """Dense W [K, N] in `dtype`: one Triton pass on CUDA (the reference elsewhere)."""
    if not use_triton(qweight):
        return gptq_int8_dequantize_reference(qweight, qzeros, scales).to(dtype)
    K, N = qweight.shape
    G = K // qzeros.shape[0]
    w = torch.empty(K, N, dtype=dtype, device=qweight.device)
    block_k, block_n = min(32, G), 128
    _int8_dequantize_kernel[(K // block_k, cdiv(N, block_n))](
        qweight, qzeros, scales, w, N, N, 1, 4, GROUP_SIZE=G, BLOCK_K=block_k, BLOCK_N=block_n)
    return w
