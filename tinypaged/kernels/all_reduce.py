"""One-shot all-reduce over peer-mapped buffers: every rank reads every rank's partial sums.

With tensor parallelism each rank holds a partial result x_r [n] of a row-parallel layer and
needs the sum over the W ranks. NCCL sends it through its own protocol; for the small messages
of a decode step its fixed cost dominates (~7 us at batch 1 on 2 x H200). When every rank can
load and store the others' GPU memory (P2P over NVLink), the sum is one kernel:

    1. copy   x_r -> my buffer            (a buffer every rank can read; custom_all_reduce.py)
    2. signal "my copy is there" to every rank, wait until every rank said so
    3. sum    out = sum_{s = 0..W-1} buffer_s      in rank order, in fp32

Summing in the same order everywhere gives every rank the same bits. The barrier of step 2 is
per program: program b of rank r only waits for program b of the other ranks, which copied the
same elements. Each rank's buffer is laid out as

    int32 flags [num_programs, W]: flags[b, s] = the last call at which rank s's program b said
                                   its copy was there (written by rank s, read by this rank)
    data [2, max_elems]:           two halves; a program's k-th call uses half k % 2

Why two halves: a rank may start its next call while a slower peer still reads this call's data.
It writes the other half, and the half it wrote one call earlier is free again: that the
peers have signalled for the current call means they have finished the call before it (kernels
on a stream run in order). So one barrier per call suffices, and each element is always
handled by the same program (regions of BLOCK elements go to programs round-robin, and the
grid is always `num_programs`), so the program's own call counter picks the half.

Memory ordering: the signal is an atomic exchange with release semantics at system scope (the
copy is visible to the peers before the flag), the wait an atomic read with acquire semantics
(the peers' copies are visible after it); a CTA-wide barrier puts every thread's copy before
the signal and every thread's reads after the wait. A peer that never arrives (a dead process)
would keep the waiting programs spinning, so every 1024 polls they also read an abort flag in
host memory, which the engine sets when it gives up on the group (with the flag set a call
ends after ABORT_EVERY polls, its output garbage).

Everything the kernel needs reaches it through `ptrs`, int64 [W + 1]: the addresses (as seen
from this rank) of every rank's buffer, then the address of the abort flag. The counters are
this rank's own memory, int32 [num_programs], zero at start; the flags start at zero too.
Counters and flags wrap around after 2^31 calls: the wait compares with a wrapping difference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tinypaged.kernels._triton import jit, next_power_of_2, tl


@jit
def _one_shot_all_reduce_kernel(
    X, OUT,  # [n] this rank's partial sums; the sum (OUT may be X)
    PTRS,  # int64 [WORLD_SIZE + 1]: every rank's buffer address, then the abort flag's
    COUNTERS,  # int32 [NUM_PROGRAMS]: calls so far, per program (this rank's memory)
    n, rank,
    data_offset,  # elements from a buffer's start to its data half 0
    half_elems,  # elements per data half
    WORLD_SIZE: tl.constexpr,
    WORLD_POW2: tl.constexpr,  # next power of two >= WORLD_SIZE (tl.arange needs one)
    NUM_PROGRAMS: tl.constexpr,
    BLOCK: tl.constexpr,
    ABORT_EVERY: tl.constexpr,  # polls between two reads of the abort flag (host memory: slow)
):
    pid = tl.program_id(0)
    epoch = tl.load(COUNTERS + pid) + 1
    tl.store(COUNTERS + pid, epoch)
    if pid * BLOCK < n:  # programs past the end only count the call
        dtype = OUT.dtype.element_ty
        data = data_offset + (epoch % 2) * half_elems
        mine = tl.multiple_of(tl.load(PTRS + rank).to(tl.pointer_type(dtype)) + data, 16)
        for start in range(pid * BLOCK, n, NUM_PROGRAMS * BLOCK):  # 1. copy
            offs = start + tl.arange(0, BLOCK)
            tl.store(mine + offs, tl.load(X + offs, mask=offs < n), mask=offs < n)

        tl.debug_barrier()  # 2. signal: every thread's copy is done
        ranks = tl.arange(0, WORLD_POW2)
        in_group = ranks < WORLD_SIZE
        flags = tl.load(PTRS + ranks, mask=in_group, other=0).to(tl.pointer_type(tl.int32))
        slot = pid * WORLD_SIZE
        tl.atomic_xchg(flags + slot + rank, tl.zeros_like(ranks) + epoch, mask=in_group,
                       sem="release", scope="sys")
        my_flags = tl.load(PTRS + rank).to(tl.pointer_type(tl.int32)) + slot + ranks
        abort = tl.load(PTRS + WORLD_SIZE).to(tl.pointer_type(tl.int32))
        seen = tl.atomic_add(my_flags, tl.zeros_like(ranks), mask=in_group, sem="acquire",
                             scope="sys")
        polls = 0
        aborted = 0
        while (tl.min(tl.where(in_group, seen - epoch, 0)) < 0) & (aborted == 0):
            seen = tl.atomic_add(my_flags, tl.zeros_like(ranks), mask=in_group, sem="acquire",
                                 scope="sys")
            polls += 1
            if polls % ABORT_EVERY == 0:
                aborted = tl.load(abort, volatile=True)
        tl.debug_barrier()  # every thread reads after the wait

        for start in range(pid * BLOCK, n, NUM_PROGRAMS * BLOCK):  # 3. sum
            offs = start + tl.arange(0, BLOCK)
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for s in tl.static_range(WORLD_SIZE):
                theirs = tl.multiple_of(tl.load(PTRS + s).to(tl.pointer_type(dtype)) + data, 16)
                acc += tl.load(theirs + offs, mask=offs < n, other=0.0).to(tl.float32)
            tl.store(OUT + offs, acc.to(dtype), mask=offs < n)


def one_shot_all_reduce(
    x: torch.Tensor, out: torch.Tensor, ptrs: torch.Tensor, counters: torch.Tensor, rank: int,
    data_offset: int, half_elems: int, block: int = 1024, num_warps: int = 4,
    abort_every: int = 1024,
) -> torch.Tensor:
    """out = the sum over ranks of every rank's contiguous `x` (the same shape and dtype on
    every rank; out may be x). Every rank calls this with the same `block` and a `counters` of
    the same length (the grid); `ptrs`, `data_offset`, `half_elems` describe the buffers as in
    the module docstring; `abort_every` polls of the flags between two reads of the abort flag.
    Returns out."""
    world_size = ptrs.numel() - 1
    num_programs = counters.numel()
    _one_shot_all_reduce_kernel[(num_programs,)](
        x, out, ptrs, counters, x.numel(), rank, data_offset, half_elems,
        WORLD_SIZE=world_size, WORLD_POW2=next_power_of_2(world_size),
        NUM_PROGRAMS=num_programs, BLOCK=block, ABORT_EVERY=abort_every, num_warps=num_warps,
    )
    return out


def all_reduce_ref(partials: Sequence[torch.Tensor]) -> torch.Tensor:
    """The torch reference of what the ranks compute together: rank r passes partials[r] to
    the kernel, and every rank gets this sum (rank order, fp32, rounded once). Unlike the
    other references it takes every rank's input: a collective has no single-rank meaning."""
    acc = torch.zeros(partials[0].shape, dtype=torch.float32, device=partials[0].device)
    for p in partials:
        acc += p.float()
    return acc.to(partials[0].dtype)
