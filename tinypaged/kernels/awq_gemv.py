"""The AWQ decode GEMVs: y [M, N] = x [M, K] @ W for M = 1 and 2 <= M <= 16.

W is the AutoAWQ packing (awq_format.py): qweight int32 [K, N/8], column 8w + c of word w at
nibble [0, 4, 1, 5, 2, 6, 3, 7][c], W[k, n] = (q - z) * s per group of G rows. Decode reads
each weight once per step, so these kernels are bound by streaming a quarter of the bf16 bytes,
and their arithmetic per weight has to stay small:
- M = 1 (_awq_gemv1_kernel): a nibble ORed into the mantissa of 1.0 is 1 + q * 2**(pos - 23)
  in one LOP3 (no int-to-float conversion); one FFMA multiplies it by x into the thread's row
  sum, and zero point, offset and scale are applied per step and column through sum(x).
- 2 <= M <= 16 (_awq_gemv_kernel): M FMAs per weight would be too many, so each of the 8
  columns of a word gets its own tl.dot over a K step, fed weights built by OR-ing the nibble into
  the bits of 128.0 (bf16) or 1024.0 (fp16); offset and zero point come off through sum(x).
  With asm=True (the GPU) the weights are q - z already, two per instruction (awq_unpack.py's
  paired PTX), and sum(x) is not needed. awq_mma.py is the other decode kernel (the weights in
  the MMA's M slot); awq.DECODE_PATHS picks per shape.
Both split K so ~2-3 programs per SM stream weights, pipeline tiles through shared memory
(tl.range num_stages), read scales from gemv_scales' [K/G, 8, N/8] copy (coalesced), and finish in
one launch (split_k.py): split-K partial sums go by atomics to a persistent zeroed fp32
workspace, and the last program of each column block (an arrival counter) writes y and re-zeroes
it.
The figures behind these choices: benchmarks/RESULTS.md (current), RESULTS-log.md (experiments).
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import cdiv, dot_precision, jit, tl
from tinypaged.kernels.awq_unpack import MAGIC16, _asm_nibble_minus_zero
from tinypaged.kernels.split_k import (
    programs_target,
    split_k_finish,
    split_k_range,
    split_k_store,
    split_k_workspace,
)

# ----------------------------------------------------------------------------- batch-1 kernel


@jit
def _nibble_fraction(words, pos: tl.constexpr, one):
    # int32 words -> fp32 1 + q * 2**(pos - 23), q the nibble at bits pos..pos+3 (pos <= 19):
    # OR-ing the nibble into the mantissa of 1.0 converts it exactly in one instruction. `one`
    # (0x3F800000, the bits of 1.0) arrives at run time so that ptxas keeps it in a register and
    # fuses the mask and the OR into one LOP3 (two immediates do not fit one instruction).
    return ((words & (0xF << pos)) | one).to(tl.float32, bitcast=True)


@jit
def _column_partial(words, zero_words, x, x_sum, scale, pos: tl.constexpr, one):
    # s * sum_r x_r (q_r - z) * 2**(pos - 23) over the thread's rows: [T, R, W] -> [T, 1, W].
    # With u = 2**(pos - 23): sum_r x_r (1 + q_r u) - (1 + z u) sum_r x_r = u sum_r x_r (q_r - z),
    # so a weight costs one LOP3 and one FFMA. The 1 + .. offset is 2**(23 - pos) <= 256 weight
    # steps, which costs at most 8 of fp32's 24 bits before the subtraction.
    f = _nibble_fraction(words, pos, one)  # [T, R, W]
    z = _nibble_fraction(zero_words, pos, one)  # [1, 1, W]
    return (tl.sum(x * f, axis=1, keep_dims=True) - z * x_sum) * scale


@jit(do_not_specialize=("split_k",))
def _awq_gemv1_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, y_ptr,  # x: [K]; y: [N]
    partial_ptr, count_ptr,  # fp32 [N] and int32 [cdiv(N, BLOCK_N)], zero before and after
    N, K, stride_q, stride_sg, stride_sc, stride_sw, one, split_k,
    GROUP_SIZE: tl.constexpr, T: tl.constexpr, R: tl.constexpr, WORDS: tl.constexpr,
    SPLIT: tl.constexpr,  # split_k > 1
    STAGES: tl.constexpr,
):
    # M = 1 (batch-1 decode). grid: (cdiv(N / 8, WORDS), split_k). A step reads a [T * R, WORDS]
    # tile of packed words (T * R rows of one group), held as [T, R, WORDS]: the launcher sizes T
    # so that lanes and warps cover T and WORDS (4 words = 16 bytes a load) and each thread owns
    # R rows. Each word is shifted four ways so that nibble pairs land at bits 15 and 19
    # (_column_partial's positions); per weight that is half a shift, one LOP3 and one FFMA.
    # Column c of a word is nibble [0, 4, 1, 5, 2, 6, 3, 7][c] (AWQ_PACK_ORDER): nibble i sits in
    # shifted copy i // 2 at bit 15 + 4 * (i % 2).
    pid_n = tl.program_id(0)
    BLOCK_K: tl.constexpr = T * R
    offs_w = pid_n * WORDS + tl.arange(0, WORDS)
    w_mask = (offs_w < stride_q)[None, None, :]  # [1, 1, WORDS]; stride_q = N / 8 words
    w = offs_w[None, None, :]
    rows = tl.arange(0, T)[:, None] * R + tl.arange(0, R)[None, :]  # [T, R]
    steps = K // BLOCK_K
    first, last = split_k_range(steps, split_k)
    # one [T, 1, WORDS] fp32 sum per column 8w + c of each word (AWQ_PACK_ORDER: nibble i holds
    # column [0, 2, 4, 6, 1, 3, 5, 7][i], so the even columns are low nibbles)
    acc0 = tl.zeros((T, 1, WORDS), tl.float32)
    acc1 = tl.zeros((T, 1, WORDS), tl.float32)
    acc2 = tl.zeros((T, 1, WORDS), tl.float32)
    acc3 = tl.zeros((T, 1, WORDS), tl.float32)
    acc4 = tl.zeros((T, 1, WORDS), tl.float32)
    acc5 = tl.zeros((T, 1, WORDS), tl.float32)
    acc6 = tl.zeros((T, 1, WORDS), tl.float32)
    acc7 = tl.zeros((T, 1, WORDS), tl.float32)
    # tl.range pipelines the loads through shared memory (cp.async): the next STAGES - 1 steps'
    # tiles are in flight while this step computes
    for step in tl.range(first, last, num_stages=STAGES):
        k0 = step * BLOCK_K
        g = k0 // GROUP_SIZE
        x = tl.load(x_ptr + k0 + rows).to(tl.float32)[:, :, None]  # [T, R, 1]
        lo = tl.load(qweight_ptr + (k0 + rows[:, :, None]) * stride_q + w, mask=w_mask,
                     other=0)  # [T, R, WORDS]
        zlo = tl.load(qzeros_ptr + g * stride_q + w, mask=w_mask, other=0)  # [1, 1, WORDS]
        s0, s1, s2, s3, s4, s5, s6, s7 = _load_scales(
            scales_ptr + g * stride_sg + w * stride_sw, stride_sc, w_mask)
        x_sum = tl.sum(x, axis=1, keep_dims=True)  # [T, 1, 1]
        # nibbles (0, 1), (2, 3), (4, 5), (6, 7) to bits (15, 19)
        v0, v1, v2, v3 = lo << 15, lo << 7, lo >> 1, lo >> 9
        z0, z1, z2, z3 = zlo << 15, zlo << 7, zlo >> 1, zlo >> 9
        acc0 += _column_partial(v0, z0, x, x_sum, s0, 15, one)  # nibble 0
        acc1 += _column_partial(v2, z2, x, x_sum, s1, 15, one)  # nibble 4
        acc2 += _column_partial(v0, z0, x, x_sum, s2, 19, one)  # nibble 1
        acc3 += _column_partial(v2, z2, x, x_sum, s3, 19, one)  # nibble 5
        acc4 += _column_partial(v1, z1, x, x_sum, s4, 15, one)  # nibble 2
        acc5 += _column_partial(v3, z3, x, x_sum, s5, 15, one)  # nibble 6
        acc6 += _column_partial(v1, z1, x, x_sum, s6, 19, one)  # nibble 3
        acc7 += _column_partial(v3, z3, x, x_sum, s7, 19, one)  # nibble 7
    # 2**(23 - pos) undoes _column_partial's u
    _store_column(acc0, 256.0, y_ptr, partial_ptr, w, 0, w_mask, SPLIT)
    _store_column(acc1, 256.0, y_ptr, partial_ptr, w, 1, w_mask, SPLIT)
    _store_column(acc2, 16.0, y_ptr, partial_ptr, w, 2, w_mask, SPLIT)
    _store_column(acc3, 16.0, y_ptr, partial_ptr, w, 3, w_mask, SPLIT)
    _store_column(acc4, 256.0, y_ptr, partial_ptr, w, 4, w_mask, SPLIT)
    _store_column(acc5, 256.0, y_ptr, partial_ptr, w, 5, w_mask, SPLIT)
    _store_column(acc6, 16.0, y_ptr, partial_ptr, w, 6, w_mask, SPLIT)
    _store_column(acc7, 16.0, y_ptr, partial_ptr, w, 7, w_mask, SPLIT)
    if SPLIT:  # the last split of this column block writes y (split_k.py)
        offs_n = pid_n * WORDS * 8 + tl.arange(0, WORDS * 8)
        split_k_finish(y_ptr, partial_ptr, count_ptr, pid_n, split_k, offs_n, offs_n < N)


@jit
def _load_scales(ptrs, stride_c, mask):
    # the scales of columns 8w + 0..7 (ptrs: column 8w + 0), each [1, 1, WORDS] in fp32
    return (tl.load(ptrs, mask=mask).to(tl.float32),
            tl.load(ptrs + stride_c, mask=mask).to(tl.float32),
            tl.load(ptrs + 2 * stride_c, mask=mask).to(tl.float32),
            tl.load(ptrs + 3 * stride_c, mask=mask).to(tl.float32),
            tl.load(ptrs + 4 * stride_c, mask=mask).to(tl.float32),
            tl.load(ptrs + 5 * stride_c, mask=mask).to(tl.float32),
            tl.load(ptrs + 6 * stride_c, mask=mask).to(tl.float32),
            tl.load(ptrs + 7 * stride_c, mask=mask).to(tl.float32))


@jit
def _store_column(acc, unscale, y_ptr, partial_ptr, w, c: tl.constexpr, w_mask,
                  SPLIT: tl.constexpr):
    # column 8w + c of y: the [T, 1, WORDS] sums reduced over T, times 2**(23 - pos)
    col = tl.sum(acc, axis=0, keep_dims=True) * unscale  # [1, 1, WORDS]
    if not SPLIT:
        tl.store(y_ptr + 8 * w + c, col.to(y_ptr.dtype.element_ty), mask=w_mask)
    else:
        tl.atomic_add(partial_ptr + 8 * w + c, col, mask=w_mask, sem="relaxed")


# ----------------------------------------------------------------------------- batched kernel


@jit
def _dot_column(x, words, zero_words, x_sum, scale, shift: tl.constexpr, MAGIC16: tl.constexpr,
                OFFSET: tl.constexpr, DOT_PRECISION: tl.constexpr, ASM: tl.constexpr = False):
    # s * (x @ (q - z)) for the column whose nibble sits at `shift`: [M, BK] x [BK, W] -> [M, W].
    # 16-bit x: MAGIC16 | q is OFFSET + q exactly as bf16 (0x4300: 128 + q) or fp16 (0x6400:
    # 1024 + q), two instructions a weight; x @ (OFFSET + q) - (OFFSET + z) * sum(x) is the
    # product with q - z. fp32 x: q through fp32's 2**23 trick, OFFSET = 0.
    if ASM:
        zf = ((zero_words >> shift) & 0xF).to(tl.float32)
        nz = (-(OFFSET + zf)).to(x.dtype)[None, :]  # [1, W]
        w = _asm_nibble_minus_zero(words, nz, shift, MAGIC16, x.dtype)
        res = tl.dot(x, w, input_precision=DOT_PRECISION) * scale[None, :]
    else:
        nibbles = (words >> shift) & 0xF  # [BK, W]
        if MAGIC16:
            w = (nibbles | MAGIC16).to(tl.int16).to(x.dtype, bitcast=True)
        else:
            w = (nibbles | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        z = ((zero_words >> shift) & 0xF).to(tl.float32)  # [W]
        xw = tl.dot(x, w, input_precision=DOT_PRECISION)  # [M, W] fp32
        res = (xw - x_sum * (OFFSET + z)[None, :]) * scale[None, :]
    return res


@jit(do_not_specialize=("M", "split_k"))
def _awq_gemv_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, y_ptr,  # x: [M, K]; y: [M, N]
    partial_ptr, count_ptr,  # fp32 [M, N] and int32 [cdiv(N, 8 * WORDS)], zero before and after
    M, N, K, stride_xm, stride_q, stride_sg, stride_sc, stride_sw, split_k,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, WORDS: tl.constexpr, BLOCK_K: tl.constexpr,
    MAGIC16: tl.constexpr, OFFSET: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ASM: tl.constexpr = False,
):
    # 2 <= M <= 16 (batched decode). grid: (cdiv(N / 8, WORDS), split_k). Memory-bound like
    # M = 1, but the M rows make CUDA-core FMAs too many, so each of the 8 columns of a word gets
    # its own tl.dot over a K step (BLOCK_K rows of one group): 8 [BLOCK_M, BLOCK_K] x
    # [BLOCK_K, WORDS] products whose cost does not grow with M.
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_w = pid_n * WORDS + tl.arange(0, WORDS)
    w_mask = offs_w < stride_q  # stride_q = N / 8 words
    offs_k = tl.arange(0, BLOCK_K)
    steps = K // BLOCK_K
    first, last = split_k_range(steps, split_k)
    acc0 = tl.zeros((BLOCK_M, WORDS), tl.float32)  # column 8w + c of each word in acc<c>
    acc1 = tl.zeros((BLOCK_M, WORDS), tl.float32)
    acc2 = tl.zeros((BLOCK_M, WORDS), tl.float32)
    acc3 = tl.zeros((BLOCK_M, WORDS), tl.float32)
    acc4 = tl.zeros((BLOCK_M, WORDS), tl.float32)
    acc5 = tl.zeros((BLOCK_M, WORDS), tl.float32)
    acc6 = tl.zeros((BLOCK_M, WORDS), tl.float32)
    acc7 = tl.zeros((BLOCK_M, WORDS), tl.float32)
    for step in tl.range(first, last, num_stages=STAGES):
        k = step * BLOCK_K + offs_k
        g = step * BLOCK_K // GROUP_SIZE
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        words = tl.load(qweight_ptr + k[:, None] * stride_q + offs_w[None, :],
                        mask=w_mask[None, :], other=0)  # [BLOCK_K, WORDS]
        zw = tl.load(qzeros_ptr + g * stride_q + offs_w, mask=w_mask, other=0)  # [WORDS]
        s0, s1, s2, s3, s4, s5, s6, s7 = _load_scales(
            scales_ptr + g * stride_sg + offs_w * stride_sw, stride_sc, w_mask)
        x_sum = tl.sum(x.to(tl.float32), axis=1)[:, None]  # [BLOCK_M, 1]
        # column c sits at shift 4 * [0, 4, 1, 5, 2, 6, 3, 7][c]
        acc0 += _dot_column(x, words, zw, x_sum, s0, 0, MAGIC16, OFFSET, DOT_PRECISION, ASM)
        acc1 += _dot_column(x, words, zw, x_sum, s1, 16, MAGIC16, OFFSET, DOT_PRECISION, ASM)
        acc2 += _dot_column(x, words, zw, x_sum, s2, 4, MAGIC16, OFFSET, DOT_PRECISION, ASM)
        acc3 += _dot_column(x, words, zw, x_sum, s3, 20, MAGIC16, OFFSET, DOT_PRECISION, ASM)
        acc4 += _dot_column(x, words, zw, x_sum, s4, 8, MAGIC16, OFFSET, DOT_PRECISION, ASM)
        acc5 += _dot_column(x, words, zw, x_sum, s5, 24, MAGIC16, OFFSET, DOT_PRECISION, ASM)
        acc6 += _dot_column(x, words, zw, x_sum, s6, 12, MAGIC16, OFFSET, DOT_PRECISION, ASM)
        acc7 += _dot_column(x, words, zw, x_sum, s7, 28, MAGIC16, OFFSET, DOT_PRECISION, ASM)
    rows = offs_m[:, None] * N
    mask = m_mask[:, None] & w_mask[None, :]
    cols = 8 * offs_w[None, :]
    split_k_store(acc0, y_ptr, partial_ptr, rows + cols + 0, mask, SPLIT)
    split_k_store(acc1, y_ptr, partial_ptr, rows + cols + 1, mask, SPLIT)
    split_k_store(acc2, y_ptr, partial_ptr, rows + cols + 2, mask, SPLIT)
    split_k_store(acc3, y_ptr, partial_ptr, rows + cols + 3, mask, SPLIT)
    split_k_store(acc4, y_ptr, partial_ptr, rows + cols + 4, mask, SPLIT)
    split_k_store(acc5, y_ptr, partial_ptr, rows + cols + 5, mask, SPLIT)
    split_k_store(acc6, y_ptr, partial_ptr, rows + cols + 6, mask, SPLIT)
    split_k_store(acc7, y_ptr, partial_ptr, rows + cols + 7, mask, SPLIT)
    if SPLIT:  # the last split of this column block writes y (split_k.py)
        offs_n = pid_n * WORDS * 8 + tl.arange(0, WORDS * 8)
        split_k_finish(y_ptr, partial_ptr, count_ptr, pid_n, split_k,
                       offs_m[:, None] * N + offs_n[None, :],
                       m_mask[:, None] & (offs_n < N)[None, :])


# ----------------------------------------------------------------------------- launchers


def gemv_scales(scales: torch.Tensor) -> torch.Tensor:
    """scales [K/G, N] -> [K/G, 8, N/8] with out[g, c, w] = scales[g, 8w + c].

    The GEMVs read, per step, column 8w + c for the words w of their tile: in this layout those
    are contiguous, one coalesced load per c instead of 2-byte loads 16 bytes apart (16x fewer
    memory transactions). A layer builds it once; awq_gemm takes it as `scales_t`.
    """
    G, N = scales.shape
    return scales.reshape(G, N // 8, 8).transpose(1, 2).contiguous()


def _scale_strides(scales, scales_t, N):
    """(tensor, stride_g, stride_c, stride_w): scale of column 8w + c in group g."""
    if scales_t is None:
        return scales, N, 1, 8  # the checkpoint's [K/G, N]: a thread's loads 16 bytes apart
    return scales_t, N, N // 8, 1  # gemv_scales(): [K/G, 8, N/8], contiguous along w


def _gemv1_tile(block_n, per_word, num_warps, group_size, rows, what):
    """(T, R, words): the [T, R, words] tile of packed words a batch-1 GEMV step reads
    (_awq_gemv1_kernel; gptq_int8's, `per_word` columns a word). Lanes go along a row 4 words
    (16 bytes) at a time, the lanes and warps left over cover T rows, and each thread takes R
    rows, T * R within one group."""
    words = block_n // per_word
    lanes = min(32, words // 4)  # lanes along a row of the tile, 4 words (16 bytes) each
    row_warps = num_warps // max(1, words // 128)  # warps left over for rows
    if words < 4 or words & (words - 1) or row_warps < 1:
        raise ValueError(f"{what}: block_n={block_n} must be a power of two from {4 * per_word} "
                         f"to {128 * per_word * num_warps} with {num_warps} warps")
    T = 32 // lanes * row_warps  # rows a step covers with one row per thread
    if T > group_size:
        raise ValueError(f"{what}: block_n={block_n} with {num_warps} warps reads {T} rows a "
                         f"step, more than the group size {group_size}; use a wider block_n")
    return T, max(1, min(rows, group_size // T)), words


def _awq_gemv1(x, qweight, qzeros, scales, group_size, block_n=256, rows=8, split_k=None,
               num_warps=4, num_stages=2, scales_t=None):
    """M = 1: _awq_gemv1_kernel. block_n columns (block_n / 8 words) per program; each thread
    reads `rows` rows of 4 words a step; K split so ~3 programs per SM stream weights."""
    K = x.shape[1]
    N = qweight.shape[1] * 8
    T, R, words = _gemv1_tile(block_n, 8, num_warps, group_size, rows, "_awq_gemv1")
    n_blocks = cdiv(N, block_n)
    steps = K // (T * R)
    if split_k is None:  # ~3 programs per SM: the best of 1-4 in benchmarks/awq_gemv.py's sweep
        split_k = max(1, min(steps, cdiv(3 * programs_target(x.device) // 4, n_blocks)))
    split_k = cdiv(steps, cdiv(steps, split_k))  # drop splits that would get no step
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    partial, count = split_k_workspace(x.device, N, n_blocks)
    scales, sg, sc, sw = _scale_strides(scales, scales_t, N)
    _awq_gemv1_kernel[(n_blocks, split_k)](
        x, qweight, qzeros, scales, y, partial, count, N, K, N // 8, sg, sc, sw, 0x3F800000,
        split_k,
        GROUP_SIZE=group_size, T=T, R=R, WORDS=words, SPLIT=split_k > 1, STAGES=num_stages,
        num_warps=num_warps,
    )
    return y


def _awq_gemv(x, qweight, qzeros, scales, group_size, block_n=None, block_k=64, split_k=None,
              num_warps=4, num_stages=3, scales_t=None, asm=False):
    """2 <= M <= 16: _awq_gemv_kernel, split-K, one launch; asm: the paired-PTX dequant (GPU
    only, 16-bit x)."""
    M, K = x.shape
    N = qweight.shape[1] * 8
    block_n = block_n or 256
    block_k = min(block_k, group_size)
    n_blocks = cdiv(N, block_n)
    steps = K // block_k
    if split_k is None:  # ~2 programs per SM: at M = 8 the sweep found 2 and 4 alike
        split_k = max(1, min(steps, cdiv(programs_target(x.device) // 2, n_blocks)))
    split_k = cdiv(steps, cdiv(steps, split_k))  # drop splits that would get no step
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    partial, count = split_k_workspace(x.device, M * N, n_blocks)
    scales, sg, sc, sw = _scale_strides(scales, scales_t, N)
    magic, offset = MAGIC16[x.dtype]
    _awq_gemv_kernel[(n_blocks, split_k)](
        x, qweight, qzeros, scales, y, partial, count, M, N, K, x.stride(0), N // 8, sg, sc, sw,
        split_k, GROUP_SIZE=group_size, BLOCK_M=16, WORDS=block_n // 8, BLOCK_K=block_k,
        MAGIC16=magic, OFFSET=offset, SPLIT=split_k > 1, STAGES=num_stages,
        DOT_PRECISION=dot_precision(x.dtype), ASM=asm and magic != 0, num_warps=num_warps,
    )
    return y

