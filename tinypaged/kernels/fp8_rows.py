"""The W8A8 decode product for 1-16 rows: y [M, N] = (a * a_scale) @ (w * w_scale)^T, with a
ALREADY quantized to e4m3 (quantize_fp8, silu_and_mul_quant_fp8 or rms_norm_quant_fp8 made it).

    fp8_rows(a, a_scale, w, w_scale, out_dtype, block=None, **tiles) -> y [M, N]
        a float8_e4m3fn [M, K], w float8_e4m3fn [N, K] (K contiguous), the scales as fp8_gemm's
        (kernels/fp8.py): a_scale [M, 1] (per token) or [1, 1] (static), w_scale [N, 1] or
        [1, 1]; or, block=(BN, BK), a_scale [M, K/BK] and w_scale [N/BN, K/BK].

The math, per channel (the scales factor out of the sum):
    y[m, n] = a_scale[m] * w_scale[n] * sum_k a[m, k] * w[n, k]
so the K loop multiplies raw e4m3 values into fp32 and the scales come ONCE, after it. Block-wise
a scale pair changes every BK inputs, so each K step's partial sum is scaled as it is added:
    y[m, n] = sum_kb a_scale[m, kb] * w_scale[n // BN, kb] * sum_{k in block kb} a[m, k] w[n, k].

Why not fp8_gemm's decode tiles: at M <= 16 its [16 rows of a] x [BLOCK_N of w] tile is too
narrow for Hopper's FP8 wgmma (64 rows a warpgroup), so Triton lowers it to an fp16 mma.sync on
converted operands (every weight converted on the CUDA cores), and with no split over K the
small layers (qkv, o) get one or two programs per SM. Here the roles are swapped, as in
dense_gemv's tensor-core path:
- y^T [BLOCK_N, BLOCK_M] = W [BLOCK_N, BLOCK_K] @ a^T [BLOCK_K, BLOCK_M]: the weight fills the
  MMA's M slot (BLOCK_N >= 64 a warpgroup), a^T, padded to BLOCK_M = 16 columns with zeros,
  its N slot: wgmma m64n16k32 on e4m3 operands straight from shared memory, no conversion.
- A (column block, K range) grid of ~programs_per_sm programs an SM, the split sums meeting in
  split_k.py's shared fp32 workspace (one launch, CUDA-graph safe, no memset).
- W by TMA (w_tma): the [BLOCK_N, BLOCK_K] tiles come through a host-side descriptor over W
  [N, K], one bulk asynchronous copy a tile (no address registers, no per-thread loads, rows
  past N and columns past K filled with zeros by the copy engine), so the pipeline's depth is
  bounded by shared memory only; pointer loads (cp.async) otherwise, and where the descriptor
  does not fit (kernels/tma.py). a^T, 16 * BLOCK_K bytes a step, stays on pointer loads.
Memory traffic: N * K bytes of W (once) + split_k * M * K bytes of a (from L2) + the scales.
The decode product is bound by streaming W, so the kernel's job is to read it at the copy
bandwidth; the padding of a^T costs tensor-core time, which is idle anyway at these sizes.

`fp8_rows` runs the kernel on CUDA (or under TRITON_INTERPRET=1), else the torch reference of
the same signature (fp8_gemm_reference: the product of the dequantized operands in fp32).
Tiles: FP8_ROWS_CONFIGS (benchmarks/fp8_gemv.py --sweep-rows prints it).
"""

from __future__ import annotations

import torch

from tinypaged import envs
from tinypaged.kernels._triton import cdiv, jit, tl, use_triton
from tinypaged.kernels.fp8 import FP8_DTYPE, _scale_strides, fp8_gemm_reference
from tinypaged.kernels.pdl import launch_kwargs, pdl_enabled, pdl_trigger, pdl_wait, prefetch_rows
from tinypaged.kernels.split_k import (
    programs_target,
    split_k_finish,
    split_k_range,
    split_k_workspace,
)
from tinypaged.kernels.tma import w_operand, w_tma_fits

ROWS_MAX_M = 16  # a^T padded to 16 columns: the narrowest e4m3 wgmma (m64n16k32)
ROWS_MIN_M = 2  # one row takes the W8A16 GEMV (kernels/dense_gemv.py), not the W8A8 path


def fp8_rows_enabled(M: int) -> bool:
    """Whether the W8A8 path multiplies an M-row x with fp8_rows (2 to 16 rows, unless
    $TINYPAGED_FP8_ROWS=0: then fp8_gemm, the A/B switch); read at call time, so set it before
    CUDA graphs are captured."""
    return ROWS_MIN_M <= M <= ROWS_MAX_M and envs.TINYPAGED_FP8_ROWS


@jit(do_not_specialize=("M", "split_k"))
def _fp8_rows_kernel(
    a_ptr, w_ptr, wp_ptr, as_ptr, ws_ptr, y_ptr,  # a [M, K], W [N, K] e4m3 (wp_ptr: W's
    # pointer, w_ptr its TMA descriptor or the same pointer); scales fp32; y [M, N]
    partial_ptr, count_ptr,  # fp32 [M, N] and int32 [cdiv(N, BLOCK_N)], zero before and after
    M, N, K, stride_am, stride_wn, stride_asm, stride_ask, stride_wsn, stride_wsk, split_k,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCKWISE: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
    EVEN_K: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr, W_TMA: tl.constexpr,
    USE_PDL: tl.constexpr,  # chained to the kernels around it (kernels/pdl.py)
):
    # W_TMA: w_ptr is a TMA descriptor over W [N, K] with [BLOCK_N, BLOCK_K] boxes (rows past N
    # and columns past K read as 0), else W's pointer
    # grid: (cdiv(N, BLOCK_N), split_k); program (n, s) sums K-steps split_k_range(.., s) of
    # y[:, n * BLOCK_N : (n + 1) * BLOCK_N]
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    first, last = split_k_range(tl.cdiv(K, BLOCK_K), split_k)
    if not W_TMA:  # rows past N read row n % N (in bounds, unmasked loads), are not stored
        w_ptrs = w_ptr + (offs_n % N)[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    at_ptrs = a_ptr + offs_m[None, :] * stride_am + offs_k[:, None]  # a^T [BLOCK_K, BLOCK_M]
    # block-wise: this program's rows lie in one scale row (BLOCK_N divides SCALE_BN)
    ws_row = ws_ptr + (pid_n * BLOCK_N // SCALE_BN) * stride_wsn
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)  # y^T
    # PDL: W's first two steps into L2 while the kernel before this one runs
    prefetch_rows(wp_ptr, offs_n % N, stride_wn, first * BLOCK_K, K, 2 * BLOCK_K, USE_PDL)
    pdl_wait(USE_PDL)
    for step in tl.range(first, last, num_stages=STAGES):
        if W_TMA:  # one bulk copy a tile, into shared memory where the wgmma reads it
            w = w_ptr.load([pid_n * BLOCK_N, step * BLOCK_K])
        if EVEN_K:
            if not W_TMA:
                w = tl.load(w_ptrs + step * BLOCK_K)
            at = tl.load(at_ptrs + step * BLOCK_K, mask=m_mask[None, :], other=0.0)
        else:
            k_mask = step * BLOCK_K + offs_k < K
            if not W_TMA:
                w = tl.load(w_ptrs + step * BLOCK_K, mask=k_mask[None, :], other=0.0)
            at = tl.load(at_ptrs + step * BLOCK_K, mask=m_mask[None, :] & k_mask[:, None],
                         other=0.0)
        if BLOCKWISE:  # the step's product times its scale pair: [BLOCK_M] x one number
            kb = step * BLOCK_K // SCALE_BK
            sa = tl.load(as_ptr + offs_m * stride_asm + kb * stride_ask, mask=m_mask, other=0.0)
            acc += tl.dot(w, at, out_dtype=tl.float32) * (sa * tl.load(ws_row + kb * stride_wsk))[
                None, :]
        else:
            acc = tl.dot(w, at, acc, out_dtype=tl.float32)
    pdl_trigger(USE_PDL)  # the next kernel's programs may take the SMs this one leaves
    out = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    if not BLOCKWISE:  # per token (or tensor) x per channel (or tensor): once, after the sum
        sa = tl.load(as_ptr + offs_m * stride_asm, mask=m_mask, other=0.0)
        sw = tl.load(ws_ptr + (offs_n % N) * stride_wsn)
        out = out * sa[:, None] * sw[None, :]
    at = offs_m[:, None] * N + offs_n[None, :]  # y[m, n], [BLOCK_M, BLOCK_N]
    mask = m_mask[:, None] & n_mask[None, :]
    if not SPLIT:
        tl.store(y_ptr + at, out.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(partial_ptr + at, out, mask=mask, sem="relaxed")
        split_k_finish(y_ptr, partial_ptr, count_ptr, pid_n, split_k, at, mask)


def fp8_rows_reference(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor,
                       w_scale: torch.Tensor, out_dtype: torch.dtype,
                       block: tuple[int, int] | None = None, **tiles) -> torch.Tensor:
    """The definition (tiles ignored): fp8_gemm's, the dequantized operands' product in fp32."""
    return fp8_gemm_reference(a, a_scale, w, w_scale, out_dtype, block)


def fp8_rows(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype, block: tuple[int, int] | None = None, block_n: int = 64,
             block_k: int = 256, num_warps: int = 4, num_stages: int = 4,
             programs_per_sm: int = 2, split_k: int | None = None,
             w_tma: bool = False) -> torch.Tensor:
    """See the module docstring. block_n: output features a program (the MMA's M: >= 64, and
    >= 16 * num_warps for one wgmma a warpgroup); block_k: K a step (cut to the scale block's
    BK when block-wise); split_k: programs sharing a column block's K (default: about
    programs_per_sm programs per SM); w_tma: load W's tiles by TMA where a descriptor fits
    (kernels/tma.py's w_tma_fits, $TINYPAGED_FP8_TMA not 0), else by pointer loads."""
    if not use_triton(a):
        return fp8_rows_reference(a, a_scale, w, w_scale, out_dtype, block)
    M, K = a.shape
    N = w.shape[0]
    if not 1 <= M <= ROWS_MAX_M:
        raise ValueError(f"fp8_rows: a has {M} rows; it takes 1 to {ROWS_MAX_M} (use fp8_gemm)")
    if a.dtype != FP8_DTYPE or w.dtype != FP8_DTYPE or tuple(w.shape) != (N, K) \
            or w.stride(1) != 1:
        raise ValueError(f"fp8_rows: a [M, K] and w [N, K={K}] must be float8_e4m3fn, w "
                         f"contiguous along K; got a {a.dtype}, w {w.dtype} of shape "
                         f"{tuple(w.shape)} and strides {w.stride()}")
    a = a if a.stride(1) == 1 else a.contiguous()
    if block is not None:
        block_k = min(block_k, block[1])
        if block[0] % block_n or block[1] % block_k:
            raise ValueError(f"fp8_rows: the scale block {list(block)} must be whole tiles of "
                             f"[block_n, block_k] = [{block_n}, {block_k}]")
    a_scale = a_scale.reshape(a_scale.shape[0], -1)
    w_scale = w_scale.reshape(w_scale.shape[0], -1)
    asm, ask = _scale_strides(a_scale, M)
    wsn, wsk = _scale_strides(w_scale, N if block is None else cdiv(N, block[0]))
    n_blocks, steps = cdiv(N, block_n), cdiv(K, block_k)
    if split_k is None:
        target = programs_target(a.device) * programs_per_sm // 4
        split_k = max(1, min(steps, cdiv(target, n_blocks)))
    split_k = cdiv(steps, cdiv(steps, split_k))  # drop splits that would get no step
    use_tma = w_tma and w_tma_fits(w, block_n, block_k)
    y = torch.empty(M, N, dtype=out_dtype, device=a.device)
    # the GEMV's sizes (16 rows, 8-column blocks), so that no decode batch size reallocates the
    # shared workspace after another one's CUDA graph captured it
    partial, count = (split_k_workspace(a.device, ROWS_MAX_M * N, cdiv(N, 8)) if split_k > 1
                      else (y, y))
    pdl = pdl_enabled(a)
    _fp8_rows_kernel[(n_blocks, split_k)](
        a, w_operand(w, use_tma, block_n, block_k), w, a_scale, w_scale, y, partial, count, M, N,
        K, a.stride(0), w.stride(0), asm, ask, wsn, wsk, split_k, BLOCK_M=ROWS_MAX_M,
        BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCKWISE=block is not None, SCALE_BN=1 if block is None else block[0],
        SCALE_BK=1 if block is None else block[1], EVEN_K=K % block_k == 0, SPLIT=split_k > 1,
        STAGES=num_stages, W_TMA=use_tma, USE_PDL=pdl, num_warps=num_warps, **launch_kwargs(pdl))
    return y


# Tiles by rows (rounded up to a power of two) and scale kind; "_block": [128, 128] weight
# blocks (block_n divides 128, block_k <= 128). From benchmarks/fp8_gemv.py --sweep-rows on an
# H200 (the fastest summed over the Llama-3-8B layers at each row count).
FP8_ROWS_CONFIGS = {
    "m2": dict(block_n=64, block_k=256, num_warps=4, num_stages=4, programs_per_sm=2, w_tma=True),
    "m2_block": dict(block_n=64, block_k=128, num_warps=4, num_stages=4, programs_per_sm=2),
    "m4": dict(block_n=64, block_k=256, num_warps=4, num_stages=4, programs_per_sm=2, w_tma=True),
    "m4_block": dict(block_n=64, block_k=128, num_warps=4, num_stages=4, programs_per_sm=2),
    "m8": dict(block_n=64, block_k=256, num_warps=4, num_stages=4, programs_per_sm=2, w_tma=True),
    "m8_block": dict(block_n=64, block_k=128, num_warps=4, num_stages=4,
                     programs_per_sm=2, w_tma=True),
    "m16": dict(block_n=64, block_k=128, num_warps=4, num_stages=6, programs_per_sm=2, w_tma=True),
    "m16_block": dict(block_n=64, block_k=128, num_warps=4, num_stages=4, programs_per_sm=2),
}


def fp8_rows_config(M: int, block: tuple[int, int] | None) -> dict:
    """fp8_rows' tiles for M rows (block: the weight's scale block)."""
    return FP8_ROWS_CONFIGS[f"m{max(2, 1 << (M - 1).bit_length())}" + ("_block" if block else "")]
