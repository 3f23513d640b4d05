"""LoRA expand, Punica-style: each token's low-rank activations times the B matrix of its own
adapter, added into the base layer's output.

    y[t, o0 + j] += h[t, s*R : (s+1)*R] @ lora_b[slot(t), o0 + j, :]    for j < size_s

y [T, O] is the base output of this rank (a fused layer's shards side by side), h [T, S*R] the
shrink's float32 output (lora_shrink.py; given as its SPLIT_K partial sums [SPLIT_K, T, S*R],
added up here as they are loaded), lora_b [L, O, R] the slots' B matrices with each
adapter's scaling (lora_alpha / r, or / sqrt(r) for rsLoRA) already folded in, and shard s owns
output columns o0 = offsets[s] .. offsets[s+1] - 1 and activations s*R .. (s+1)*R - 1.
Ranks below R are zero-padded, so every adapter runs the same tile shapes.

Tokens are grouped by slot as for the shrink (`sorted_token_ids`, `seg_start`, `seg_len`); a token
of no adapter is in no segment and its row of y is left untouched. One launch for all (up to 3)
shards: the grid is (row tiles, column groups of shard 0 + of shard 1 + ...); a row tile is
BLOCK_M rows of one slot's segment, found as in the shrink (`slot_tile`), and a column group is
up to TILES column tiles of BLOCK_N of one shard (no group straddles two shards, so a program
finds its shard from its group index). A program first adds up the shrink's SPLIT_K partial sums
of its rows (PLANES planes per load, all at once when they fit in registers) into h [BLOCK_M, R],
once, then for each of its column tiles makes the [BLOCK_M, BLOCK_N] delta with one tl.dot over
the whole rank (R <= 256) and adds it into y in place. Reading the planes once per group rather
than once per column tile is what keeps the expand near copy speed: a prefill gate-up has 448
column tiles of 64, each of which would re-read up to 16 planes of its rows. The activations are
cast to B's dtype before the product, as the reference does. The tile choices by batch size are
one table with the shrink's (`LORA_TILES`, lora_shrink.py).

Split in two at decode (lora/layers.py, with the shrink on a side stream): the expand only reads
h and B, so with `accumulate=False` it stores the delta d [T, O] fp32 instead of adding it into y,
and runs on the side stream beside the base matmul; `lora_add` then adds d into the rows of y
whose token has an adapter. The add's loads of y, d and the row flags depend on nothing but the
program's index, so it is one round trip to memory on the critical path where the expand is a
chain of four (segments, token ids, planes, y). The sum is the same fp32 sum as the expand's,
rounded once.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from tinypaged.kernels._triton import cdiv, dot_precision, jit, next_power_of_2, tl, use_triton
from tinypaged.kernels.lora_shrink import LORA_TILES, lora_tiles, slot_tile, use_pdl

# Column tiles per program when the expand stores the delta (accumulate=False). That expand runs
# on the side stream beside the base GEMM, where its time is hidden but every SM it holds is one
# the GEMM waits for: a few column tiles a program keep its grid small without making each
# program's chain of loads long (an H200 sweep of 1, 4 and 16 at batch 8 chose 4).
DELTA_TILES = 4


# split_k and the plane stride (T * S*R) change with the batch size: specialized, they would
# compile a new kernel in the middle of serving (PLANES depends on the tile row only)
@jit(do_not_specialize=("split_k", "stride_hs"))
def _lora_expand_kernel(
    H, B, SORTED, SEG_START, SEG_LEN, Y,  # h [SPLIT_K, T, S*R] fp32; lora_b [L, O, R]; y [T, O]
    off1, off2, off3,  # shard s owns columns off_s .. off_{s+1} - 1 (off0 = 0)
    group1, group2,  # the first column group of shards 1 and 2 (past the grid: no such shard)
    rank, split_k, num_slots, stride_hs, stride_hm, stride_bl, stride_bo, stride_ym,
    MAX_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, PLANES: tl.constexpr, TILES: tl.constexpr, PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr, ACCUMULATE: tl.constexpr,  # False: y = the delta (fp32), not y +=
):
    slot, pid_m, seg_start, seg_len = slot_tile(SEG_START, SEG_LEN, num_slots, tl.program_id(0),
                                                BLOCK_M, MAX_SLOTS)
    pid_g = tl.program_id(1)
    if slot < 0:  # past the batch's last row tile
        return
    shard = (pid_g >= group1).to(tl.int32) + (pid_g >= group2).to(tl.int32)
    first_group = tl.where(shard == 0, 0, tl.where(shard == 1, group1, group2))
    out_offset = tl.where(shard == 0, 0, tl.where(shard == 1, off1, off2))
    out_size = tl.where(shard == 0, off1, tl.where(shard == 1, off2, off3)) - out_offset
    col0 = (pid_g - first_group) * (TILES * BLOCK_N)  # the group's first column in its shard
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < seg_len
    tok = tl.load(SORTED + seg_start + rows, mask=row_mask, other=0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < rank
    b_ptrs = B + slot.to(tl.int64) * stride_bl + out_offset * stride_bo + r[:, None]
    cols = col0 + tl.arange(0, BLOCK_N)
    b_next = tl.load(b_ptrs + cols[None, :] * stride_bo,
                     mask=r_mask[:, None] & (cols < out_size)[None, :], other=0.0)  # [BR, BN]
    if USE_PDL:  # everything above is independent of the shrink; h and y are not
        tl.extra.cuda.gdc_wait()
    p = tl.arange(0, PLANES)
    h_ptrs = (H + p[:, None, None] * stride_hs + tok[None, :, None] * stride_hm + shard * rank
              + r[None, None, :])  # [PLANES, BM, BR]
    h_mask = row_mask[None, :, None] & r_mask[None, None, :]
    h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for s0 in range(0, split_k, PLANES):  # the shrink's partial sums, PLANES at a time
        planes = tl.load(h_ptrs + s0 * stride_hs, mask=h_mask & (s0 + p < split_k)[:, None, None],
                         other=0.0)
        h += tl.sum(planes, axis=0)  # [BM, BR] fp32
    h = h.to(B.dtype.element_ty)
    y_ptrs = Y + tok[:, None] * stride_ym + out_offset
    for j in tl.static_range(TILES):  # the group's column tiles, all reusing h
        cols = col0 + j * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < out_size  # the shard's last group may end early
        b = b_next
        if j + 1 < TILES:  # the next tile's B, loaded before this tile's y round trip
            b_next = tl.load(b_ptrs + (cols + BLOCK_N)[None, :] * stride_bo,
                             mask=r_mask[:, None] & (cols + BLOCK_N < out_size)[None, :],
                             other=0.0)
        delta = tl.dot(h, b, input_precision=PRECISION)  # [BM, BN] fp32
        mask = row_mask[:, None] & col_mask[None, :]
        if ACCUMULATE:
            delta += tl.load(y_ptrs + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs + cols[None, :], delta.to(Y.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=1024)
def expand_launch(num_tokens: int, num_slots: int, rank: int, split_k: int,
                  offsets: tuple[int, ...], tiles_row: tuple[int, ...]
                  ) -> tuple[tuple[int, int], list[int], dict]:
    """(grid, the kernel's shard arguments off1..off3 group1 group2, its constexprs) for a
    batch at `tiles_row` (lora_tiles(num_tokens)); cached, since a step's layers repeat a
    handful of shapes."""
    if not 2 <= len(offsets) <= 4 or offsets[0] != 0:
        raise ValueError(f"offsets must be [0, ...] for 1 to 3 shards, got {list(offsets)}")
    _, block_m, _, _, _, block_n, tiles = tiles_row
    block_r = max(16, next_power_of_2(rank))
    if block_r > 64:  # keep B's [BR, BN] tile and the delta within registers
        block_n = min(block_n, 32)
    # at most 8192 fp32 of planes per load (64 registers a thread). Past the first row
    # (T > 16) split_k changes with T, so PLANES comes from the cap alone and one compiled kernel
    # serves every batch size of the row (lanes past split_k masked); within the first row
    # (decode: one row tile) split_k is fixed by the layer's K, and PLANES fits it exactly
    planes = min(64, max(1, 8192 // (block_m * block_r)))
    if num_tokens <= LORA_TILES[0][0]:
        planes = min(planes, next_power_of_2(split_k))
    groups = [cdiv(cdiv(offsets[s + 1] - offsets[s], block_n), tiles)  # per shard
              for s in range(len(offsets) - 1)]
    firsts = [sum(groups[:s]) if s < len(groups) else sum(groups) for s in (1, 2)]
    ends = list(offsets[1:]) + [offsets[-1]] * (4 - len(offsets))  # off1, off2, off3
    grid = (cdiv(num_tokens, block_m) + num_slots, sum(groups))
    meta = dict(MAX_SLOTS=next_power_of_2(num_slots), BLOCK_M=block_m, BLOCK_N=block_n,
                BLOCK_R=block_r, PLANES=planes, TILES=tiles)
    return grid, ends + firsts, meta


def lora_expand_triton(y: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor,
                       sorted_token_ids: torch.Tensor, seg_start: torch.Tensor,
                       seg_len: torch.Tensor, offsets: Sequence[int],
                       accumulate: bool = True) -> torch.Tensor:
    """The Triton launcher: one launch for every shard (at most 3)."""
    num_tokens = y.shape[0]
    num_slots, _, rank = lora_b.shape
    if num_tokens == 0:
        return y
    tiles_row = lora_tiles(num_tokens)
    if not accumulate:  # the delta, made beside the base GEMM: fewer, longer programs
        tiles_row = (*tiles_row[:-1], DELTA_TILES)
    grid, shard_args, meta = expand_launch(num_tokens, num_slots, rank, h.shape[0],
                                           tuple(offsets), tiles_row)
    pdl = use_pdl(y)
    _lora_expand_kernel[grid](
        h, lora_b, sorted_token_ids, seg_start, seg_len, y, *shard_args,
        rank, h.shape[0], num_slots, h.stride(0), h.stride(1), lora_b.stride(0),
        lora_b.stride(1), y.stride(0),
        **meta, PRECISION=dot_precision(lora_b.dtype), USE_PDL=pdl, ACCUMULATE=accumulate,
        num_warps=4,
        **({"launch_pdl": True} if pdl else {}),
    )
    return y


def lora_expand_ref(y: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor,
                    sorted_token_ids: torch.Tensor, seg_start: torch.Tensor,
                    seg_len: torch.Tensor, offsets: Sequence[int],
                    accumulate: bool = True) -> torch.Tensor:
    """The torch reference: per slot and shard, y[tok, cols] += h(cast to B's dtype) @ B^T
    (accumulate=False: y[tok, cols] = that product)."""
    rank = lora_b.shape[2]
    for slot, (start, length) in enumerate(zip(seg_start.tolist(), seg_len.tolist())):
        if not length:
            continue
        tok = sorted_token_ids[start : start + length].long()
        for s in range(len(offsets) - 1):
            lo, hi = offsets[s], offsets[s + 1]
            hs = h[:, tok, s * rank : (s + 1) * rank].sum(0).to(lora_b.dtype).float()
            delta = hs @ lora_b[slot, lo:hi].float().T
            if accumulate:
                delta = y[tok, lo:hi].float() + delta
            y[tok, lo:hi] = delta.to(y.dtype)
    return y


def lora_expand(y: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor,
                sorted_token_ids: torch.Tensor, seg_start: torch.Tensor, seg_len: torch.Tensor,
                offsets: Sequence[int], accumulate: bool = True) -> torch.Tensor:
    """y[t, shard s] += h[t, shard s] @ lora_b[slot(t), shard s]^T in place (module docstring),
    h = the planes' sum of h [SPLIT_K, T, S*R]; `offsets` [S + 1]: where each shard's output
    columns start in y. accumulate=False stores the product instead (y: the fp32 delta of
    `lora_add`). Only the rows of tokens with an adapter are written. Returns y."""
    impl = lora_expand_triton if use_triton(y) else lora_expand_ref
    return impl(y, h, lora_b, sorted_token_ids, seg_start, seg_len, offsets, accumulate)


@jit
def _lora_add_kernel(Y, D, HAS, N, stride_ym, stride_dm, BLOCK_N: tl.constexpr):
    # grid: (T, cdiv(N, BLOCK_N)); program (t, j) adds columns j * BLOCK_N.. of row t. Its three
    # loads are issued together: none waits for another (the row flag only masks the store)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    has = tl.load(HAS + row)
    y = tl.load(Y + row * stride_ym + cols, mask=col_mask, other=0.0)
    d = tl.load(D + row * stride_dm + cols, mask=col_mask, other=0.0)
    tl.store(Y + row * stride_ym + cols, (y.to(tl.float32) + d).to(Y.dtype.element_ty),
             mask=col_mask & (has != 0))


def lora_add_triton(y: torch.Tensor, delta: torch.Tensor,
                    has_adapter: torch.Tensor) -> torch.Tensor:
    """The Triton launcher."""
    num_tokens, n = y.shape
    if num_tokens == 0:
        return y
    block_n = 1024
    _lora_add_kernel[(num_tokens, cdiv(n, block_n))](
        y, delta, has_adapter, n, y.stride(0), delta.stride(0), BLOCK_N=block_n, num_warps=4)
    return y


def lora_add_ref(y: torch.Tensor, delta: torch.Tensor, has_adapter: torch.Tensor) -> torch.Tensor:
    """The torch reference (no host sync: a where, not a boolean index)."""
    rows = has_adapter[: y.shape[0], None] != 0
    y.copy_(torch.where(rows, (y.float() + delta).to(y.dtype), y))
    return y


def lora_add(y: torch.Tensor, delta: torch.Tensor, has_adapter: torch.Tensor) -> torch.Tensor:
    """y[t] = y[t] + delta[t] (summed in fp32, rounded to y's dtype) in place for every row t with
    has_adapter[t] != 0; y [T, O], delta [T, O] fp32 (from lora_expand with accumulate=False:
    its rows of tokens of no adapter hold anything), has_adapter [>= T] int32. Returns y."""
    impl = lora_add_triton if use_triton(y) else lora_add_ref
    return impl(y, delta, has_adapter)
