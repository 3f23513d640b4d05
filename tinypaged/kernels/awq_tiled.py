"""The AWQ int4 tiled tensor-core GEMM: y [M, N] = x [M, K] @ W for 17 <= M <= 64.

W is the AutoAWQ packing (awq_format.py): qweight int32 [K, N/8], column 8w + c of word w at
nibble [0, 4, 1, 5, 2, 6, 3, 7][c], W[k, n] = (q - z) * s per group of G rows. Each program
owns a [BLOCK_M, BLOCK_N] tile of y and a range of K steps (split-K when the [M, N] output is
too small to give every SM a tile of its own). A K step:
1. loads a [BLOCK_K, BLOCK_N / 8] tile of packed words (BLOCK_K rows of one group),
2. unpacks it in registers to [BLOCK_K, BLOCK_N] in natural column order (awq_unpack.py: eight
   shifted copies joined along a new last axis; tl.join keeps that axis inside a thread, so the
   reshape relabels rather than shuffles),
3. dequantizes and feeds it to tl.dot with the [BLOCK_M, BLOCK_K] tile of x (rows past M read
   as zero). Two ways (SCALE_PRODUCT):
   - q - z exact in 16 bits (OFFSET + q minus OFFSET + z), the scale on the step's fp32
     product: one multiply per output, not per weight, but tl.dot cannot accumulate in place;
   - (q - z) * s in fp32 rounded once to x's dtype, acc = tl.dot(x, w, acc).
Split-K partial sums finish as in awq_gemv.py: fp32 atomics into a zeroed workspace, and the last
program of each output tile (an arrival counter) writes y and re-zeroes the workspace.
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import cdiv, jit, tl
from tinypaged.kernels.awq_gemv import _dot_precision, _programs_target, _split_k_workspace
from tinypaged.kernels.awq_unpack import MAGIC16, _nibble, _unpack_columns


@jit
def _column_zeros(qzeros_ptr, g, offs_n, n_mask, stride_q):
    # z [BLOCK_N] of group g in natural column order: column n is nibble [0, 4, 1, 5, 2, 6, 3, 7]
    # [n % 8] of word n // 8 (8 lanes read one word; the loads coalesce in L1)
    c = offs_n % 8
    shift = 4 * ((c // 2) + 4 * (c % 2))
    words = tl.load(qzeros_ptr + g * stride_q + offs_n // 8, mask=n_mask, other=0)
    return (words >> shift) & 0xF


@jit(do_not_specialize=("M", "split_k"))
def _awq_tiled_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, y_ptr,  # x: [M, K]; y: [M, N]
    partial_ptr, count_ptr,  # fp32 [M, N] and int32 [tiles], zero before and after
    M, N, K, stride_xm, split_k,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SCALE_PRODUCT: tl.constexpr, MAGIC16: tl.constexpr, OFFSET: tl.constexpr,
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
        if SCALE_PRODUCT:  # q - z exact in 16 bits, the scale on the step's fp32 product
            w = _unpack_columns(words, MAGIC16, x.dtype) - _nibble(z[None, :], 0, MAGIC16, x.dtype)
            acc += tl.dot(x, w, input_precision=DOT_PRECISION) * s.to(tl.float32)[None, :]
        else:  # (q - z) * s in fp32, rounded once to x's dtype, accumulated by tl.dot
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


def awq_tiled(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
              scales: torch.Tensor, group_size: int, block_m: int | None = None,
              block_n: int = 128, block_k: int = 64, split_k: int | None = None,
              scale_product: bool | None = None, num_warps: int = 4,
              num_stages: int = 3) -> torch.Tensor:
    """y [M, N] = x [M, K] @ ((q - z) * s) on tensor cores, fp32 accumulation, in x's dtype.

    block_m: rows of x per tile (default: M rounded up to 16..64, or 128 above 64);
    split_k: programs sharing one output tile's K steps (default: enough tiles for ~2 programs
    an SM); scale_product: the scale on each step's product instead of the weights (default:
    for block_m <= 16)."""
    M, K = x.shape
    N = qweight.shape[1] * 8
    block_m = block_m or (max(16, 1 << (M - 1).bit_length()) if M <= 64 else 128)
    block_k = min(block_k, group_size)
    scale_product = block_m <= 16 if scale_product is None else scale_product
    tiles = cdiv(M, block_m) * cdiv(N, block_n)
    steps = K // block_k
    if split_k is None:
        split_k = max(1, min(steps, _programs_target(x.device) // 2 // tiles))
    split_k = cdiv(steps, cdiv(steps, split_k))  # drop splits that would get no step
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    # without split-K the workspace is not read: no allocation (prefill grids can be large)
    partial, count = _split_k_workspace(x.device, M * N, tiles) if split_k > 1 else (y, y)
    magic, offset = MAGIC16[x.dtype]
    _awq_tiled_kernel[(tiles, split_k)](
        x, qweight, qzeros, scales, y, partial, count, M, N, K, x.stride(0), split_k,
        GROUP_SIZE=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SCALE_PRODUCT=scale_product,
        MAGIC16=magic, OFFSET=offset, SPLIT=split_k > 1, STAGES=num_stages,
        DOT_PRECISION=_dot_precision(x.dtype), num_warps=num_warps,
    )
    return y
