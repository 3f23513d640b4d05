"""The GGUF decode GEMV: y [M, N] = x [M, K] @ W^T for 1 <= M <= 8, W in the device layout.

W is `qweight` uint8 [N, row_bytes] regrouped into planes (gguf_layout.py): each row starts with
its quant plane, 16-byte chunks transposed, then the scale planes. Decode reads each weight once
per step, so the kernel is a stream over the quant plane, and its arithmetic per weight must stay
a handful of instructions (gguf_gemv_step.py: the loads and the arithmetic of one K step, per
block type). This file is the loop around them:

- A program owns BLOCK_N rows and walks K in steps of 128 quant bytes a row, held as
  [H, BLOCK_N, 4] int32 tiles: chunk h, row, word. h comes first so that lanes go along a row's
  chunks, then along rows (wrapping: a thread holds BLOCK_N / (rows a program's lanes cover)
  rows, which share its activation loads). Legacy types take H = 8 chunks of 16 bytes; the
  k-quants H = 4 threads a row, each with two chunks 64 bytes apart (gguf_layout.py's chunk
  orders: Q4_K / Q5_K sub-blocks 2h and 2h + 1, Q6_K 16 weights of every quarter).
- With prefetch the loop carries the next step's loads: they are issued before this step's
  arithmetic, so a warp's memory latency hides behind its own work, not only behind other
  warps' (few fit on an SM: the decoded weights take registers).
- K is split so that ~4 programs per SM stream weights; split-K sums go by atomics to the shared
  fp32 workspace, and the last program of a row block writes y (one launch, split_k.py).
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import cdiv, jit, next_power_of_2, num_sms, tl
from tinypaged.kernels.gguf_format import check_qweight, ggml_type, row_bytes
from tinypaged.kernels.gguf_gemv_step import _load_step, _step_dot
from tinypaged.kernels.pdl import launch_kwargs, pdl_enabled, pdl_trigger, pdl_wait
from tinypaged.kernels.split_k import (
    split_k_finish,
    split_k_range,
    split_k_store,
    split_k_workspace,
)

GEMV_MAX_M = 8
BLOCKS_PER_STEP = {12: 1, 13: 1, 14: 1, 8: 4, 2: 8, 3: 8}  # blocks in 128 bytes of quants
_ONE = 0x3F800000  # the bits of 1.0, passed at run time so ptxas fuses mask and OR into one LOP3


@jit(do_not_specialize=("M", "split_k"))
def _gguf_gemv_kernel(
    x_ptr, w32_ptr, f16_ptr, y_ptr,  # x [M, K]; qweight as int32 and fp16; y [M, N]
    partial_ptr, count_ptr,  # fp32 [M, N] and int32 [cdiv(N, BLOCK_N)], zero before and after
    M, N, K, stride_xm, stride_w, one, split_k,
    QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT: tl.constexpr,
    STAGES: tl.constexpr, ROW_ALIGN: tl.constexpr, WHOLE: tl.constexpr,
    PREFETCH: tl.constexpr, ASM: tl.constexpr,
    USE_PDL: tl.constexpr,  # chained to the kernels around it (kernels/pdl.py)
):
    # grid: (cdiv(N, BLOCK_N), split_k); a row is stride_w * ROW_ALIGN words: ROW_ALIGN = 4 tells
    # the compiler that rows start 16-byte aligned, so that 16-byte loads can be used; WHOLE:
    # the row's blocks are a multiple of 4 (see gguf_gemv_step._f16_group)
    pid_n = tl.program_id(0)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = (rows < N)[None, :, None]
    row_w = (rows.to(tl.int64) * stride_w * ROW_ALIGN)[None, :, None]  # [1, BN, 1] first word
    # a thread reads 16-byte chunk h of the step's 128 quant bytes (k-quants: chunks h and h + 4)
    H: tl.constexpr = 4 if QTYPE >= 12 else 8
    h = tl.arange(0, H)[:, None, None]  # first dim: lanes go along chunks, then rows
    w = tl.arange(0, 4)[None, None, :]  # word of the chunk
    BPS: tl.constexpr = 1 if QTYPE >= 12 else (4 if QTYPE == 8 else 8)
    ELEMS: tl.constexpr = 256 if QTYPE >= 12 else 32  # weights of a block
    nb = K // ELEMS
    steps = tl.cdiv(nb, BPS)
    first, last = split_k_range(steps, split_k)
    acc = tl.zeros((H, BLOCK_N, BLOCK_M), tl.float32)
    # the rows of x: the k-quants take them one at a time in a loop that is not unrolled
    # (unrolled 8 times, the body made the compile take minutes; all at once, as [.., BLOCK_M]
    # tensors, it ran twice as long on the H200); the legacy types all at once
    # (gguf_gemv_step._dot_rows), which cut 2-8 rows of the SmolLM2-135M layers by a quarter
    # to a half. Each row reuses the step's decoded weights
    ROWS_X = 1 if BLOCK_M == 1 else M
    # the step's block of chunk h (legacy blocks of 16 or 32 quant bytes) and the loads that
    # exist; with PREFETCH the loop carries the next step's loads, issued before this step's
    # arithmetic so that memory latency hides behind it
    blk = first * BPS + h // (8 // BPS)  # [H, 1, 1]
    v0, v1, v2, v3, v4 = _load_step(w32_ptr, f16_ptr, row_w, nb, first, blk, h, w,
                                    row_ok & (blk < nb) & (first < last), QTYPE, WHOLE)
    # PDL: the first step's weights (above) load while the kernel before this one runs; x and
    # the split-K workspace only after it has finished
    pdl_wait(USE_PDL)
    for step in tl.range(first, last, num_stages=STAGES):
        blk = step * BPS + h // (8 // BPS)
        if PREFETCH:
            c0, c1, c2, c3, c4 = v0, v1, v2, v3, v4
            nxt = blk + BPS
            v0, v1, v2, v3, v4 = _load_step(w32_ptr, f16_ptr, row_w, nb, step + 1, nxt, h, w,
                                            row_ok & (nxt < nb) & (step + 1 < last), QTYPE,
                                            WHOLE)
        else:
            c0, c1, c2, c3, c4 = _load_step(w32_ptr, f16_ptr, row_w, nb, step, blk, h, w,
                                            row_ok & (blk < nb), QTYPE, WHOLE)
        acc = _step_dot(acc, c0, c1, c2, c3, c4, x_ptr, stride_xm, M, K, step, blk, h, w, one,
                        ROWS_X, QTYPE, BLOCK_M, ASM)
    pdl_trigger(USE_PDL)  # the next kernel's programs may take the SMs this one leaves
    total = tl.sum(acc, axis=0)  # [BN, BLOCK_M]
    m_idx = tl.arange(0, BLOCK_M)[None, :]
    at = m_idx * N + rows[:, None]
    y_mask = (rows < N)[:, None] & (m_idx < M)
    split_k_store(total, y_ptr, partial_ptr, at, y_mask, SPLIT)
    if SPLIT:  # the last split of this row block writes y (split_k.py)
        split_k_finish(y_ptr, partial_ptr, count_ptr, pid_n, split_k, at, y_mask)


def gemv_supported(type_id: int, K: int) -> bool:
    """Whether gguf_gemv takes this type and row length (its rows must be whole 32-bit words)."""
    return type_id in BLOCKS_PER_STEP and row_bytes(type_id, K) % 4 == 0


def gguf_gemv(x: torch.Tensor, qweight: torch.Tensor, type_id: int, block_n: int | None = None,
              num_warps: int = 2, num_stages: int = 1, split_k: int | None = None,
              prefetch: bool = False, asm: bool = False) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T, 1 <= M <= GEMV_MAX_M, qweight in the device layout.

    block_n rows per program (default: 4 rows a thread with num_warps warps); num_stages 1
    loads with plain vector loads (more stages pipeline them through shared memory); prefetch:
    the next K step's loads are issued before this step's arithmetic; asm: Q6_K turns bytes
    into floats with PTX byte permutes (on CUDA tensors; the interpreter runs the portable
    shifts)."""
    M, K = x.shape
    N = qweight.shape[0]
    if M > GEMV_MAX_M or not gemv_supported(type_id, K):
        raise ValueError(f"gguf_gemv takes 1..{GEMV_MAX_M} rows of x and whole-word rows of "
                         f"{sorted(BLOCKS_PER_STEP)}; got M={M}, type {type_id}, K={K}")
    check_qweight(qweight, type_id, K, "gguf_gemv")
    x, qweight = x.contiguous(), qweight.contiguous()
    if block_n is None:  # lanes cover 32 / (4 or 8 chunks) rows a warp; 4 rows a thread (2
        # for M > 1, whose x rows and sums need the registers)
        block_n = (4 if M == 1 else 2) * num_warps * (8 if type_id in (12, 13, 14) else 4)
    n_blocks = cdiv(N, block_n)
    steps = cdiv(K // ggml_type(type_id).block_elems, BLOCKS_PER_STEP[type_id])
    if split_k is None:  # ~4 programs per SM (under the interpreter: few programs, fast tests)
        target = 4 * num_sms(x.device.index or 0) if x.is_cuda else 2
        split_k = max(1, min(steps, target // n_blocks))
    split_k = cdiv(steps, cdiv(steps, split_k))  # drop splits that would get no step
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    partial, count = split_k_workspace(x.device, M * N, n_blocks)
    align = 4 if qweight.shape[1] % 16 == 0 else 1
    pdl = pdl_enabled(x)
    _gguf_gemv_kernel[(n_blocks, split_k)](
        x, qweight.view(torch.int32), qweight.view(torch.float16), y,
        partial, count, M, N, K, x.stride(0), qweight.shape[1] // 4 // align, _ONE, split_k,
        QTYPE=type_id, BLOCK_N=block_n, BLOCK_M=next_power_of_2(M), SPLIT=split_k > 1,
        STAGES=num_stages, ROW_ALIGN=align, WHOLE=K // ggml_type(type_id).block_elems % 4 == 0,
        PREFETCH=prefetch, ASM=asm and type_id == 14 and x.is_cuda, USE_PDL=pdl,
        num_warps=num_warps, **launch_kwargs(pdl),
    )
    return y
