"""The dense decode GEMV: y [M, N] = x [M, K] @ W [N, K]^T (+ b) for 1 <= M <= 16.

W is an nn.Linear weight (bf16, fp16 or fp32, row n = output feature n, contiguous along K).
At decode batch sizes the product is bound by streaming W: 2 * N * K bytes (bf16) against
2 * M * N * K FLOPs, i.e. M FLOPs per byte, far below the ~160 FLOPs per byte where an H200
stops being memory-bound. So the kernel's only job is to read every weight exactly once, at the
copy bandwidth, from every SM at once:
- Programs own BLOCK_N output features (rows of W) and split K: a (column block, K range) grid
  of ~3 programs per SM. cuBLAS picks one tiling per shape and loses the tail of small layers
  (qkv, o) to launch and ramp time; splitting K lets a 4096x4096 layer fill 132 SMs.
- A step loads a [BLOCK_N, BLOCK_K] tile of W, rows contiguous (16-byte vector loads, a warp
  reads 512 bytes of one row), pipelined through shared memory (tl.range num_stages).
- M = 1 (USE_DOT False): one FMA per weight on CUDA cores into a [BLOCK_N, BLOCK_K] fp32
  accumulator, reduced over K once at the end.
- 2 <= M <= 16 (USE_DOT True): y^T = W x^T on tensor cores, W in the MMA's M slot and x^T,
  padded to BLOCK_M (8 or 16) columns, in the N slot; M FMAs per weight would swamp the CUDA
  cores at 16 rows, a tensor-core product costs the same for any M up to 16.
- fp32 accumulation. Split-K partial sums go by atomics into the persistent zeroed fp32
  workspace that every split-K GEMV shares (split_k.py); the last program of each column block
  (an arrival counter) adds the bias, writes y in x's dtype and re-zeroes it: one launch, no
  memset, no allocation inside a CUDA graph once the workspace exists.
Memory traffic: N * K * itemsize (W, once) + split_k * M * K (x, from L2) + M * N * (itemsize +
2 * 4 * [split]) bytes; for Llama-3-8B's layers W is > 99% of it.
Which shapes take this kernel and which stay with cuBLAS: DENSE_GEMV_PATHS (chosen by
benchmarks/dense_gemv.py; figures in benchmarks/RESULTS.md); dense_linear applies it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tinypaged import envs
from tinypaged.kernels._triton import cdiv, dot_precision, jit, tl, use_triton
from tinypaged.kernels.split_k import (
    programs_target,
    split_k_finish,
    split_k_range,
    split_k_workspace,
)

GEMV_MAX_M = 16  # rows of x up to which dense_linear may take the GEMV


@jit(do_not_specialize=("M", "split_k"))
def _dense_gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,  # x [M, K] (row stride stride_xm), W [N, K], b [N], y [M, N]
    partial_ptr, count_ptr,  # fp32 [M, N] and int32 [cdiv(N, BLOCK_N)], zero before and after
    M, N, K, stride_xm, stride_wn, split_k,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # grid: (cdiv(N, BLOCK_N), split_k); program (n, s) sums K-steps split_k_range(.., s) of
    # y[:, n * BLOCK_N : (n + 1) * BLOCK_N]
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    first, last = split_k_range(tl.cdiv(K, BLOCK_K), split_k)
    # rows past N read row n % N (in bounds, unmasked loads) and are not stored
    w_ptrs = w_ptr + (offs_n % N)[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    if USE_DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)  # y^T
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)  # per-lane sums, reduced over K below
    for step in tl.range(first, last, num_stages=STAGES):
        k = step * BLOCK_K + offs_k
        if EVEN_K:
            w = tl.load(w_ptrs + step * BLOCK_K)
        else:
            w = tl.load(w_ptrs + step * BLOCK_K, mask=(k < K)[None, :], other=0.0)
        if USE_DOT:
            xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + k[:, None],
                         mask=m_mask[None, :] & (k < K)[:, None], other=0.0)  # [BLOCK_K, BLOCK_M]
            acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
        else:
            x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)  # [BLOCK_K]
            acc += w.to(tl.float32) * x[None, :]
    if USE_DOT:
        out = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    else:
        out = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]
    at = offs_m[:, None] * N + offs_n[None, :]  # y[m, n], [BLOCK_M, BLOCK_N]
    mask = m_mask[:, None] & n_mask[None, :]
    if not SPLIT:
        if HAS_BIAS:
            out += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + at, out.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(partial_ptr + at, out, mask=mask, sem="relaxed")
        # the last split of this column block writes y (split_k.py)
        split_k_finish(y_ptr, partial_ptr, count_ptr, pid_n, split_k, at, mask,
                       b_ptr + offs_n[None, :], n_mask[None, :], HAS_BIAS)


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               block_n: int | None = None, block_k: int = 256, split_k: int | None = None,
               num_warps: int = 4, num_stages: int = 3, min_block_m: int = 16,
               programs_per_sm: int = 3, tensor_cores: bool | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]), 1 <= M <= 16, fp32 accumulation, in
    x's dtype (the Triton kernel; dense_linear decides when to call it).

    block_n: output features per program (default 16 at M = 1, 64 with tensor cores);
    block_k: K per step; split_k: programs sharing a column block's K (default ~programs_per_sm
    programs per SM); min_block_m: x^T padded to at least this many columns for tl.dot (8 or 16;
    the interpreter needs 16); tensor_cores: tl.dot instead of CUDA-core FMAs (default: from
    two rows on)."""
    M, K = x.shape
    N = weight.shape[0]
    if not 1 <= M <= GEMV_MAX_M:
        raise ValueError(f"dense_gemv: x has {M} rows; the GEMV takes 1 to {GEMV_MAX_M} "
                         "(use F.linear for more)")
    if tuple(weight.shape) != (N, K) or weight.stride(1) != 1 or weight.dtype != x.dtype:
        raise ValueError(f"dense_gemv: weight must be [N, K={K}] contiguous along K in x's dtype "
                         f"{x.dtype}, got {weight.dtype} of shape {tuple(weight.shape)} and "
                         f"strides {weight.stride()}")
    if x.stride(1) != 1:
        x = x.contiguous()
    use_dot = M > 1 if tensor_cores is None else tensor_cores
    if M > 1 and not use_dot:
        raise ValueError(f"dense_gemv: the CUDA-core path takes one row of x, got {M}")
    block_n = block_n or (64 if use_dot else 16)
    block_m = max(min_block_m, 1 << (M - 1).bit_length()) if use_dot else 1
    n_blocks = cdiv(N, block_n)
    steps = cdiv(K, block_k)
    if split_k is None:
        target = programs_target(x.device) * programs_per_sm // 4
        split_k = max(1, min(steps, cdiv(target, n_blocks)))
    split_k = cdiv(steps, cdiv(steps, split_k))  # drop splits that would get no step
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    # sized for GEMV_MAX_M rows and 8-row blocks whatever M and the tiles are, so that no decode
    # batch size reallocates it after another one's CUDA graph captured it
    partial, count = (split_k_workspace(x.device, GEMV_MAX_M * N, cdiv(N, 8)) if split_k > 1
                      else (y, y))
    _dense_gemv_kernel[(n_blocks, split_k)](
        x, weight, y if bias is None else bias, y, partial, count, M, N, K, x.stride(0),
        weight.stride(0), split_k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=use_dot,
        EVEN_K=K % block_k == 0, HAS_BIAS=bias is not None, SPLIT=split_k > 1,
        STAGES=num_stages, DOT_PRECISION=dot_precision(x.dtype), num_warps=num_warps,
    )
    return y


def dense_gemv_reference(x: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, **config) -> torch.Tensor:
    """The torch reference of dense_gemv (same signature; tile settings are ignored): fp32
    products and sums, the result in x's dtype."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


_ANY = 1 << 30
_TENSOR_CORES = dict(block_k=128, num_stages=4, min_block_m=8)  # x^T padded to 8 columns
# (max M, min K, max K, min N, max N, tile configuration): the decode shapes that take
# dense_gemv on CUDA, first match wins; every other shape (and M > GEMV_MAX_M) runs F.linear
# (cuBLAS). At one row the GEMV matched or beat cuBLAS on every layer measured: cuBLAS already
# streams the large layers at about the copy bandwidth, and on small ones (Qwen3-0.6B's, o) it
# loses the tail to launch and ramp time that split K removes. At 2..16 rows only the LM heads
# and the o-sized layers gain; cuBLAS keeps the wide ones (gate_up, qkv, down). Figures:
# benchmarks/RESULTS.md.
DENSE_GEMV_PATHS: tuple[tuple[int, int, int, int, int, dict], ...] = (
    (1, 0, 1024, 0, _ANY, dict(split_k=1)),  # K <= 1024: too few K steps to split
    (1, 0, _ANY, 0, _ANY, dict(programs_per_sm=2)),
    (GEMV_MAX_M, 0, _ANY, 65536, _ANY, _TENSOR_CORES),  # LM heads
    (8, 2048, 4096, 0, 4096, _TENSOR_CORES),  # o-sized: 4096x4096, 2048x1024, 3072x1024
)


def gemv_config(M: int, N: int, K: int) -> dict | None:
    """The tile configuration of the first DENSE_GEMV_PATHS row that fits, None for cuBLAS."""
    for max_m, min_k, max_k, min_n, max_n, config in DENSE_GEMV_PATHS:
        if M <= max_m and min_k <= K <= max_k and min_n <= N <= max_n:
            return config
    return None


def gemv_enabled() -> bool:
    """$TINYPAGED_DENSE_GEMV=0 turns the GEMV off (every dense linear runs F.linear): the A/B
    switch for benchmarks; read at call time, so set it before CUDA graphs are captured."""
    return envs.TINYPAGED_DENSE_GEMV


def dense_linear(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K], through dense_gemv where DENSE_GEMV_PATHS says it
    beats cuBLAS (CUDA, decode-sized M, Triton kernels in use); F.linear everywhere else,
    including on CPU."""
    M = x.shape[0]
    if (x.dim() == 2 and x.is_cuda and 1 <= M <= GEMV_MAX_M and weight.dtype == x.dtype
            and weight.stride(1) == 1 and use_triton(x) and gemv_enabled()):
        config = gemv_config(M, weight.shape[0], x.shape[1])
        if config is not None:
            return dense_gemv(x, weight, bias, **config)
    return F.linear(x, weight, bias)
