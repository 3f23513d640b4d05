"""The GGUF batched-decode matmul on tensor cores: y [M, N] = x [M, K] @ W^T, 2 <= M <= 16,
W in Q4_K or Q6_K blocks (the two types of a Q4_K_M file), in the device layout.

The CUDA-core GEMV (gguf_gemv.py) spends at least one FMA per weight and row of x, so at M = 8
its arithmetic, not its bytes, sets the time. Here the weights go through the tensor cores
instead, computed transposed as in awq_mma.py: y^T [BLOCK_N, BLOCK_M] = W x^T, the weights in
the M slot of tl.dot, x^T padded to BLOCK_M = 16 columns in the N slot. A K step is one
super-block of 256 weights a row, and each sub-block (Q4_K: 8 of 32 weights, Q6_K: 16 of 16) is
one product:

    y^T[n, m] += scale[n, s] * sum_j q[n, s, j] x[m, k(s, j)] + min[n, s] * sum_j x[m, k(s, j)]

- A sub-block's quants are contiguous 16-byte chunks of the device layout (gguf_layout.py), so
  they load as a [BLOCK_N, 16 or 32] uint8 tile; inside a chunk the bytes are transposed
  (position 4w + b holds weight 4b + w), and the dot's K order follows the bytes: x^T is
  gathered in that order instead of moving weights.
- q becomes a 16-bit float exactly by OR-ing it into the bits of 128.0 (bf16; 1024.0 in fp16):
  the tile is 128 + q, and the product minus 128 * sum x is the product with q (awq_unpack.py's
  trick). fp32 activations (tests, fp32 models) take q as fp32 and IEEE products.
- K is split so ~4 programs per SM stream weights; the sums finish as split_k.py says (atomics
  into the shared fp32 workspace, the last program of a row block writes y).
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import cdiv, dot_precision, jit, tl
from tinypaged.kernels.awq_unpack import MAGIC16
from tinypaged.kernels.gguf_format import check_qweight
from tinypaged.kernels.split_k import (
    programs_target,
    split_k_finish,
    split_k_range,
    split_k_workspace,
)

MMA_TYPES = (12, 14)  # Q4_K, Q6_K
MMA_MAX_M = 16


@jit
def _x_tile(x_ptr, stride_xm, M, k0, half, SUBLEN: tl.constexpr, BLOCK_M: tl.constexpr):
    # x^T [SUBLEN, BLOCK_M] for the weights k0 + l of a sub-block, row kk of the tile holding
    # l = 16 (kk // 16) + 4 (kk % 4) + kk % 16 // 4 (a transposed chunk's byte order); `half`
    # [SUBLEN, 1] is kk // 16 (Q6_K: the sub-block's own 16 weights start at 16 lh)
    kk = tl.arange(0, SUBLEN)[:, None]
    m = tl.arange(0, BLOCK_M)[None, :]
    pos = 16 * half + 4 * (kk % 4) + kk % 16 // 4
    return tl.load(x_ptr + m * stride_xm + k0 + pos, mask=m < M, other=0.0)


@jit
def _q_dot(acc, q, xt, scale, mn, MAGIC16: tl.constexpr, OFFSET: tl.constexpr,
           DOT_PRECISION: tl.constexpr, XS_DOT: tl.constexpr):
    # acc [BN, BM] + scale * (q @ x^T) + mn * sum(x): q int32 [BN, SUBLEN] in 0..63, x^T
    # [SUBLEN, BM]; scale and mn [BN, 1] fp32. XS_DOT: sum(x) by a second product, with a tile
    # of ones, which lands in acc's own layout (a sum over x^T's rows crosses threads)
    if MAGIC16:
        w = (q | MAGIC16).to(tl.int16).to(xt.dtype, bitcast=True)  # OFFSET + q, exactly
    else:
        w = q.to(tl.float32)
    qx = tl.dot(w, xt, input_precision=DOT_PRECISION)  # [BN, BM] fp32
    if XS_DOT:
        xs = tl.dot(tl.full(w.shape, 1.0, w.dtype), xt, input_precision=DOT_PRECISION)
    else:
        xs = tl.sum(xt.to(tl.float32), axis=0)[None, :]  # [1, BM]
    return acc + scale * (qx - OFFSET * xs) + mn * xs


@jit(do_not_specialize=("M", "split_k"))
def _gguf_mma_kernel(
    x_ptr, w_ptr, i8_ptr, f16_ptr, y_ptr, partial_ptr, count_ptr,
    M, N, K, stride_xm, stride_w, split_k,
    QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT: tl.constexpr,
    MAGIC16: tl.constexpr, OFFSET: tl.constexpr, DOT_PRECISION: tl.constexpr,
    XS_DOT: tl.constexpr,
):
    # grid: (cdiv(N, BLOCK_N), split_k). w_ptr, i8_ptr, f16_ptr: qweight [N, stride_w] bytes as
    # uint8, int8 and fp16; planes at gguf_layout.PLANES
    pid_n = tl.program_id(0)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = (rows < N)[:, None]  # [BN, 1]
    row = (rows.to(tl.int64) * stride_w)[:, None]  # first byte of each row
    nb = K // 256
    first, last = split_k_range(nb, split_k)
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    t16 = tl.arange(0, 16)[None, :]  # byte of a 16-byte chunk
    for step in range(first, last):
        k0 = step * 256
        if QTYPE == 12:  # Q4_K: sub-blocks 2g (low nibbles) and 2g + 1 (high) of chunks 2g and
            # 2g + 1, at positions g and 4 + g; header d, dmin, 12 scale bytes at nb * 128
            hdr = row + nb * 128 + step * 16
            d = tl.load(f16_ptr + hdr // 2, mask=row_ok, other=0.0).to(tl.float32)
            dmin = tl.load(f16_ptr + hdr // 2 + 1, mask=row_ok, other=0.0).to(tl.float32)
            t32 = tl.arange(0, 32)[None, :]
            half = tl.arange(0, 32)[:, None] // 16
            for g in tl.static_range(4):
                qs = tl.load(w_ptr + row + step * 128 + t32 // 16 * 64 + g * 16 + t32 % 16,
                             mask=row_ok, other=0).to(tl.int32)  # [BN, 32]
                for nib in tl.static_range(2):
                    s = 2 * g + nib
                    sc, mn = _k_scale_min(w_ptr, hdr + 4, s, row_ok)
                    xt = _x_tile(x_ptr, stride_xm, M, k0 + 32 * s, half, 32, BLOCK_M)
                    acc = _q_dot(acc, (qs >> (4 * nib)) & 0xF, xt, d * sc, -dmin * mn,
                                 MAGIC16, OFFSET, DOT_PRECISION, XS_DOT)
        else:  # Q6_K: sub-block 8n + 2i + lh, 16 weights: ql chunk 4n + 2 (i % 2) + lh at
            # position 4 (i % 2) + 2n + lh (nibble i // 2), qh chunk 2n + lh (bits 2i, 2i + 1),
            # int8 scale at byte 4 (2n + lh) + i of the S6 plane (nb * 192), d at nb * 208
            d = tl.load(f16_ptr + (row + nb * 208) // 2 + step, mask=row_ok,
                        other=0.0).to(tl.float32)
            for h in tl.static_range(4):  # h = 2n + lh
                qh = tl.load(w_ptr + row + nb * 128 + step * 64 + h * 16 + t16, mask=row_ok,
                             other=0).to(tl.int32)
                lo = tl.load(w_ptr + row + step * 128 + h * 16 + t16, mask=row_ok,
                             other=0).to(tl.int32)
                hi = tl.load(w_ptr + row + step * 128 + 64 + h * 16 + t16, mask=row_ok,
                             other=0).to(tl.int32)
                for i in tl.static_range(4):
                    if i % 2 == 0:
                        ql = lo
                    else:
                        ql = hi
                    q = ((ql >> (4 * (i // 2))) & 0xF) | (((qh >> (2 * i)) & 3) << 4)
                    sc = tl.load(i8_ptr + row + nb * 192 + step * 16 + 4 * h + i, mask=row_ok,
                                 other=0).to(tl.float32)
                    xt = _x_tile(x_ptr, stride_xm, M, k0 + 128 * (h // 2) + 32 * i,
                                 tl.zeros((16, 1), tl.int32) + h % 2, 16, BLOCK_M)
                    acc = _q_dot(acc, q, xt, d * sc, -32.0 * d * sc, MAGIC16, OFFSET,
                                 DOT_PRECISION, XS_DOT)
    at = tl.arange(0, BLOCK_M)[None, :] * N + rows[:, None]  # y[m, n], [BN, BM]
    mask = row_ok & (tl.arange(0, BLOCK_M)[None, :] < M)
    if not SPLIT:
        tl.store(y_ptr + at, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        # acq_rel: each thread's sums are performed before the barrier lets the arrival count
        # move (with relaxed adds a GPU check read a split's sums late, at 8 warps and 2
        # splits)
        tl.atomic_add(partial_ptr + at, acc, mask=mask, sem="acq_rel")
        # the last split of this row block writes y (split_k.py)
        split_k_finish(y_ptr, partial_ptr, count_ptr, pid_n, split_k, at, mask)


@jit
def _k_scale_min(u8_ptr, sc_off, s: tl.constexpr, mask):
    # Q4_K: the 6-bit scale and min [BN, 1] of sub-block s from the 12 bytes at sc_off
    # (gguf_format.k_scale_min)
    a = tl.load(u8_ptr + sc_off + s % 4, mask=mask, other=0).to(tl.int32)
    b = tl.load(u8_ptr + sc_off + 4 + s % 4, mask=mask, other=0).to(tl.int32)
    if s < 4:
        sc = a & 63
        mn = b & 63
    else:
        c = tl.load(u8_ptr + sc_off + 8 + s % 4, mask=mask, other=0).to(tl.int32)
        sc = (c & 0xF) | ((a >> 6) << 4)
        mn = (c >> 4) | ((b >> 6) << 4)
    return sc.to(tl.float32), mn.to(tl.float32)


def gguf_mma(x: torch.Tensor, qweight: torch.Tensor, type_id: int, block_n: int = 64,
             split_k: int | None = None, num_warps: int = 4,
             xs_dot: bool = False) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T for 1 <= M <= MMA_MAX_M, W Q4_K or Q6_K in the device layout.
    xs_dot: the sums of x by a product with ones (see _q_dot)."""
    M, K = x.shape
    N = qweight.shape[0]
    if type_id not in MMA_TYPES or not 1 <= M <= MMA_MAX_M:
        raise ValueError(f"gguf_mma takes Q4_K / Q6_K weights and 1..{MMA_MAX_M} rows of x; "
                         f"got type {type_id}, M={M}")
    check_qweight(qweight, type_id, K, "gguf_mma")
    x, qweight = x.contiguous(), qweight.contiguous()
    n_blocks, steps = cdiv(N, block_n), K // 256
    if split_k is None:
        split_k = max(1, min(steps, programs_target(x.device) // n_blocks))
    split_k = cdiv(steps, cdiv(steps, split_k))  # drop splits that would get no step
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    partial, count = split_k_workspace(x.device, 16 * N, n_blocks)
    magic, offset = MAGIC16[x.dtype]
    _gguf_mma_kernel[(n_blocks, split_k)](
        x, qweight, qweight.view(torch.int8), qweight.view(torch.float16), y, partial, count,
        M, N, K, x.stride(0), qweight.shape[1], split_k,
        QTYPE=type_id, BLOCK_N=block_n, BLOCK_M=16, SPLIT=split_k > 1, MAGIC16=magic,
        OFFSET=offset, DOT_PRECISION=dot_precision(x.dtype), XS_DOT=xs_dot,
        num_warps=num_warps,
    )
    return y
