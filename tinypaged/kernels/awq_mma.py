"""The AWQ int4 tensor-core GEMM: y [M, N] = x [M, K] @ W for batched decode and prefill.

W is the AutoAWQ packing (awq_format.py): qweight int32 [K, N/8], column 8w + c of word w at
nibble [0, 4, 1, 5, 2, 6, 3, 7][c], W[k, n] = (q - z) * s per group of G rows. Each program
owns a [BLOCK_M, BLOCK_N] tile of y and a range of K steps (split-K when M is small: the
[M, N] output is too small to give every SM a tile of its own). A K step:
1. loads a [BLOCK_K, BLOCK_N / 8] tile of packed words (BLOCK_K rows of one group),
2. unpacks it in registers to [BLOCK_K, BLOCK_N] in natural column order: eight shifted copies
   joined along a new last axis (tl.join keeps the new axis inside a thread, so the reshape is a
   relabelling, not a shuffle),
3. feeds it to tl.dot with the [BLOCK_M, BLOCK_K] tile of x (rows past M read as zero),
4. applies zero point and scale. Two ways (the constexpr FOLD):
   - FOLD: the nibble ORed into the bits of 128.0 (bf16) or 1024.0 (fp16) is OFFSET + q
     exactly, in one instruction a weight; the step's product p = x @ (OFFSET + q) is fp32, and
     acc += s * (p - (OFFSET + z) * sum_k x): per output element, not per weight. The product
     must finish before it is scaled, so tl.dot cannot accumulate in place: good for small M,
     where weights outnumber outputs.
   - not FOLD: w = (q - z) * s in x's dtype, acc = tl.dot(x, w, acc): one fewer pass over the
     outputs per step, which is what large M (prefill) wants.
fp32 x (CPU tests, fp32 models) builds q through fp32's 2**23 trick and multiplies in IEEE fp32.
Split-K partial sums finish as in awq_gemv.py: fp32 atomics into a zeroed workspace, and the last
program of each output tile (an arrival counter) writes y and re-zeroes the workspace.
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import cdiv, jit, tl
from tinypaged.kernels.awq_gemv import (
    _dot_precision,
    _programs_target,
    _scale_strides,
    _split_k_workspace,
)
from tinypaged.kernels.awq_unpack import (
    _asm_dequant,
    _asm_nibble_minus_zero,
    _nibble,
    _unpack_columns,
)

_MAGIC16 = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0),
            torch.float32: (0, 0.0)}


@jit
def _column_zeros(qzeros_ptr, g, offs_n, n_mask, stride_q):
    # z [BLOCK_N] of group g in natural column order: column n is nibble [0, 4, 1, 5, 2, 6, 3, 7]
    # [n % 8] of word n // 8 (8 lanes read one word; the loads coalesce in L1)
    c = offs_n % 8
    shift = 4 * ((c // 2) + 4 * (c % 2))
    words = tl.load(qzeros_ptr + g * stride_q + offs_n // 8, mask=n_mask, other=0)
    return (words >> shift) & 0xF


@jit(do_not_specialize=("M", "split_k"))
def _awq_mma_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, y_ptr,  # x: [M, K]; y: [M, N]
    partial_ptr, count_ptr,  # fp32 [M, N] and int32 [tiles], zero before and after
    M, N, K, stride_xm, split_k,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DEQUANT: tl.constexpr, MAGIC16: tl.constexpr, OFFSET: tl.constexpr,
    SPLIT: tl.constexpr, STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # grid: (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), split_k); GROUP_SIZE % BLOCK_K == 0
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    # consecutive programs share a weight tile and sweep the rows of x: each weight is read from
    # memory once, x (small next to W) stays in L2
    num_pid_m = tl.cdiv(M, BLOCK_M)
    pid_n = pid // num_pid_m
    pid_m = pid % num_pid_m
    WORDS: tl.constexpr = BLOCK_N // 8
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = pid_n * WORDS + tl.arange(0, WORDS)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    w_mask = offs_w < N // 8
    steps = K // BLOCK_K
    steps_per_split = tl.cdiv(steps, split_k)
    first = pid_k * steps_per_split
    last = tl.minimum(first + steps_per_split, steps)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for step in tl.range(first, last, num_stages=STAGES):
        k = step * BLOCK_K + offs_k
        g = step * BLOCK_K // GROUP_SIZE
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        words = tl.load(qweight_ptr + k[:, None] * (N // 8) + offs_w[None, :],
                        mask=w_mask[None, :], other=0)  # [BLOCK_K, WORDS]
        z = _column_zeros(qzeros_ptr, g, offs_n, n_mask, N // 8)  # [BLOCK_N] int32
        s = tl.load(scales_ptr + g * N + offs_n, mask=n_mask, other=0.0)  # [BLOCK_N]
        if DEQUANT == 0:  # fold: zero point and scale on the fp32 product
            q = _unpack_columns(words, MAGIC16, x.dtype)  # OFFSET + q, exact
            p = tl.dot(x, q, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] fp32
            x_sum = tl.sum(x.to(tl.float32), axis=1)[:, None]  # [BLOCK_M, 1]
            acc += (p - x_sum * (OFFSET + z.to(tl.float32))[None, :]) * s.to(tl.float32)[None, :]
        elif DEQUANT == 1:  # q - z exact in 16 bits, scale on the fp32 product
            q = _unpack_columns(words, MAGIC16, x.dtype)
            w = q - _nibble(z[None, :], 0, MAGIC16, x.dtype)
            p = tl.dot(x, w, input_precision=DOT_PRECISION)
            acc += p * s.to(tl.float32)[None, :]
        elif DEQUANT == 2:  # (q - z) * s in x's dtype, accumulated by tl.dot
            q = _unpack_columns(words, MAGIC16, x.dtype)
            w = (q - _nibble(z[None, :], 0, MAGIC16, x.dtype)) * s.to(x.dtype)[None, :]
            acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        elif DEQUANT == 4:  # swapped: y^T = W^T x^T, the weights as the A operand
            q = _unpack_columns(words, MAGIC16, x.dtype)
            w = q - _nibble(z[None, :], 0, MAGIC16, x.dtype)  # [BLOCK_K, BLOCK_N]
            p = tl.dot(tl.trans(w), tl.trans(x), input_precision=DOT_PRECISION)  # [BN, BM]
            acc += tl.trans(p) * s.to(tl.float32)[None, :]
        elif DEQUANT == 5:  # swapped, accumulated by tl.dot
            q = _unpack_columns(words, MAGIC16, x.dtype)
            w = (q - _nibble(z[None, :], 0, MAGIC16, x.dtype)) * s.to(x.dtype)[None, :]
            acc_t = tl.dot(tl.trans(w), tl.trans(x), tl.trans(acc), input_precision=DOT_PRECISION)
            acc = tl.trans(acc_t)
        else:  # (q - z) * s in fp32, rounded once to x's dtype
            q = _unpack_columns(words, 0, tl.float32)
            w = ((q - z.to(tl.float32)[None, :]) * s.to(tl.float32)[None, :]).to(x.dtype)
            acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    at = offs_m[:, None] * N + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if not SPLIT:
        tl.store(y_ptr + at, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(partial_ptr + at, acc, mask=mask, sem="relaxed")
        # the last split of this tile to finish writes y and leaves the workspace zeroed
        tl.debug_barrier()  # every thread's atomics are issued before the counter moves
        done = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel")
        if done == split_k - 1:
            # volatile: read from L2, where the other programs' atomics landed, not from L1
            total = tl.load(partial_ptr + at, mask=mask, volatile=True)
            tl.store(y_ptr + at, total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.store(partial_ptr + at, tl.zeros_like(total), mask=mask)
            tl.store(count_ptr + pid, 0)


def awq_mma(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
            group_size: int, block_m: int | None = None, block_n: int = 128,
            block_k: int = 128, split_k: int | None = None, dequant: int | None = None,
            num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """y [M, N] = x [M, K] @ ((q - z) * s) on tensor cores, fp32 accumulation, in x's dtype.

    block_m: rows of x per tile (default: M rounded up to 16..64, or 128 above 64);
    split_k: programs sharing one output tile's K steps (default: enough tiles for ~2 programs
    an SM); fold: zero point and scale on the product (default: for block_m <= 64)."""
    M, K = x.shape
    N = qweight.shape[1] * 8
    block_m = block_m or (max(16, 1 << (M - 1).bit_length()) if M <= 64 else 128)
    block_k = min(block_k, group_size)
    dequant = (1 if block_m <= 64 else 3) if dequant is None else dequant
    tiles = cdiv(M, block_m) * cdiv(N, block_n)
    steps = K // block_k
    if split_k is None:
        split_k = max(1, min(steps, _programs_target(x.device) // 2 // tiles))
    split_k = cdiv(steps, cdiv(steps, split_k))  # drop splits that would get no step
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    # without split-K the workspace is not read: no allocation (prefill grids can be large)
    partial, count = _split_k_workspace(x.device, M * N, tiles) if split_k > 1 else (y, y)
    magic, offset = _MAGIC16[x.dtype]
    _awq_mma_kernel[(tiles, split_k)](
        x, qweight, qzeros, scales, y, partial, count, M, N, K, x.stride(0), split_k,
        GROUP_SIZE=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DEQUANT=dequant,
        MAGIC16=magic, OFFSET=offset, SPLIT=split_k > 1, STAGES=num_stages,
        DOT_PRECISION=_dot_precision(x.dtype), num_warps=num_warps,
    )
    return y


@jit
def _column_dot(acc, words_t, xt, z_words, s_ptrs, shift: tl.constexpr, MAGIC16: tl.constexpr,
                OFFSET: tl.constexpr, w_mask, DOT_PRECISION: tl.constexpr,
                ASM: tl.constexpr, SCALE_W: tl.constexpr):
    # acc + s * ((q - z) @ x^T) for the column at nibble `shift` of each word:
    # [W, BK] x [BK, BM] -> [W, BM]
    s = tl.load(s_ptrs, mask=w_mask, other=0.0).to(tl.float32)  # [W, 1]
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
def _awq_mma_cols_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, y_ptr, partial_ptr, count_ptr,
    M, N, K, stride_xm, stride_sg, stride_sc, stride_sw, split_k,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, WORDS: tl.constexpr,
    BLOCK_K: tl.constexpr, MAGIC16: tl.constexpr, OFFSET: tl.constexpr, ASM: tl.constexpr,
    SCALE_W: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # swapped and per column: y^T [8 W, BM] as 8 products [W, BK] x [BK, BM], one per nibble
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_w = pid * WORDS + tl.arange(0, WORDS)
    w_mask = (offs_w < N // 8)[:, None]  # [W, 1]
    offs_k = tl.arange(0, BLOCK_K)
    steps = K // BLOCK_K
    steps_per_split = tl.cdiv(steps, split_k)
    first = pid_k * steps_per_split
    last = tl.minimum(first + steps_per_split, steps)
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
        acc0 = _column_dot(acc0, words_t, xt, zw, s_ptrs, 0, MAGIC16, OFFSET, w_mask, DOT_PRECISION, ASM, SCALE_W)
        acc1 = _column_dot(acc1, words_t, xt, zw, s_ptrs + 1 * stride_sc, 16, MAGIC16, OFFSET, w_mask, DOT_PRECISION, ASM, SCALE_W)
        acc2 = _column_dot(acc2, words_t, xt, zw, s_ptrs + 2 * stride_sc, 4, MAGIC16, OFFSET, w_mask, DOT_PRECISION, ASM, SCALE_W)
        acc3 = _column_dot(acc3, words_t, xt, zw, s_ptrs + 3 * stride_sc, 20, MAGIC16, OFFSET, w_mask, DOT_PRECISION, ASM, SCALE_W)
        acc4 = _column_dot(acc4, words_t, xt, zw, s_ptrs + 4 * stride_sc, 8, MAGIC16, OFFSET, w_mask, DOT_PRECISION, ASM, SCALE_W)
        acc5 = _column_dot(acc5, words_t, xt, zw, s_ptrs + 5 * stride_sc, 24, MAGIC16, OFFSET, w_mask, DOT_PRECISION, ASM, SCALE_W)
        acc6 = _column_dot(acc6, words_t, xt, zw, s_ptrs + 6 * stride_sc, 12, MAGIC16, OFFSET, w_mask, DOT_PRECISION, ASM, SCALE_W)
        acc7 = _column_dot(acc7, words_t, xt, zw, s_ptrs + 7 * stride_sc, 28, MAGIC16, OFFSET, w_mask, DOT_PRECISION, ASM, SCALE_W)
    at = offs_m[None, :] * N + 8 * offs_w[:, None]  # [W, BM]: y[m, 8w]
    mask = m_mask[None, :] & w_mask
    _store_cols(acc0, y_ptr, partial_ptr, at + 0, mask, SPLIT)
    _store_cols(acc1, y_ptr, partial_ptr, at + 1, mask, SPLIT)
    _store_cols(acc2, y_ptr, partial_ptr, at + 2, mask, SPLIT)
    _store_cols(acc3, y_ptr, partial_ptr, at + 3, mask, SPLIT)
    _store_cols(acc4, y_ptr, partial_ptr, at + 4, mask, SPLIT)
    _store_cols(acc5, y_ptr, partial_ptr, at + 5, mask, SPLIT)
    _store_cols(acc6, y_ptr, partial_ptr, at + 6, mask, SPLIT)
    _store_cols(acc7, y_ptr, partial_ptr, at + 7, mask, SPLIT)
    if SPLIT:
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel")
        if done == split_k - 1:
            offs_n = pid * WORDS * 8 + tl.arange(0, WORDS * 8)
            at_y = offs_m[:, None] * N + offs_n[None, :]
            n_mask = m_mask[:, None] & (offs_n < N)[None, :]
            total = tl.load(partial_ptr + at_y, mask=n_mask, volatile=True)
            tl.store(y_ptr + at_y, total.to(y_ptr.dtype.element_ty), mask=n_mask)
            tl.store(partial_ptr + at_y, tl.zeros_like(total), mask=n_mask)
            tl.store(count_ptr + pid, 0)


@jit
def _store_cols(acc, y_ptr, partial_ptr, at, mask, SPLIT: tl.constexpr):
    if not SPLIT:
        tl.store(y_ptr + at, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(partial_ptr + at, acc, mask=mask, sem="relaxed")


def awq_mma_cols(x, qweight, qzeros, scales, group_size, block_n=512, block_k=64, split_k=None,
                 num_warps=4, num_stages=3, scales_t=None, asm=False, scale_w=False,
                 min_block_m=16):
    M, K = x.shape
    N = qweight.shape[1] * 8
    block_m = max(min_block_m, 1 << (M - 1).bit_length())
    block_k = min(block_k, group_size)
    tiles = cdiv(N, block_n)
    steps = K // block_k
    if split_k is None:
        split_k = max(1, min(steps, _programs_target(x.device) // 2 // tiles))
    split_k = cdiv(steps, cdiv(steps, split_k))
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    partial, count = _split_k_workspace(x.device, M * N, tiles) if split_k > 1 else (y, y)
    magic, offset = _MAGIC16[x.dtype]
    scales, sg, sc, sw = _scale_strides(scales, scales_t, N)
    _awq_mma_cols_kernel[(tiles, split_k)](
        x, qweight, qzeros, scales, y, partial, count, M, N, K, x.stride(0), sg, sc, sw, split_k,
        GROUP_SIZE=group_size, BLOCK_M=block_m, WORDS=block_n // 8, BLOCK_K=block_k,
        MAGIC16=magic, OFFSET=offset, ASM=asm and magic != 0, SCALE_W=scale_w, SPLIT=split_k > 1, STAGES=num_stages,
        DOT_PRECISION=_dot_precision(x.dtype), num_warps=num_warps,
    )
    return y
