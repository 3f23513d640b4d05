"""The AWQ int4 decode GEMM on tensor cores: y [M, N] = x [M, K] @ W for 2 <= M <= 16.

W is the AutoAWQ packing (awq_format.py): qweight int32 [K, N/8], column 8w + c of word w at
nibble [0, 4, 1, 5, 2, 6, 3, 7][c], W[k, n] = (q - z) * s per group of G rows. At decode
batch sizes the weights are the big operand and the rows of x few, so the product is computed
transposed, y^T = W^T x^T: the weights take the M slot of tl.dot (the MMA's A operand, fed
straight from registers; 64 words a tile) and x^T, padded to min_block_m = 8 (an m16n8k16 MMA)
or 16 columns, the N slot. It is computed per column of a word: column c of words
[w0, w0 + W) is one [W, BLOCK_K] operand, elementwise from the loaded tile (no unpack into
natural order, no shuffle), so a K step is 8 products [W, BLOCK_K] x [BLOCK_K, BLOCK_M], one
per column c, each accumulating y[:, 8w + c].
Dequantization (awq_unpack.py) is the paired PTX on the GPU, two weights per instruction, and
the portable conversion under the interpreter; scale_w multiplies the scale into the weights
(one more paired instruction) so that tl.dot accumulates in place, instead of scaling each
step's product. K is split so that ~2 programs per SM stream weights; the partial sums finish
as split_k.py says (atomics into a zeroed workspace, the last program writes y).
Measured, it beats awq_gemv.py's batched GEMV on wide layers (N >= 3K) up to 8 rows, so
awq.DECODE_PATHS sends those there (figures: benchmarks/RESULTS.md).
"""
from __future__ import annotations

import torch

from tinypaged.kernels._triton import cdiv, dot_precision, jit, tl
from tinypaged.kernels.awq_gemv import _scale_strides
from tinypaged.kernels.awq_unpack import MAGIC16, _asm_dequant, _asm_nibble_minus_zero, _nibble
from tinypaged.kernels.split_k import (
    programs_target,
    split_k_finish,
    split_k_range,
    split_k_store,
    split_k_workspace,
)


@jit
def _column_dot(acc, words_t, xt, z_words, s_ptrs, stride_sc, w_mask, c: tl.constexpr,
                MAGIC16: tl.constexpr, OFFSET: tl.constexpr, ASM: tl.constexpr,
                SCALE_W: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # acc + s * ((q - z) @ x^T) for column c of each word: [W, BK] x [BK, BM] -> [W, BM].
    # s_ptrs: the scales of column 0 of the words; column c sits at shift
    # 4 * [0, 4, 1, 5, 2, 6, 3, 7][c]
    shift: tl.constexpr = 4 * ((c // 2) + 4 * (c % 2))
    s = tl.load(s_ptrs + c * stride_sc, mask=w_mask, other=0.0).to(tl.float32)  # [W, 1]
    if ASM:
        nz = (-(OFFSET + ((z_words >> shift) & 0xF).to(tl.float32))).to(xt.dtype)  # [W, 1]
        if SCALE_W:
            w = _asm_dequant(words_t, nz, s.to(xt.dtype), shift, MAGIC16)
            acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
        else:
            w = _asm_nibble_minus_zero(words_t, nz, shift, MAGIC16, xt.dtype)
            acc += tl.dot(w, xt, input_precision=DOT_PRECISION) * s
    else:
        w = (_nibble(words_t, shift, MAGIC16, xt.dtype)
             - _nibble(z_words, shift, MAGIC16, xt.dtype))
        if SCALE_W:
            acc = tl.dot(w * s.to(xt.dtype), xt, acc, input_precision=DOT_PRECISION)
        else:
            acc += tl.dot(w, xt, input_precision=DOT_PRECISION) * s
    return acc


@jit(do_not_specialize=("M", "split_k"))
def _awq_mma_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, y_ptr, partial_ptr, count_ptr,
    M, N, K, stride_xm, stride_sg, stride_sc, stride_sw, split_k,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, WORDS: tl.constexpr,
    BLOCK_K: tl.constexpr, MAGIC16: tl.constexpr, OFFSET: tl.constexpr, ASM: tl.constexpr,
    SCALE_W: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # grid: (cdiv(N, 8 WORDS), split_k). y^T [8 WORDS, BLOCK_M] of words [w0, w0 + WORDS) as 8
    # products [WORDS, BK] x [BK, BLOCK_M], acc<c> holding y[:, 8w + c]
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_w = pid * WORDS + tl.arange(0, WORDS)
    w_mask = (offs_w < N // 8)[:, None]  # [W, 1]
    offs_k = tl.arange(0, BLOCK_K)
    steps = K // BLOCK_K
    first, last = split_k_range(steps, split_k)
    acc0 = tl.zeros((WORDS, BLOCK_M), tl.float32)
    acc1 = tl.zeros((WORDS, BLOCK_M), tl.float32)
    acc2 = tl.zeros((WORDS, BLOCK_M), tl.float32)
    acc3 = tl.zeros((WORDS, BLOCK_M), tl.float32)
    acc4 = tl.zeros((WORDS, BLOCK_M), tl.float32)
    acc5 = tl.zeros((WORDS, BLOCK_M), tl.float32)
    acc6 = tl.zeros((WORDS, BLOCK_M), tl.float32)
    acc7 = tl.zeros((WORDS, BLOCK_M), tl.float32)
    for step in tl.range(first, last, num_stages=STAGES):
        k = step * BLOCK_K + offs_k
        g = step * BLOCK_K // GROUP_SIZE
        xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + k[:, None], mask=m_mask[None, :],
                     other=0.0)  # [BK, BM]
        words_t = tl.load(qweight_ptr + k[None, :] * (N // 8) + offs_w[:, None], mask=w_mask,
                          other=0)  # [W, BK]
        zw = tl.load(qzeros_ptr + g * (N // 8) + offs_w[:, None], mask=w_mask, other=0)
        s_ptrs = scales_ptr + g * stride_sg + offs_w[:, None] * stride_sw
        acc0 = _column_dot(acc0, words_t, xt, zw, s_ptrs, stride_sc, w_mask, 0, MAGIC16,
                             OFFSET, ASM, SCALE_W, DOT_PRECISION)
        acc1 = _column_dot(acc1, words_t, xt, zw, s_ptrs, stride_sc, w_mask, 1, MAGIC16,
                             OFFSET, ASM, SCALE_W, DOT_PRECISION)
        acc2 = _column_dot(acc2, words_t, xt, zw, s_ptrs, stride_sc, w_mask, 2, MAGIC16,
                             OFFSET, ASM, SCALE_W, DOT_PRECISION)
        acc3 = _column_dot(acc3, words_t, xt, zw, s_ptrs, stride_sc, w_mask, 3, MAGIC16,
                             OFFSET, ASM, SCALE_W, DOT_PRECISION)
        acc4 = _column_dot(acc4, words_t, xt, zw, s_ptrs, stride_sc, w_mask, 4, MAGIC16,
                             OFFSET, ASM, SCALE_W, DOT_PRECISION)
        acc5 = _column_dot(acc5, words_t, xt, zw, s_ptrs, stride_sc, w_mask, 5, MAGIC16,
                             OFFSET, ASM, SCALE_W, DOT_PRECISION)
        acc6 = _column_dot(acc6, words_t, xt, zw, s_ptrs, stride_sc, w_mask, 6, MAGIC16,
                             OFFSET, ASM, SCALE_W, DOT_PRECISION)
        acc7 = _column_dot(acc7, words_t, xt, zw, s_ptrs, stride_sc, w_mask, 7, MAGIC16,
                             OFFSET, ASM, SCALE_W, DOT_PRECISION)
    at = offs_m[None, :] * N + 8 * offs_w[:, None]  # [W, BM]: y[m, 8w]
    mask = m_mask[None, :] & w_mask
    split_k_store(acc0, y_ptr, partial_ptr, at + 0, mask, SPLIT)
    split_k_store(acc1, y_ptr, partial_ptr, at + 1, mask, SPLIT)
    split_k_store(acc2, y_ptr, partial_ptr, at + 2, mask, SPLIT)
    split_k_store(acc3, y_ptr, partial_ptr, at + 3, mask, SPLIT)
    split_k_store(acc4, y_ptr, partial_ptr, at + 4, mask, SPLIT)
    split_k_store(acc5, y_ptr, partial_ptr, at + 5, mask, SPLIT)
    split_k_store(acc6, y_ptr, partial_ptr, at + 6, mask, SPLIT)
    split_k_store(acc7, y_ptr, partial_ptr, at + 7, mask, SPLIT)
    if SPLIT:  # the last split of this column block writes y (split_k.py)
        offs_n = pid * WORDS * 8 + tl.arange(0, WORDS * 8)
        split_k_finish(y_ptr, partial_ptr, count_ptr, pid, split_k,
                       offs_m[:, None] * N + offs_n[None, :],
                       m_mask[:, None] & (offs_n < N)[None, :])


def awq_mma(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
            scales: torch.Tensor, group_size: int, block_n: int = 512, block_k: int = 64,
            split_k: int | None = None, num_warps: int = 4, num_stages: int = 3,
            scales_t: torch.Tensor | None = None, asm: bool = False, scale_w: bool = False,
            min_block_m: int = 16) -> torch.Tensor:
    """y [M, N] = x [M, K] @ ((q - z) * s), 2 <= M <= 16, fp32 accumulation, in x's dtype.

    block_n: columns per program (block_n / 8 words, the M slot of the MMA);
    split_k: programs sharing a column block's K steps (default ~2 programs per SM);
    scales_t: gemv_scales(scales), read coalesced; asm: the paired-PTX dequant (GPU only);
    scale_w: scales multiplied into the weights; min_block_m: x^T padded to at least this many
    columns (8 or 16)."""
    M, K = x.shape
    N = qweight.shape[1] * 8
    block_m = max(min_block_m, 1 << (M - 1).bit_length())
    block_k = min(block_k, group_size)
    tiles = cdiv(N, block_n)
    steps = K // block_k
    if split_k is None:
        split_k = max(1, min(steps, programs_target(x.device) // 2 // tiles))
    split_k = cdiv(steps, cdiv(steps, split_k))  # drop splits that would get no step
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    partial, count = split_k_workspace(x.device, M * N, tiles) if split_k > 1 else (y, y)
    magic, offset = MAGIC16[x.dtype]
    scales, sg, sc, sw = _scale_strides(scales, scales_t, N)
    _awq_mma_kernel[(tiles, split_k)](
        x, qweight, qzeros, scales, y, partial, count, M, N, K, x.stride(0), sg, sc, sw, split_k,
        GROUP_SIZE=group_size, BLOCK_M=block_m, WORDS=block_n // 8, BLOCK_K=block_k,
        MAGIC16=magic, OFFSET=offset, ASM=asm and magic != 0, SCALE_W=scale_w,
        SPLIT=split_k > 1, STAGES=num_stages, DOT_PRECISION=dot_precision(x.dtype),
        num_warps=num_warps,
    )
    return y
