"""Int4 AWQ matmul: y = x @ W with W dequantized from 4-bit integers on the fly.

The checkpoint layout (see awq_format.py, which also holds the packers and torch references):
    qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales [K/G, N]
    W[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]                      # [K, N]
Column 8j + c of a packed word sits at shift 4 * [0, 4, 1, 5, 2, 6, 3, 7][c]; the kernels below
unpack with those shifts and a 0xF mask.

Four ways to compute y [M, N] (fp32 accumulation, result in x's dtype):
- Batch-1 GEMV (M = 1: single-stream decode). Pure bandwidth: 3-D weight tiles unpacked by shifts
  only, an fp32 accumulator reduced over K once at the end, K split across programs.
- Skinny split-K GEMV (2 <= M <= 16: batched decode). Memory-bound: a step must stream the packed
  weights once, a quarter of the bf16 bytes. N alone gives too few programs to fill the GPU
  (4096 / 128 = 32 column blocks for 132 SMs), so K is split as well and partial sums are
  atomically added into an fp32 buffer. Inside one group sum_k x (q - z) s =
  s * (sum_k x q - z * sum_k x): the raw integers feed tl.dot, and zero and scale are applied once
  per group and column.
- Tiled GEMM (16 < M < 256). Each K tile is dequantized in registers and fed to tl.dot.
- Dense (M >= 256: prefill). Compute-bound: dequantizing the whole weight once (~2.5 bytes per
  weight of traffic) and calling cuBLAS beats dequantizing per tile of M, as in vLLM.
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import cdiv, jit, num_sms, tl, use_triton

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

__all__ = [
    "AWQ_PACK_ORDER", "DENSE_MIN_M", "GEMV_MAX_M", "SUPPORTED_GROUP_SIZES", "awq_dequantize",
    "awq_dequantize_reference", "awq_gemm", "awq_gemm_reference", "pack_awq", "pack_int4",
    "unpack_awq", "unpack_int4",
]

SUPPORTED_GROUP_SIZES = (32, 64, 128)
GEMV_MAX_M = 16  # up to here the skinny split-K kernel; tl.dot tiles need at least 16 rows
DENSE_MIN_M = 256  # from here dequantize once and use torch.matmul


# ----------------------------------------------------------------------------- Triton kernels


@jit
def _unpack_int4(packed, ROWS: tl.constexpr, COLS: tl.constexpr):
    # int32 [ROWS, COLS] -> int32 [ROWS, 8 * COLS] in natural column order
    c = tl.arange(0, 8)
    shifts = ((c // 2) + (c % 2) * 4) * 4  # 4 * [0, 4, 1, 5, 2, 6, 3, 7][c]
    q = (packed[:, :, None] >> shifts[None, None, :]) & 0xF  # [ROWS, COLS, 8]
    return tl.reshape(q, (ROWS, COLS * 8))


@jit(do_not_specialize=('M',))
def _awq_gemv_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, y_ptr,  # y: [M, N], fp32 when SPLIT_K > 1
    M, N, K, stride_xm, stride_ym,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # grid: (cdiv(N, BLOCK_N), SPLIT_K); one K tile = one quantization group
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    PACKED_N: tl.constexpr = BLOCK_N // 8
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_pn = pid_n * PACKED_N + tl.arange(0, PACKED_N)
    offs_k = tl.arange(0, GROUP_SIZE)
    m_mask = offs_m < M
    n_mask = offs_n < N
    pn_mask = offs_pn < N // 8

    num_groups = K // GROUP_SIZE
    groups_per_split = tl.cdiv(num_groups, SPLIT_K)
    g_start = pid_k * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, num_groups)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(g_start, g_end):
        k = g * GROUP_SIZE + offs_k
        packed = tl.load(qweight_ptr + k[:, None] * (N // 8) + offs_pn[None, :],
                         mask=pn_mask[None, :], other=0)
        q = _unpack_int4(packed, GROUP_SIZE, PACKED_N)  # [GROUP_SIZE, BLOCK_N]
        packed_z = tl.load(qzeros_ptr + g * (N // 8) + offs_pn[None, :],
                           mask=pn_mask[None, :], other=0)
        z = _unpack_int4(packed_z, 1, PACKED_N).to(tl.float32)  # [1, BLOCK_N]
        s = tl.load(scales_ptr + g * N + offs_n[None, :], mask=n_mask[None, :],
                    other=0.0).to(tl.float32)  # [1, BLOCK_N]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                    mask=m_mask[:, None], other=0.0)  # [BLOCK_M, GROUP_SIZE]
        # q in 0..15 is exact in fp16 and bf16
        xq = tl.dot(x, q.to(x.dtype), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        x_sum = tl.sum(x.to(tl.float32), axis=1)[:, None]  # [BLOCK_M, 1]
        acc += (xq - x_sum * z) * s

    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    y_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=y_mask, sem="relaxed")


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


@jit
def _awq_gemv1_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, y_ptr,  # x: [K]; y: [N], fp32 when SPLIT_K > 1
    N, K,
    GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    # M = 1 (batch-1 decode): pure bandwidth. grid: (cdiv(N, BLOCK_N), SPLIT_K). Each program
    # streams BLOCK_K x BLOCK_N/8 words a step (64-byte row pieces at BLOCK_N = 128). Tiles stay
    # 3-D, [k, word, column within the word], so unpacking is shifts only (no register
    # shuffle), and the fp32 accumulator is reduced over k once, at the end.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    PACKED_N: tl.constexpr = BLOCK_N // 8
    offs_pn = pid_n * PACKED_N + tl.arange(0, PACKED_N)  # [PACKED_N] word index
    c = tl.arange(0, 8)
    shifts = ((c // 2) + (c % 2) * 4) * 4  # [8]: column c sits at nibble [0, 4, 1, 5, ...][c]
    offs_n = offs_pn[:, None] * 8 + c[None, :]  # [PACKED_N, 8] natural column index
    pn_mask = offs_pn < N // 8
    steps_per_split = tl.cdiv(K // BLOCK_K, SPLIT_K)
    k_start = pid_k * steps_per_split * BLOCK_K
    k_end = tl.minimum(k_start + steps_per_split * BLOCK_K, K)
    acc = tl.zeros((BLOCK_K, PACKED_N, 8), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        packed = tl.load(qweight_ptr + offs_k[:, None] * (N // 8) + offs_pn[None, :],
                         mask=pn_mask[None, :], other=0)  # [BLOCK_K, PACKED_N]
        q = ((packed[:, :, None] >> shifts[None, None, :]) & 0xF).to(tl.float32)  # [K, PN, 8]
        g = k0 // GROUP_SIZE  # BLOCK_K divides GROUP_SIZE: one group per step
        packed_z = tl.load(qzeros_ptr + g * (N // 8) + offs_pn, mask=pn_mask, other=0)
        z = ((packed_z[:, None] >> shifts[None, :]) & 0xF).to(tl.float32)  # [PACKED_N, 8]
        s = tl.load(scales_ptr + g * N + offs_n, mask=pn_mask[:, None],
                    other=0.0).to(tl.float32)  # [PACKED_N, 8]
        x = tl.load(x_ptr + offs_k).to(tl.float32)  # [BLOCK_K]
        acc += x[:, None, None] * ((q - z[None]) * s[None])
    out = tl.sum(acc, axis=0)  # [PACKED_N, 8]
    if SPLIT_K == 1:
        tl.store(y_ptr + offs_n, out.to(y_ptr.dtype.element_ty), mask=pn_mask[:, None])
    else:
        tl.atomic_add(y_ptr + offs_n, out, mask=pn_mask[:, None], sem="relaxed")


# ----------------------------------------------------------------------------- launchers


def _programs_target(device: torch.device) -> int:
    # ~4 programs per SM keep every SM busy; under the interpreter few programs keep tests fast
    return 4 * num_sms(device.index or 0) if device.type == "cuda" else 4


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs (CPU tests, fp32 models) get full fp32 products instead of TF32
    return "ieee" if dtype == torch.float32 else "tf32"


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


def _awq_gemv1(x, qweight, qzeros, scales, group_size, block_n=128, block_k=32, split_k=None,
               num_warps=4, num_stages=3):
    """M = 1: the 2-D-accumulator GEMV above; split-K so ~4 programs per SM stream weights."""
    K = x.shape[1]
    N = qweight.shape[1] * 8
    block_k = min(block_k, group_size)
    n_blocks = cdiv(N, block_n)
    steps = K // block_k
    if split_k is None:
        split_k = max(1, min(steps, cdiv(_programs_target(x.device), n_blocks)))
    split_k = cdiv(steps, cdiv(steps, split_k))  # drop splits that would get no step
    y = (torch.empty if split_k == 1 else torch.zeros)(
        1, N, dtype=x.dtype if split_k == 1 else torch.float32, device=x.device)
    _awq_gemv1_kernel[(n_blocks, split_k)](
        x, qweight, qzeros, scales, y, N, K,
        GROUP_SIZE=group_size, BLOCK_K=block_k, BLOCK_N=block_n, SPLIT_K=split_k,
        num_warps=num_warps, num_stages=num_stages,
    )
    return y.to(x.dtype)


def _awq_gemv(x, qweight, qzeros, scales, group_size, block_n=128, split_k=None, num_warps=4):
    """2 <= M <= 16: split-K over groups, one tl.dot tile of 16 rows (M = 1 has _awq_gemv1)."""
    M, K = x.shape
    N = qweight.shape[1] * 8
    num_groups = K // group_size
    n_blocks = cdiv(N, block_n)
    if split_k is None:
        split_k = max(1, min(num_groups, cdiv(_programs_target(x.device), n_blocks)))
    # drop splits that would get no group
    split_k = cdiv(num_groups, cdiv(num_groups, split_k))
    out_dtype = x.dtype if split_k == 1 else torch.float32
    y = (torch.empty if split_k == 1 else torch.zeros)(M, N, dtype=out_dtype, device=x.device)
    _awq_gemv_kernel[(n_blocks, split_k)](
        x, qweight, qzeros, scales, y, M, N, K, x.stride(0), y.stride(0),
        GROUP_SIZE=group_size, BLOCK_M=16, BLOCK_N=block_n,
        SPLIT_K=split_k, DOT_PRECISION=_dot_precision(x.dtype), num_warps=num_warps,
    )
    return y.to(x.dtype)


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
        DOT_PRECISION=_dot_precision(x.dtype), num_warps=num_warps, num_stages=num_stages,
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
             scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """y [M, N] = x [M, K] @ ((q - z) * s), fp32 accumulation, in x's dtype."""
    _, N = _check_args(x, qweight, qzeros, scales, group_size)
    if not use_triton(x):
        return awq_gemm_reference(x, qweight, qzeros, scales, group_size)
    M = x.shape[0]
    if M == 0:
        return x.new_empty(0, N)
    if x.stride(1) != 1:
        x = x.contiguous()
    qweight, qzeros, scales = qweight.contiguous(), qzeros.contiguous(), scales.contiguous()
    if M == 1:
        return _awq_gemv1(x, qweight, qzeros, scales, group_size)
    if M <= GEMV_MAX_M:
        return _awq_gemv(x, qweight, qzeros, scales, group_size)
    if M >= DENSE_MIN_M:
        return x @ awq_dequantize(qweight, qzeros, scales, group_size, dtype=x.dtype)
    return _awq_gemm(x, qweight, qzeros, scales, group_size)
