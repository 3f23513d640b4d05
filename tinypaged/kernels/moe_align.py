"""Sorting the (token, expert) pairs by expert in blocks: the layout the grouped GEMM (moe.py)
walks.

The T * k pairs of topk_ids [T, k] are numbered i = t * k + j. Each expert's pairs are laid out
contiguously, in expert order, each expert's run padded up to a multiple of BLOCK_M with the
invalid id T * k; so every block of BLOCK_M rows belongs to one expert and the GEMM reads that
expert's weights once per block:

    sorted_token_ids   [max_padded] int32  pair ids, expert by expert, padding = T * k
    expert_ids         [max_padded / BLOCK_M] int32  the expert of each block
    num_tokens_post_padded  [1] int32  rows actually used (blocks past it are skipped)

`max_padded` = T * k + min(E, T * k) * (BLOCK_M - 1), in whole blocks, bounds the padded length
whatever the routing (at most min(E, T * k) experts are hit, each wasting < BLOCK_M rows), so
every shape depends on T only and the GEMM's grid needs no device-to-host copy. Within an
expert the pairs keep their order (a stable sort).

With counts c_e (pairs per expert), padded p_e = ceil(c_e / BLOCK_M) BLOCK_M, run ends
end_e = p_0 + ... + p_e and starts start_e = end_e - p_e:

    sorted_token_ids[start_e + r] = the r-th pair (by id) routed to e
    expert_ids[b] = #{e : end_e <= b BLOCK_M}           (clamped to E - 1 past the used rows)

`moe_align_block_size_ref` computes it with some twenty small torch ops (a stable sort,
cumsums, a scatter, a searchsorted). The kernel does it in one program, in chunks of
BLOCK_P pairs: a first pass counts the pairs per expert (one-hot sums), a second places each
pair at start_e + (pairs of e in earlier chunks) + (pairs of e before it in its chunk). One
launch instead of twenty matters at decode and for small prefills: inside a CUDA graph each
small kernel still costs a few microseconds of GPU time, outside one the host spends more than
that launching each. One program walks the pairs chunk after chunk, so its time grows with T k;
past `KERNEL_MAX_PAIRS` (T = 128 at k = 8, a little before the measured crossover) the torch
ops' parallel sort wins on the GPU and their host cost hides behind the large GEMMs that follow.
Figures: benchmarks/RESULTS.md and RESULTS-log.md (moe_align).

`moe_align_block_size_parallel` spreads the same work over one program per chunk of BLOCK_P
pairs, in two launches (the second needs every chunk's counts): the first stores each chunk's
pairs per expert, counts [chunks, BLOCK_E]; in the second every program sums the counts (all
chunks: the run ends; the chunks before its own: where its pairs of each expert start), places
its pairs as the one-program kernel's pass 2, and writes its share of the padding and expert_ids.
Pairs, expert padding (rows start_e + c_e .. end_e) and the tail past the used rows are disjoint
rows, so the programs never write the same row. Its time no longer grows with the chunks walked
one after another, so it takes every T up to `PARALLEL_MAX_PAIRS` (T = 2048 at k = 8; past it the
count rows each program sums grow with T, and the GEMMs are long enough that the torch ops' cost
no longer shows); $TINYPAGED_MOE_ALIGN_PARALLEL=0 keeps the dispatch above (for A/B benchmarks).
"""

from __future__ import annotations

import torch

from tinypaged import envs
from tinypaged.kernels._triton import cdiv, jit, next_power_of_2, tl, use_triton


@jit(do_not_specialize=("num_pairs", "max_padded"))  # both follow T
def _moe_align_kernel(
    TOPK_IDS, SORTED_TOKEN_IDS, EXPERT_IDS, NUM_TOKENS_POST_PADDED,
    num_pairs, num_experts, max_padded,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
):
    experts = tl.arange(0, BLOCK_E)
    lanes = tl.arange(0, BLOCK_P)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for start in range(0, num_pairs, BLOCK_P):  # pass 1: pairs per expert
        ids = tl.load(TOPK_IDS + start + lanes, mask=start + lanes < num_pairs, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)  # [BLOCK_E]; lanes past E end at the total
    tl.store(NUM_TOKENS_POST_PADDED, tl.sum(padded, 0))
    for row in range(0, max_padded, BLOCK_P * BLOCK_M):  # the expert of each block
        block_rows = row + lanes * BLOCK_M  # [BLOCK_P] first row of each block
        expert = tl.sum((ends[None, :] <= block_rows[:, None]).to(tl.int32), axis=1)
        tl.store(EXPERT_IDS + row // BLOCK_M + lanes, tl.minimum(expert, num_experts - 1),
                 mask=block_rows < max_padded)
    for row in range(0, max_padded, BLOCK_P):  # every row padding first
        tl.store(SORTED_TOKEN_IDS + row + lanes, tl.zeros((BLOCK_P,), dtype=tl.int32) + num_pairs,
                 mask=row + lanes < max_padded)
    tl.debug_barrier()  # the padding is written before the pairs overwrite their rows
    next_row = ends - padded  # [BLOCK_E] where each expert's next pair goes
    earlier = lanes[None, :] < lanes[:, None]  # [BLOCK_P, BLOCK_P] j before i
    for start in range(0, num_pairs, BLOCK_P):  # pass 2: place the pairs
        pair = start + lanes
        ids = tl.load(TOPK_IDS + pair, mask=pair < num_pairs, other=-1)
        one_hot = ids[:, None] == experts[None, :]  # [BLOCK_P, BLOCK_E]
        base = tl.sum(tl.where(one_hot, next_row[None, :], 0), axis=1)
        rank = tl.sum(((ids[:, None] == ids[None, :]) & earlier).to(tl.int32), axis=1)
        tl.store(SORTED_TOKEN_IDS + base + rank, pair.to(tl.int32), mask=pair < num_pairs)
        next_row += tl.sum(one_hot.to(tl.int32), axis=0)


@jit(do_not_specialize=("num_pairs",))
def _moe_align_count_kernel(TOPK_IDS, COUNTS, num_pairs, BLOCK_E: tl.constexpr,
                            BLOCK_P: tl.constexpr):
    # program c: COUNTS[c, e] = the pairs c * BLOCK_P ... (c + 1) * BLOCK_P - 1 routed to e
    c = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    pair = c * BLOCK_P + tl.arange(0, BLOCK_P)
    ids = tl.load(TOPK_IDS + pair, mask=pair < num_pairs, other=-1)
    tl.store(COUNTS + c * BLOCK_E + experts,
             tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0))


@jit(do_not_specialize=("num_pairs", "max_padded"))
def _moe_align_place_kernel(
    TOPK_IDS, COUNTS, SORTED_TOKEN_IDS, EXPERT_IDS, NUM_TOKENS_POST_PADDED,
    num_pairs, num_experts, max_padded,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr,
):
    c = tl.program_id(0)
    chunks = tl.num_programs(0)
    experts = tl.arange(0, BLOCK_E)
    lanes = tl.arange(0, BLOCK_P)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)  # pairs per expert, all chunks
    before = tl.zeros((BLOCK_E,), dtype=tl.int32)  # ... in the chunks before this one
    for first in range(0, chunks, BLOCK_R):  # BLOCK_R count rows a step, loads in flight
        r = first + tl.arange(0, BLOCK_R)
        rows = tl.load(COUNTS + r[:, None] * BLOCK_E + experts[None, :],
                       mask=(r < chunks)[:, None], other=0)  # [BLOCK_R, BLOCK_E]
        counts += tl.sum(rows, axis=0)
        before += tl.sum(tl.where((r < c)[:, None], rows, 0), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)  # [BLOCK_E]; lanes past E end at the total
    starts = ends - padded
    used = tl.sum(padded, 0)
    if c == 0:
        tl.store(NUM_TOKENS_POST_PADDED, used)
    # this chunk's pairs: each at its expert's start + earlier chunks' pairs + its rank here
    pair = c * BLOCK_P + lanes
    ids = tl.load(TOPK_IDS + pair, mask=pair < num_pairs, other=-1)
    one_hot = ids[:, None] == experts[None, :]  # [BLOCK_P, BLOCK_E]
    base = tl.sum(tl.where(one_hot, (starts + before)[None, :], 0), axis=1)
    earlier = lanes[None, :] < lanes[:, None]  # [BLOCK_P, BLOCK_P] j before i
    rank = tl.sum(((ids[:, None] == ids[None, :]) & earlier).to(tl.int32), axis=1)
    tl.store(SORTED_TOKEN_IDS + base + rank, pair.to(tl.int32), mask=pair < num_pairs)
    # the padding of experts c, c + chunks, ...: rows start_e + c_e ... end_e - 1
    pad_rows = (starts + counts)[:, None] + tl.arange(0, BLOCK_M)[None, :]  # [BLOCK_E, BLOCK_M]
    mine = (experts % chunks == c)[:, None] & (pad_rows < ends[:, None])
    tl.store(SORTED_TOKEN_IDS + pad_rows, tl.zeros((BLOCK_E, BLOCK_M), dtype=tl.int32) + num_pairs,
             mask=mine)
    # rows past the used ones, and the expert of each block, shared out BLOCK_P at a time
    for row in range(used + c * BLOCK_P, max_padded, chunks * BLOCK_P):
        tl.store(SORTED_TOKEN_IDS + row + lanes, tl.zeros((BLOCK_P,), dtype=tl.int32) + num_pairs,
                 mask=row + lanes < max_padded)
    for first in range(c * BLOCK_P, max_padded // BLOCK_M, chunks * BLOCK_P):
        blocks = first + lanes
        expert = tl.sum((ends[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(EXPERT_IDS + blocks, tl.minimum(expert, num_experts - 1),
                 mask=blocks * BLOCK_M < max_padded)


KERNEL_MAX_PAIRS = 1024
PARALLEL_MAX_PAIRS = 16384


def max_padded_tokens(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of num_tokens_post_padded for num_pairs = T * k (see module docstring),
    rounded up to whole blocks."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-bound // block_m) * block_m


def _launch_outputs(topk_ids: torch.Tensor, block_m: int, num_experts: int):
    """What both Triton launchers start from: (the pairs' expert ids flat and contiguous [N],
    N, max_padded, sorted_token_ids [max_padded], expert_ids [max_padded / block_m],
    num_tokens_post_padded [1]), the outputs uninitialized (the kernels write every row)."""
    flat = topk_ids.flatten()
    flat = flat if flat.is_contiguous() else flat.contiguous()
    num_pairs, device = flat.numel(), flat.device
    max_padded = max_padded_tokens(num_pairs, num_experts, block_m)
    return (flat, num_pairs, max_padded,
            torch.empty(max_padded, dtype=torch.int32, device=device),
            torch.empty(max_padded // block_m, dtype=torch.int32, device=device),
            torch.empty(1, dtype=torch.int32, device=device))


def moe_align_block_size_triton(topk_ids: torch.Tensor, block_m: int, num_experts: int):
    """The Triton launcher; arguments as `moe_align_block_size`."""
    flat, num_pairs, max_padded, sorted_token_ids, expert_ids, num_tokens_post_padded = \
        _launch_outputs(topk_ids, block_m, num_experts)
    block_e = next_power_of_2(num_experts)
    _moe_align_kernel[(1,)](
        flat, sorted_token_ids, expert_ids,
        num_tokens_post_padded, num_pairs, num_experts, max_padded,
        BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_P=max(16, min(128, 16384 // block_e)),
        num_warps=8,
    )
    return sorted_token_ids, expert_ids, num_tokens_post_padded


def moe_align_block_size_parallel(topk_ids: torch.Tensor, block_m: int, num_experts: int):
    """The two-launch Triton launcher (one program per chunk of pairs); arguments as
    `moe_align_block_size`."""
    flat, num_pairs, max_padded, sorted_token_ids, expert_ids, num_tokens_post_padded = \
        _launch_outputs(topk_ids, block_m, num_experts)
    block_e = next_power_of_2(num_experts)
    block_p = max(16, min(128, 16384 // block_e))
    chunks = max(1, cdiv(num_pairs, block_p))
    counts = torch.empty(chunks, block_e, dtype=torch.int32, device=flat.device)  # [chunks, E]
    _moe_align_count_kernel[(chunks,)](flat, counts, num_pairs, BLOCK_E=block_e, BLOCK_P=block_p,
                                       num_warps=4)
    _moe_align_place_kernel[(chunks,)](
        flat, counts, sorted_token_ids, expert_ids, num_tokens_post_padded, num_pairs,
        num_experts, max_padded, BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_P=block_p,
        BLOCK_R=max(1, min(16, 2048 // block_e)), num_warps=8)
    return sorted_token_ids, expert_ids, num_tokens_post_padded


def moe_align_block_size_ref(topk_ids: torch.Tensor, block_m: int, num_experts: int):
    """The torch reference."""
    flat = topk_ids.flatten().long()  # [N], N = T * k
    num_pairs, device = flat.numel(), flat.device
    max_padded = max_padded_tokens(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.index_add_(0, flat, torch.ones_like(flat))  # [E]; bincount would sync the host
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)  # [E] end row of each expert's run
    starts = ends - padded
    order = torch.sort(flat, stable=True)[1]  # pair ids grouped by expert
    experts_in_order = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts  # [E] index in `order` of its first pair
    rank = torch.arange(num_pairs, device=device) - first_of_expert[experts_in_order]
    sorted_token_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_token_ids[starts[experts_in_order] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    expert_ids = torch.searchsorted(ends, block_starts, right=True)  # E past the used rows
    expert_ids = expert_ids.clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_token_ids, expert_ids, ends[-1:].to(torch.int32)


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int):
    """topk_ids [T, k] -> (sorted_token_ids, expert_ids, num_tokens_post_padded), the layout of
    the module docstring."""
    if use_triton(topk_ids):
        if topk_ids.numel() <= PARALLEL_MAX_PAIRS and envs.TINYPAGED_MOE_ALIGN_PARALLEL:
            return moe_align_block_size_parallel(topk_ids, block_m, num_experts)
        if topk_ids.numel() <= KERNEL_MAX_PAIRS:
            return moe_align_block_size_triton(topk_ids, block_m, num_experts)
    return moe_align_block_size_ref(topk_ids, block_m, num_experts)
