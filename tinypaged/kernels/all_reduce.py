"""All-reduce over peer-mapped buffers: one-shot and two-shot, one kernel each.

With tensor parallelism each rank r holds a partial result x_r [n] of a row-parallel layer and
needs the sum over the W ranks. NCCL sends it through its own protocol; for the small messages
of a decode step its fixed cost (protocol and launch, not bytes) dominates. When every rank can
load and store the others' GPU memory (P2P over NVLink), the sum is one kernel over buffers
every rank maps (distributed/custom_all_reduce.py allocates them):

    one-shot                                     two-shot (reduce-scatter + all-gather)
    1. copy x_r -> my input                      1. copy x_r -> my input
    2. barrier                                   2. barrier
    3. out = sum_s input_s                       3. my slice: result_r = sum_s input_s[slice r]
                                                 4. barrier
                                                 5. out[slice s] = result_s, for every s

One-shot reads (W - 1) n elements from the peers, two-shot 2 (W - 1) n / W with one more
barrier: the same bytes at W = 2, half of them at W = 8 (large messages go two-shot there).
Sums run in rank order in fp32 and are rounded once, so every rank gets the same bits.

Barriers are per program: program b of rank r waits only for program b of the other ranks,
which handled the same elements. Each rank's buffer is laid out as

    int32 flags [num_programs, W]:  flags[b, s] = the last barrier rank s's program b reached
                                    (written by rank s, read by this rank)
    data [2, 2, max_elems]:         [call parity][input, result]: a call uses its parity's half

Why two halves: a rank may start its next call while a slower peer still reads this call's data.
It writes the other half, and the half it wrote one call earlier is free again: it passed a
barrier of the call before, so every peer had started that call, so finished the one before it
(kernels on a stream run in order). Every program runs on every call (the grid is always
`num_programs`), so all of a rank's per-program call counters agree and pick the same half.
Barrier k of call e (k = 1, 2) waits for the value 2e - 2 + k, so one-shot and two-shot calls mix.

Memory ordering: the signal is an atomic exchange with release semantics at system scope (the
data written before it is visible to the peers first), the wait an atomic read with acquire
semantics; a CTA-wide barrier puts every thread's stores before the signal and every thread's
loads after the wait. A peer that never arrives (a dead process) would keep the waiting programs
spinning, so every ABORT_EVERY polls they also read an abort flag in host memory, which the
engine sets when it gives up on the group (a call then ends after ABORT_EVERY polls, its output
garbage). Counters and flags wrap after 2^31 calls: the wait compares a wrapping difference.

`ptrs`, int64 [W + 1]: every rank's buffer address as seen from this rank, then the abort
flag's. `counters`: int32 [num_programs], this rank's own memory, zero at start, as the flags.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tinypaged.kernels._triton import jit, next_power_of_2, tl


@jit
def _barrier(PTRS, pid, rank, target, WORLD_SIZE: tl.constexpr, WORLD_POW2: tl.constexpr,
             ABORT_EVERY: tl.constexpr):
    """Tell program `pid` of every rank that this one reached `target`; wait until all did."""
    tl.debug_barrier()  # every thread's stores come before the signal
    ranks = tl.arange(0, WORLD_POW2)
    in_group = ranks < WORLD_SIZE
    flags = tl.load(PTRS + ranks, mask=in_group, other=0).to(tl.pointer_type(tl.int32))
    slot = pid * WORLD_SIZE
    tl.atomic_xchg(flags + slot + rank, tl.zeros_like(ranks) + target, mask=in_group,
                   sem="release", scope="sys")
    mine = tl.load(PTRS + rank).to(tl.pointer_type(tl.int32)) + slot + ranks
    abort = tl.load(PTRS + WORLD_SIZE).to(tl.pointer_type(tl.int32))
    seen = tl.atomic_add(mine, tl.zeros_like(ranks), mask=in_group, sem="acquire", scope="sys")
    polls = 0
    aborted = 0
    while (tl.min(tl.where(in_group, seen - target, 0)) < 0) & (aborted == 0):
        seen = tl.atomic_add(mine, tl.zeros_like(ranks), mask=in_group, sem="acquire",
                             scope="sys")
        polls += 1
        if polls % ABORT_EVERY == 0:
            aborted = tl.load(abort, volatile=True)
    tl.debug_barrier()  # every thread's loads come after the wait


@jit
def _buffer(PTRS, s, offset, dtype: tl.constexpr):
    """Rank s's buffer as a `dtype` pointer, `offset` elements in (16-byte aligned)."""
    return tl.multiple_of(tl.load(PTRS + s).to(tl.pointer_type(dtype)) + offset, 16)


@jit
def _one_shot_all_reduce_kernel(
    X, OUT,  # [n] this rank's partial sums; the sum (OUT may be X)
    PTRS, COUNTERS, n, rank,
    data_offset,  # elements from a buffer's start to its data
    max_elems,  # elements per data area
    WORLD_SIZE: tl.constexpr, WORLD_POW2: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    BLOCK: tl.constexpr, ABORT_EVERY: tl.constexpr,
):
    pid = tl.program_id(0)
    epoch = tl.load(COUNTERS + pid) + 1
    tl.store(COUNTERS + pid, epoch)
    if pid * BLOCK < n:  # programs past the end only count the call
        dtype = OUT.dtype.element_ty
        inputs = data_offset + (epoch % 2) * 2 * max_elems
        mine = _buffer(PTRS, rank, inputs, dtype)
        for start in range(pid * BLOCK, n, NUM_PROGRAMS * BLOCK):  # 1. copy
            offs = start + tl.arange(0, BLOCK)
            tl.store(mine + offs, tl.load(X + offs, mask=offs < n), mask=offs < n)
        _barrier(PTRS, pid, rank, 2 * epoch - 1, WORLD_SIZE, WORLD_POW2, ABORT_EVERY)
        for start in range(pid * BLOCK, n, NUM_PROGRAMS * BLOCK):  # 3. sum
            offs = start + tl.arange(0, BLOCK)
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for s in tl.static_range(WORLD_SIZE):
                theirs = _buffer(PTRS, s, inputs, dtype)
                acc += tl.load(theirs + offs, mask=offs < n, other=0.0).to(tl.float32)
            tl.store(OUT + offs, acc.to(dtype), mask=offs < n)


@jit
def _two_shot_all_reduce_kernel(
    X, OUT, PTRS, COUNTERS, n, rank, data_offset, max_elems,  # as the one-shot kernel's
    WORLD_SIZE: tl.constexpr, WORLD_POW2: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    SLICE: tl.constexpr,  # a region is WORLD_SIZE slices; rank s reduces slice s of each
    ABORT_EVERY: tl.constexpr,
):
    REGION: tl.constexpr = SLICE * WORLD_SIZE
    pid = tl.program_id(0)
    epoch = tl.load(COUNTERS + pid) + 1
    tl.store(COUNTERS + pid, epoch)
    if pid * REGION < n:
        dtype = OUT.dtype.element_ty
        inputs = data_offset + (epoch % 2) * 2 * max_elems
        results = inputs + max_elems  # a reduced slice sits where it sits in the input
        mine = _buffer(PTRS, rank, inputs, dtype)
        for start in range(pid * REGION, n, NUM_PROGRAMS * REGION):  # 1. copy
            for j in tl.static_range(WORLD_SIZE):
                offs = start + j * SLICE + tl.arange(0, SLICE)
                tl.store(mine + offs, tl.load(X + offs, mask=offs < n), mask=offs < n)
        _barrier(PTRS, pid, rank, 2 * epoch - 1, WORLD_SIZE, WORLD_POW2, ABORT_EVERY)
        my_results = _buffer(PTRS, rank, results, dtype)
        for start in range(pid * REGION, n, NUM_PROGRAMS * REGION):  # 3. reduce my slice
            offs = start + rank * SLICE + tl.arange(0, SLICE)
            acc = tl.zeros([SLICE], dtype=tl.float32)
            for s in tl.static_range(WORLD_SIZE):
                theirs = _buffer(PTRS, s, inputs, dtype)
                acc += tl.load(theirs + offs, mask=offs < n, other=0.0).to(tl.float32)
            tl.store(my_results + offs, acc.to(dtype), mask=offs < n)
        _barrier(PTRS, pid, rank, 2 * epoch, WORLD_SIZE, WORLD_POW2, ABORT_EVERY)
        for start in range(pid * REGION, n, NUM_PROGRAMS * REGION):  # 5. gather the slices
            for s in tl.static_range(WORLD_SIZE):
                offs = start + s * SLICE + tl.arange(0, SLICE)
                theirs = _buffer(PTRS, s, results, dtype)
                tl.store(OUT + offs, tl.load(theirs + offs, mask=offs < n), mask=offs < n)


def custom_all_reduce(
    x: torch.Tensor, out: torch.Tensor, ptrs: torch.Tensor, counters: torch.Tensor, rank: int,
    data_offset: int, max_elems: int, two_shot: bool = False, block: int = 1024,
    num_warps: int = 4, abort_every: int = 1024,
) -> torch.Tensor:
    """out = the sum over ranks of every rank's contiguous `x` (the same shape, dtype and call
    sequence on every rank; out may be x); `two_shot` picks the kernel. Every rank passes the
    same `block` (elements per program and step; two-shot splits it into W slices) and a
    `counters` of the same length (the grid). `ptrs`, `data_offset` (elements to the data),
    `max_elems` (elements per data area) describe the buffers as in the module docstring;
    `abort_every`: polls of the flags between two reads of the abort flag. Returns out."""
    world_size = ptrs.numel() - 1
    world_pow2 = next_power_of_2(world_size)
    num_programs = counters.numel()
    common = dict(WORLD_SIZE=world_size, WORLD_POW2=world_pow2, NUM_PROGRAMS=num_programs,
                  ABORT_EVERY=abort_every, num_warps=num_warps)
    args = (x, out, ptrs, counters, x.numel(), rank, data_offset, max_elems)
    if two_shot:
        _two_shot_all_reduce_kernel[(num_programs,)](*args, SLICE=block // world_pow2, **common)
    else:
        _one_shot_all_reduce_kernel[(num_programs,)](*args, BLOCK=block, **common)
    return out


def all_reduce_ref(partials: Sequence[torch.Tensor]) -> torch.Tensor:
    """The torch reference of what the ranks compute together: rank r passes partials[r] to
    the kernel, and every rank gets this sum (rank order, fp32, rounded once). Unlike the
    other references it takes every rank's input: a collective has no single-rank meaning."""
    acc = torch.zeros(partials[0].shape, dtype=torch.float32, device=partials[0].device)
    for p in partials:
        acc += p.float()
    return acc.to(partials[0].dtype)
