"""Int4 AWQ matmul: y = x @ W with W dequantized from 4-bit integers on the fly.

The checkpoint layout (see awq_format.py, which also holds the packers and torch references):
    qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales [K/G, N]
    W[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]                      # [K, N]
Column 8j + c of a packed word sits at shift 4 * [0, 4, 1, 5, 2, 6, 3, 7][c]; the kernels below
unpack with those shifts and a 0xF mask.

Four ways to compute y [M, N] (fp32 accumulation, result in x's dtype), picked by awq_gemm:
- Batch-1 GEMV (M = 1: single-stream decode), awq_gemv.py, on CUDA cores.
- Batched decode (2 <= M <= 16): memory-bound, on tensor cores: the batched GEMV of
  awq_gemv.py (one tl.dot per column of a word, x in the M slot) or awq_mma.py (the weights in
  the M slot), chosen per shape by DECODE_PATHS, a measured table.
- Tiled GEMM (16 < M < 128, wide layers N >= 3K only). Each K tile is dequantized in registers
  and fed to tl.dot.
- Dense (every other M > 16: prefill, large decode batches). Dequantizing the whole weight once
  (~2.5 bytes per weight of traffic) and calling cuBLAS beats dequantizing per tile of M, as in
  vLLM: at prefill sizes the dequantize is small next to the GEMM, and cuBLAS's GEMM reaches
  far more of the tensor cores than a Triton int4 GEMM did (benchmarks/RESULTS-log.md).
"""
from __future__ import annotations

import torch

from tinypaged.kernels import awq_mma
from tinypaged.kernels._triton import cdiv, dot_precision, jit, tl, use_triton

# the format and references live in awq_format.py; re-exported so `awq.pack_awq` etc. keep working
from tinypaged.kernels.awq_format import (
    AWQ_PACK_ORDER,
    awq_dequantize_reference,
    awq_gemm_reference,
    pack_awq,
    pack_int4,
    unpack_awq,
    unpack_int4,
)

# the decode GEMVs live in awq_gemv.py, the tensor-core GEMMs in awq_mma.py
from tinypaged.kernels.awq_gemv import (
    _awq_gemv,
    _awq_gemv1,
    gemv_scales,
)

__all__ = [
    "AWQ_PACK_ORDER", "DECODE_PATHS", "DENSE_MIN_M", "GEMV_MAX_M", "SUPPORTED_GROUP_SIZES",
    "TILED_MIN_N_OVER_K", "decode_path",
    "awq_dequantize", "awq_dequantize_reference", "awq_gemm", "awq_gemm_reference",
    "gemv_scales", "pack_awq", "pack_int4", "unpack_awq", "unpack_int4",
]

SUPPORTED_GROUP_SIZES = (32, 64, 128)
GEMV_MAX_M = 16  # up to here the decode kernels (DECODE_PATHS), with gemv_scales' scales
DENSE_MIN_M = 128  # from here always dequantize once and use torch.matmul
TILED_MIN_N_OVER_K = 3  # below DENSE_MIN_M the tiled GEMM wins only for layers this wide


# ----------------------------------------------------------------------------- Triton kernels


@jit
def _unpack_int4(packed, ROWS: tl.constexpr, COLS: tl.constexpr):
    # int32 [ROWS, COLS] -> int32 [ROWS, 8 * COLS] in natural column order
    c = tl.arange(0, 8)
    shifts = ((c // 2) + (c % 2) * 4) * 4  # 4 * [0, 4, 1, 5, 2, 6, 3, 7][c]
    q = (packed[:, :, None] >> shifts[None, None, :]) & 0xF  # [ROWS, COLS, 8]
    return tl.reshape(q, (ROWS, COLS * 8))


@jit(do_not_specialize=('M',))
def _awq_gemm_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # grid: (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),); GROUP_SIZE % BLOCK_K == 0, so a K tile has
    # one row of scales and zeros
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # GROUP_M row blocks sweep the column blocks together, so their weight tiles are reused from L2
    pids_per_group = GROUP_M * num_pid_n
    first_m = (pid // pids_per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % pids_per_group) % group_rows
    pid_n = (pid % pids_per_group) // group_rows

    PACKED_N: tl.constexpr = BLOCK_N // 8
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_pn = pid_n * PACKED_N + tl.arange(0, PACKED_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    pn_mask = offs_pn < N // 8

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                    mask=m_mask[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
        packed = tl.load(qweight_ptr + k[:, None] * (N // 8) + offs_pn[None, :],
                         mask=pn_mask[None, :], other=0)
        q = _unpack_int4(packed, BLOCK_K, PACKED_N).to(tl.float32)  # [BLOCK_K, BLOCK_N]
        g = k0 // GROUP_SIZE
        packed_z = tl.load(qzeros_ptr + g * (N // 8) + offs_pn[None, :],
                           mask=pn_mask[None, :], other=0)
        z = _unpack_int4(packed_z, 1, PACKED_N).to(tl.float32)  # [1, BLOCK_N]
        s = tl.load(scales_ptr + g * N + offs_n[None, :], mask=n_mask[None, :],
                    other=0.0).to(tl.float32)  # [1, BLOCK_N]
        w = ((q - z) * s).to(x.dtype)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)

    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@jit
def _awq_dequantize_kernel(
    qweight_ptr, qzeros_ptr, scales_ptr, w_ptr,  # w: [K, N]
    N, GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # grid: (K / BLOCK_K, cdiv(N, BLOCK_N)); GROUP_SIZE % BLOCK_K == 0
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    PACKED_N: tl.constexpr = BLOCK_N // 8
    k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_pn = pid_n * PACKED_N + tl.arange(0, PACKED_N)
    n_mask = offs_n < N
    pn_mask = offs_pn < N // 8
    g = (pid_k * BLOCK_K) // GROUP_SIZE
    packed = tl.load(qweight_ptr + k[:, None] * (N // 8) + offs_pn[None, :],
                     mask=pn_mask[None, :], other=0)
    q = _unpack_int4(packed, BLOCK_K, PACKED_N).to(tl.float32)  # [BLOCK_K, BLOCK_N]
    packed_z = tl.load(qzeros_ptr + g * (N // 8) + offs_pn[None, :], mask=pn_mask[None, :], other=0)
    z = _unpack_int4(packed_z, 1, PACKED_N).to(tl.float32)  # [1, BLOCK_N]
    s = tl.load(scales_ptr + g * N + offs_n[None, :], mask=n_mask[None, :]).to(tl.float32)
    w = (q - z) * s
    tl.store(w_ptr + k[:, None] * N + offs_n[None, :], w.to(w_ptr.dtype.element_ty),
             mask=n_mask[None, :])


# ----------------------------------------------------------------------------- launchers


def _check_packed(qweight, qzeros, scales, group_size: int, fn: str) -> tuple[int, int]:
    """Validate the three AWQ tensors; returns (K, N)."""
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"{fn}: group_size={group_size} is not supported; "
                         f"use one of {SUPPORTED_GROUP_SIZES}")
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"{fn}: qweight must be a 2-D int32 tensor [K, N/8], got "
                         f"{qweight.dtype} of shape {tuple(qweight.shape)}")
    K, N = qweight.shape[0], qweight.shape[1] * 8
    if K % group_size != 0:
        raise ValueError(f"{fn}: qweight has K={K} input rows, not a multiple of "
                         f"group_size={group_size}; check group_size against the checkpoint")
    if qzeros.dtype != torch.int32 or tuple(qzeros.shape) != (K // group_size, N // 8):
        raise ValueError(f"{fn}: qzeros must be int32 of shape [K/group_size, N/8] = "
                         f"{[K // group_size, N // 8]}, got {qzeros.dtype} of shape "
                         f"{list(qzeros.shape)}")
    if not scales.is_floating_point() or tuple(scales.shape) != (K // group_size, N):
        raise ValueError(f"{fn}: scales must be floating point of shape [K/group_size, N] = "
                         f"{[K // group_size, N]}, got {scales.dtype} of shape "
                         f"{list(scales.shape)}")
    if not (qweight.device == qzeros.device == scales.device):
        raise ValueError(f"{fn}: qweight, qzeros and scales must be on one device, got "
                         f"{qweight.device}, {qzeros.device}, {scales.device}")
    return K, N


def _check_args(x, qweight, qzeros, scales, group_size: int) -> tuple[int, int]:
    K, N = _check_packed(qweight, qzeros, scales, group_size, "awq_gemm")
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"awq_gemm: x must be a 2-D fp16/bf16/fp32 tensor [M, K], got "
                         f"{x.dtype} of shape {tuple(x.shape)}")
    if x.shape[1] != K:
        raise ValueError(f"awq_gemm: x has {x.shape[1]} columns but qweight has K={K} rows; "
                         f"x must be [M, K]")
    if x.device != qweight.device:
        raise ValueError(f"awq_gemm: x is on {x.device} but the weights are on {qweight.device}")
    return K, N


def _awq_gemm(x, qweight, qzeros, scales, group_size, block_m=None, block_n=128,
              block_k=None, num_warps=4, num_stages=3):
    M, K = x.shape
    N = qweight.shape[1] * 8
    block_m = block_m or (64 if M <= 64 else 128)
    block_k = block_k or min(64, group_size)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (cdiv(M, block_m) * cdiv(N, block_n),)
    _awq_gemm_kernel[grid](
        x, qweight, qzeros, scales, y, M, N, K, x.stride(0), y.stride(0),
        GROUP_SIZE=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
        DOT_PRECISION=dot_precision(x.dtype), num_warps=num_warps, num_stages=num_stages,
    )
    return y


def awq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   group_size: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dense W [K, N] = (q - z) * s in `dtype` (default: the scales' dtype)."""
    K, N = _check_packed(qweight, qzeros, scales, group_size, "awq_dequantize")
    dtype = dtype or scales.dtype
    if not use_triton(qweight):
        return awq_dequantize_reference(qweight, qzeros, scales, group_size).to(dtype)
    w = torch.empty(K, N, dtype=dtype, device=qweight.device)
    block_k, block_n = min(32, group_size), 128
    _awq_dequantize_kernel[(K // block_k, cdiv(N, block_n))](
        qweight.contiguous(), qzeros.contiguous(), scales.contiguous(), w, N,
        GROUP_SIZE=group_size, BLOCK_K=block_k, BLOCK_N=block_n,
    )
    return w


def awq_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
             scales: torch.Tensor, group_size: int,
             scales_t: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ ((q - z) * s), fp32 accumulation, in x's dtype.

    scales_t: optionally gemv_scales(scales), which the batch-1 path reads faster."""
    K, N = _check_args(x, qweight, qzeros, scales, group_size)
    if not use_triton(x):
        return awq_gemm_reference(x, qweight, qzeros, scales, group_size)
    M = x.shape[0]
    if M == 0:
        return x.new_empty(0, N)
    if x.stride(1) != 1:
        x = x.contiguous()
    qweight, qzeros, scales = qweight.contiguous(), qzeros.contiguous(), scales.contiguous()
    if scales_t is not None and tuple(scales_t.shape) != (scales.shape[0], 8, N // 8):
        raise ValueError(f"awq_gemm: scales_t must be gemv_scales(scales), of shape "
                         f"{[scales.shape[0], 8, N // 8]}, got {list(scales_t.shape)}")
    if M == 1:
        return _awq_gemv1(x, qweight, qzeros, scales, group_size, scales_t=scales_t)
    if M <= GEMV_MAX_M:
        # the paired-PTX dequant on the GPU; the interpreter runs the portable one
        name, config = decode_path(M, N, K)
        launcher = _awq_gemv if name == "awq_gemv" else awq_mma.awq_mma
        return launcher(x, qweight, qzeros, scales, group_size, scales_t=scales_t,
                        asm=x.is_cuda, **config)
    if M >= DENSE_MIN_M or N < TILED_MIN_N_OVER_K * K:
        return x @ awq_dequantize(qweight, qzeros, scales, group_size, dtype=x.dtype)
    return _awq_gemm(x, qweight, qzeros, scales, group_size)


# (max M, min N / K, kernel, tile configuration) for 2 <= M <= GEMV_MAX_M, kernel "awq_mma"
# (awq_mma.py) or "awq_gemv" (awq_gemv.py's batched GEMV): the one place these crossovers live,
# measured with benchmarks/awq_gemv.py --layers. Wide layers (gate_up) stream fastest with the
# weights in the MMA's M slot; the rest with x there.
DECODE_PATHS = (
    (8, 3, "awq_mma", dict(block_n=512, scale_w=True, min_block_m=8)),
    (GEMV_MAX_M, 0, "awq_gemv", {}),
)


def decode_path(M: int, N: int, K: int) -> tuple[str, dict]:
    """The first row of DECODE_PATHS whose max M and min N / K fit."""
    for max_m, min_n_over_k, name, config in DECODE_PATHS:
        if M <= max_m and N >= min_n_over_k * K:
            return name, config
    raise ValueError(f"no decode path for M={M} (at most GEMV_MAX_M={GEMV_MAX_M} rows)")
