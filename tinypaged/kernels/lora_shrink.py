"""LoRA shrink, Punica-style: each token's hidden row times the A matrix of its own adapter.

A batch mixes tokens of several adapters (and tokens of none). The adapters' A matrices sit in
`max_loras` GPU slots, stacked; a fused layer (qkv, gate-up) stacks its shards' A matrices along
the rank axis, so one launch makes every shard's low-rank activations:

    h[t, :] = x[t, :] @ lora_a[slot(t)]^T            x [T, K], lora_a [L, N, K], h [T, N] fp32
                                                      N = num_shards * max_lora_rank

written as SPLIT_K partial sums, out [SPLIT_K, T, N] with h = out.sum(0), which the expand adds
up as it loads them (lora_expand.py).

Tokens are grouped by slot (`lora_segments`): `sorted_token_ids` lists the batch's rows slot by
slot, and slot l owns entries seg_start[l] .. seg_start[l] + seg_len[l] - 1 (tokens of no adapter,
slot -1, are in no segment: their rows of `out` are left as they were). A row tile is BLOCK_M
rows of one slot's segment; slot l has ceil(seg_len[l] / BLOCK_M) tiles, so the batch has at most
ceil(T / BLOCK_M) + L of them, and that is the grid's first axis (times SPLIT_K): program i counts
the slots' tiles (`slot_tile`) to find which slot's tile it is, and returns at once when i is past
the last. So no program is launched per (tile, slot) pair that has no tokens, and the grid depends
only on T and L, never on how the tokens split: a CUDA graph replays it with new segments. A
program gathers its BLOCK_M rows from x and multiplies them by the slot's A tile with tl.dot, so
each A tile is read once per BLOCK_M tokens of its adapter, never once per token.

The K loop (K = 4096 or 14336) is split over SPLIT_K programs whenever the row tiles alone are too
few to fill the GPU (`shrink_splits`: decode and mid-size batches), each storing its partial sum
in its own plane of `out`: no atomics, and no zeroing launch before the shrink. The tile sizes
and the split targets of both kernels, by batch size, are one table (`LORA_TILES`).
"""

from __future__ import annotations

import torch

from tinypaged import envs
from tinypaged.kernels._triton import cdiv, dot_precision, jit, next_power_of_2, tl, use_triton
from tinypaged.kernels.pdl import pdl_device


def lora_segments(token_slots: torch.Tensor, num_slots: int):
    """(sorted_token_ids [T] int32, seg_start [L] int32, seg_len [L] int32) of token_slots [T]
    (slot per token, -1 = no adapter). Tokens of no adapter sort last, outside every segment."""
    key = torch.where(token_slots < 0, num_slots, token_slots).long()
    sorted_ids = torch.sort(key, stable=True).indices.to(torch.int32)
    seg_len = torch.bincount(key, minlength=num_slots + 1)[:num_slots]
    seg_start = torch.cumsum(seg_len, 0) - seg_len
    return sorted_ids, seg_start.to(torch.int32), seg_len.to(torch.int32)


# The tiles of both kernels by batch size, one row per band of T (most rows in the band first),
# chosen by sweeping them on an H200 (benchmarks/lora_tune.py prints rows to paste here). Both are
# memory-bound thin products (docs/kernels/lora.md); what the choices trade is how many programs
# pull the weights against how long each one's chain of dependent loads is:
# - T <= 64 (decode): latency-bound. A shrink program takes one or two BLOCK_K = 256 stretches of
#   K (split-K = K / 256 up to the band's program count: 16 planes at K = 4096), so the weights
#   stream in a single round of loads; fewer splits make longer chains, more make the expand's
#   one load of all the planes ([planes, BLOCK_M, R]) larger and slower. One expand program per
#   256 columns: its B tile, y tile and planes are each one load.
# - mid T: row tiles start to fill the GPU; splits top the grid up to the program count.
# - large T (prefill): row tiles alone fill the GPU; BLOCK_M 64 reads each A or B tile once per
#   64 tokens of its adapter, and the K loop is barely split.
# The expand sums its rows' planes once into registers [BLOCK_M, R] and reuses them for TILES
# column tiles of one shard: that is what prefill needs (hundreds of column tiles per row tile,
# each of which would otherwise re-read every plane of its rows).
#  most rows, BLOCK_M, shrink BLOCK_N, BLOCK_K, programs (row tiles x splits), expand BLOCK_N, TILES
LORA_TILES = (
    (16, 16, 16, 256, 32, 256, 1),
    (64, 16, 64, 256, 128, 256, 1),
    (512, 32, 64, 128, 256, 256, 4),
    (1 << 62, 64, 64, 128, 256, 128, 8),
)


def lora_tiles(num_tokens: int) -> tuple[int, ...]:
    """The LORA_TILES row for a batch of num_tokens rows (the comment above gives the reasons)."""
    return next(row for row in LORA_TILES if num_tokens <= row[0])


# Programmatic dependent launch (Hopper and later): the shrink lets the expand that follows it
# start early, and the expand does its index work and loads its B tile (neither depends on the
# shrink) before it waits for the shrink's planes and the base output (`gdc_wait`). At decode,
# where each kernel is a few dependent loads long, that hides most of the expand's head. It is
# off unless TINYPAGED_LORA_PDL=1, and then only batches of up to LORA_PDL_MAX_TOKENS rows chain: on
# the H200 decode at batch 1 gained ~3.5% from it and batch 8 did not move, while the offline
# run lost a quarter of its throughput with it on, even at up to 16 rows only (benchmarks/
# RESULTS.md, Multi-LoRA). The bound is the one measured then, not the decode kernels' own
# (pdl.PDL_MAX_TOKENS, since raised).
LORA_PDL_MAX_TOKENS = 16


def use_pdl(x: torch.Tensor) -> bool:
    """Whether the LoRA kernels over x [num_tokens, ...] chain by programmatic dependent launch
    (PDL): on Hopper or later, for at most LORA_PDL_MAX_TOKENS rows."""
    return (x.is_cuda and x.shape[0] <= LORA_PDL_MAX_TOKENS and envs.TINYPAGED_LORA_PDL
            and pdl_device(x.device.index or 0))


def block_rows(num_tokens: int) -> int:
    """BLOCK_M of both LoRA kernels for a batch of num_tokens rows."""
    return lora_tiles(num_tokens)[1]


def shrink_splits(num_tokens: int, k: int) -> int:
    """How many programs share the K loop (the planes of the shrink's output): enough that
    row tiles x splits reach the band's program count (LORA_TILES), each keeping at least one
    BLOCK_K stretch of K, at most 64."""
    _, block_m, _, block_k, programs, _, _ = lora_tiles(num_tokens)
    tiles = cdiv(num_tokens, block_m)
    return max(1, min(64, cdiv(k, block_k), cdiv(programs, tiles)))


@jit
def slot_tile(SEG_START, SEG_LEN, num_slots, tile, BLOCK_M: tl.constexpr,
              MAX_SLOTS: tl.constexpr):
    """(slot, row tile within the slot's segment, the segment's start and length) of the batch's
    tile-th row tile, counting ceil(seg_len / BLOCK_M) tiles per slot in slot order; slot -1 past
    the last tile. Both segment arrays come in one vector load each ([MAX_SLOTS], a power of two
    >= num_slots), not slot by slot: this is the head of every program's chain of loads."""
    s = tl.arange(0, MAX_SLOTS)
    lens = tl.load(SEG_LEN + s, mask=s < num_slots, other=0)
    starts = tl.load(SEG_START + s, mask=s < num_slots, other=0)
    tiles = tl.cdiv(lens, BLOCK_M)
    ends = tl.cumsum(tiles, 0)  # [MAX_SLOTS] one past each slot's last tile
    slot = tl.sum((ends <= tile).to(tl.int32), 0)  # slots wholly before this tile
    hit = s == slot
    local = tile - tl.sum(tl.where(hit, ends - tiles, 0), 0)
    seg_start = tl.sum(tl.where(hit, starts, 0), 0)
    seg_len = tl.sum(tl.where(hit, lens, 0), 0)
    return tl.where(slot < num_slots, slot, -1), local, seg_start, seg_len


# split_k and the plane stride (T * N) change with the batch size: as constexprs or specialized
# integers they would compile a new kernel for many batch sizes, in the middle of serving
@jit(do_not_specialize=("K", "split_k", "stride_os"))
def _lora_shrink_kernel(
    X, A, SORTED, SEG_START, SEG_LEN, OUT,  # x [T, K]; lora_a [L, N, K]; out [split_k, T, N] fp32
    K, N, num_slots, stride_xm, stride_al, stride_an, stride_os, stride_om, split_k,
    MAX_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:  # the expand launched after this kernel may start its head now (PDL above)
        tl.extra.cuda.gdc_launch_dependents()
    pid_mk, pid_n = tl.program_id(0), tl.program_id(1)
    slot, pid_m, seg_start, seg_len = slot_tile(SEG_START, SEG_LEN, num_slots,
                                                pid_mk // split_k, BLOCK_M, MAX_SLOTS)
    pid_k = pid_mk % split_k
    if slot < 0:  # past the batch's last row tile
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < seg_len
    tok = tl.load(SORTED + seg_start + rows, mask=row_mask, other=0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    a_base = A + slot.to(tl.int64) * stride_al
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, split_k * BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        if EVEN_K:  # an all-true constant lets the x and A loads be vectorized along K
            k_mask = tl.full((BLOCK_K,), 1, tl.int1)
        x = tl.load(X + tok[:, None] * stride_xm + ks[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        a = tl.load(a_base + cols[None, :] * stride_an + ks[:, None],
                    mask=k_mask[:, None] & col_mask[None, :], other=0.0)  # [BK, BN]
        acc += tl.dot(x, a, input_precision=PRECISION)
    ptrs = OUT + pid_k * stride_os + tok[:, None] * stride_om + cols[None, :]
    tl.store(ptrs, acc, mask=row_mask[:, None] & col_mask[None, :])


def shrink_launch(num_tokens: int, k: int, n: int, num_slots: int, split_k: int
                  ) -> tuple[tuple[int, int], dict]:
    """(grid, the kernel's constexprs) for x [num_tokens, k] and lora_a [num_slots, n, k] over
    split_k planes. The constexprs depend on the LORA_TILES row and the layer only, never on
    num_tokens or split_k themselves: one compiled kernel per row and layer shape."""
    _, block_m, block_n, block_k, _, _, _ = lora_tiles(num_tokens)
    block_n = min(block_n, max(16, next_power_of_2(n)))
    block_k = block_k if k >= block_k else max(16, next_power_of_2(k))
    grid = ((cdiv(num_tokens, block_m) + num_slots) * split_k, cdiv(n, block_n))
    meta = dict(MAX_SLOTS=next_power_of_2(num_slots), BLOCK_M=block_m, BLOCK_N=block_n,
                BLOCK_K=block_k, EVEN_K=k % block_k == 0)
    return grid, meta


def lora_shrink_triton(x: torch.Tensor, lora_a: torch.Tensor, sorted_token_ids: torch.Tensor,
                       seg_start: torch.Tensor, seg_len: torch.Tensor,
                       out: torch.Tensor) -> torch.Tensor:
    """The Triton launcher; out.shape[0] programs share each K loop."""
    num_tokens, k = x.shape
    num_slots, n, _ = lora_a.shape
    if num_tokens == 0:
        return out
    split_k = out.shape[0]
    grid, meta = shrink_launch(num_tokens, k, n, num_slots, split_k)
    _lora_shrink_kernel[grid](
        x, lora_a, sorted_token_ids, seg_start, seg_len, out,
        k, n, num_slots, x.stride(0), lora_a.stride(0), lora_a.stride(1), out.stride(0),
        out.stride(1), split_k,
        **meta, PRECISION=dot_precision(x.dtype), USE_PDL=use_pdl(x), num_warps=4,
    )
    return out


def lora_shrink_ref(x: torch.Tensor, lora_a: torch.Tensor, sorted_token_ids: torch.Tensor,
                    seg_start: torch.Tensor, seg_len: torch.Tensor,
                    out: torch.Tensor) -> torch.Tensor:
    """The torch reference: one matmul per slot over its segment (fp32 products), the whole
    sum in plane 0 of out and zeros in the others."""
    for slot, (start, length) in enumerate(zip(seg_start.tolist(), seg_len.tolist())):
        if length:
            tok = sorted_token_ids[start : start + length].long()
            out[:, tok] = 0.0
            out[0, tok] = x[tok].float() @ lora_a[slot].float().T
    return out


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, sorted_token_ids: torch.Tensor,
                seg_start: torch.Tensor, seg_len: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out.sum(0)[t] = x[t] @ lora_a[slot(t)]^T for every token of an adapter (module
    docstring); x [T, K] (rows contiguous), lora_a [L, N, K], out [SPLIT_K, T, N] float32 with
    SPLIT_K = shrink_splits(T, K) (any count works); returns out."""
    impl = lora_shrink_triton if use_triton(x) else lora_shrink_ref
    return impl(x, lora_a, sorted_token_ids, seg_start, seg_len, out)
