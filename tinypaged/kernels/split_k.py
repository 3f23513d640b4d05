"""Split-K in one launch: the protocol every decode GEMV and small-M GEMM here finishes with.

At decode batch sizes a layer has too few output columns to give every SM a column block of its
own, so the K dimension is split as well: a grid (column blocks, split_k) in which program
(n, s) sums K-steps [first, last) of split_k_range(steps, split_k) for column block n. The
split_k partial sums of a block then have to meet, and with no second launch, no memset and no
allocation (so that a CUDA graph can replay it):

1. A persistent fp32 workspace `partial` (at least as large as y) and an int32 counter per column
   block, zero between calls (split_k_workspace: one pair per device, shared by every layer,
   since the calls of a forward pass run one after another on one stream).
2. Each program adds its fp32 sums into `partial` with atomic adds (split_k_store), then takes a
   ticket: done = atomic_add(counter[n], 1). Only the program that draws done == split_k - 1 knows
   every other split's sums have landed.
3. That last program reads the sums (volatile: from L2, where the other programs' atomics went,
   not from a stale L1 line), writes y in y's dtype (plus the bias, if any), stores zeros into
   `partial` and 0 into its counter: the workspace is ready for the next call (split_k_finish).

Two barriers make it correct on sm_90, where the compiler is free to give a tensor's load, store
and atomics different thread mappings:
- before the ticket: every thread of the program has issued its atomic adds before the counter
  moves (the acq_rel ticket then orders them before the last program's read);
- between the read and the zeroing: the thread that zeroes an element may not be the one that
  read it, so every read must land before any thread zeroes (without this barrier the dense
  tensor-core GEMV lost part of its sums on an sm_90 GPU).
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import jit, num_sms, tl


@jit
def split_k_range(steps, split_k):
    """The K-steps [first, last) of this program's split (grid axis 1) when `steps` K-tiles are
    shared among `split_k` programs."""
    per_split = tl.cdiv(steps, split_k)
    first = tl.program_id(1) * per_split
    return first, tl.minimum(first + per_split, steps)


@jit
def split_k_store(acc, y_ptr, partial_ptr, at, mask, SPLIT: tl.constexpr):
    """y[at] = acc in y's dtype, or, when K is split, acc's fp32 sums added into partial[at]."""
    if not SPLIT:
        tl.store(y_ptr + at, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(partial_ptr + at, acc, mask=mask, sem="relaxed")


@jit
def split_k_finish(y_ptr, partial_ptr, count_ptr, block, split_k, at, mask,
                   bias_ptrs=None, bias_mask=None, HAS_BIAS: tl.constexpr = False):
    """Steps 2 and 3 of the protocol, once this program's sums are in partial[at]: the last of the
    split_k programs of column block `block` writes y[at] (+ bias) and re-zeroes the workspace.
    `at` and `mask` cover the whole block (every split's elements); bias_ptrs / bias_mask
    broadcast against them."""
    tl.debug_barrier()  # every thread's atomics are issued before the counter moves
    done = tl.atomic_add(count_ptr + block, 1, sem="acq_rel")
    if done == split_k - 1:
        total = tl.load(partial_ptr + at, mask=mask, volatile=True)
        tl.debug_barrier()  # every read lands before any thread zeroes
        if HAS_BIAS:
            total += tl.load(bias_ptrs, mask=bias_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + at, total.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(partial_ptr + at, tl.zeros_like(total), mask=mask)
        tl.store(count_ptr + block, 0)


def programs_target(device: torch.device) -> int:
    """~4 programs per SM keep every SM busy (the launchers take a fraction of it); under the
    interpreter few programs keep tests fast."""
    return 4 * num_sms(device.index or 0) if device.type == "cuda" else 4


SPLIT_K_WORKSPACE: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
# workspaces outgrown by a larger one, kept: graphs captured before (a target's, when a draft
# model with wider layers warms up after them) still read and re-zero them
_OUTGROWN: list[tuple[torch.Tensor, torch.Tensor]] = []


def split_k_workspace(device: torch.device, numel: int, blocks: int):
    """The split-K sums (fp32, `numel` = M * N needed) and arrival counters (`blocks` column
    blocks) of `device`, zero between calls (the kernels re-zero them).

    Sized generously on first use (1 Mi sums: 16 rows of 65536 columns, 4 MiB; 4096 counters),
    so that it is not reallocated while a CUDA graph is being captured."""
    ws = SPLIT_K_WORKSPACE.get(device)
    if ws is None or ws[0].numel() < numel or ws[1].numel() < blocks:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("split-K GEMV: the workspace must be allocated before CUDA graph "
                               "capture; run one eager forward pass first")
        if ws is not None:
            _OUTGROWN.append(ws)
        ws = (torch.zeros(max(numel, 1 << 20), dtype=torch.float32, device=device),
              torch.zeros(max(blocks, 4096), dtype=torch.int32, device=device))
        SPLIT_K_WORKSPACE[device] = ws
    return ws
