"""Split-KV ("flash-decoding") paged attention for batches of a few new tokens per sequence.

See attention.py for the math. With one query token per sequence, a program per (sequence, KV
head) gives B * Hk programs, too few to keep 132 SMs streaming K/V when the batch is small. So each
sequence's context is cut into NUM_SPLITS ranges of whole BLOCK_N tiles, one program per
(sequence, KV head, split):

    pass 1, grid (Hk, B, NUM_SPLITS):   o_s = softmax over split s of q k^T, times V   [ROWS, D]
                                        lse_s = log2 of that split's sum of exp2 scores [ROWS]
    pass 2, grid (B * QUERIES, Hq):     out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M),
                                        M = max_s lse_s   (online_softmax.py derives both)

The GROUP = Hq / Hk query heads sharing a KV head are the M rows of `tl.dot` (padded to
BLOCK_H >= 16, the smallest MMA), so every K/V row is read from memory once. Splits that start past
a sequence's end write lse = -inf and o = 0 and weigh nothing in the merge: a fixed NUM_SPLITS is
valid for any lengths (CUDA-graph capture). NUM_SPLITS is a runtime argument, so a new split count
compiles nothing new; with NUM_SPLITS == 1, pass 1 writes the output itself. Partial results are
fp32: o_part [B * QUERIES, Hq, NUM_SPLITS, D], lse_part [B * QUERIES, Hq, NUM_SPLITS].

Multi-query mode (QUERIES > 1, a speculative verification: every sequence has q = k + 1 new
tokens). Sequence b's q_b <= QUERIES tokens (rows query_start_loc[b] + j of q, j < q_b) sit at
positions seq_lens[b] - q_b + j, and the program of (KV head, b, split) takes all of them:

    row r = j * GROUP + h  (token j, head h of the group),  ROWS = QUERIES * GROUP -> BLOCK_H
    row r sees key p  iff  p <= seq_lens[b] - q_b + j  (causal; attention_tile masks per row)

so each K/V tile is loaded once for the q * GROUP rows, where q one-token decodes of the same
sequence would stream it q times. The partials are per token: row b * QUERIES + j of o_part, so
the merge combines the splits of each (token, head); a split that holds only keys after row r's
position gives it lse = -inf, as an empty split does. A sequence with fewer than QUERIES tokens
(0: a padding entry) leaves the rows of the missing ones unwritten. QUERIES = 1 is the plain
decode: every row is token 0 at position seq_len - 1.

The KV heads are the grid's first axis: the GPU starts programs in index order, so the Hk programs
of a sequence run side by side and together read whole cache rows ([BLOCK_SIZE, Hk, D] per block,
contiguous) instead of one head's 256-byte slice of each row, while the other heads' slices come
much later. It helps most where contexts are many or uneven (large batches); elsewhere the two
orders measured the same (benchmarks/RESULTS-log.md).

With a sliding window of W tokens (SLIDING) the splits share only the keys from the tile holding
the first new token's window start (position seq_len - q_b + 1 - W) on, so a long context costs
what its window costs; the masks drop each row's keys before its own window. SOFTCAP caps the
scores before the softmax (see attention.py).
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import cdiv, jit, next_power_of_2, tl
from tinypaged.kernels.attention_varlen import LOG2E, attention_tile, tile_blocks
from tinypaged.kernels.online_softmax import log_sum_exp, merge_splits, online_softmax_finish
from tinypaged.kernels.pdl import launch_kwargs, pdl_enabled, pdl_trigger, pdl_wait


# stride_bt is the step's block-table width, ceil(max_seq_len / block_size): 1 in the
# start-up warm-up, anything in serving (a cached prompt's prefill met it first: a compile)
@jit(do_not_specialize=('num_splits', 'stride_bt'))
def _decode_split_kernel(
    Q, K_CACHE, V_CACHE, OUT, O_PART, LSE_PART, BLOCK_TABLES, SEQ_LENS, QUERY_START_LOC,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    stride_pb, stride_ph, stride_ps,  # o_part strides (lse_part is o_part's without D)
    stride_lb, stride_lh,
    qk_scale, window, softcap, num_splits,
    GROUP: tl.constexpr,  # query heads per KV head
    QUERIES: tl.constexpr,  # new tokens per sequence at most (1: a plain decode)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,  # rows: QUERIES * GROUP, padded to a power of two >= 16
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,  # num_splits == 1: write the output, skip the partials
    SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,  # chained to the kernels around it (kernels/pdl.py)
):
    pdl_trigger(USE_PDL)
    pdl_wait(USE_PDL)
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(QUERY_START_LOC + seq)
    q_len = tl.load(QUERY_START_LOC + seq + 1) - q_start  # <= QUERIES; 0 for a padding entry
    seq_len = tl.load(SEQ_LENS + seq)
    first_pos = seq_len - q_len  # position of the sequence's first new token
    if SLIDING:  # the splits share the first token's window and on, from the tile holding it
        context_start = tl.maximum(first_pos + 1 - window, 0) // BLOCK_N * BLOCK_N
    else:
        context_start = 0
    split_len = tl.cdiv(tl.cdiv(seq_len - context_start, num_splits), BLOCK_N) * BLOCK_N
    start = context_start + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    rows = tl.arange(0, BLOCK_H)  # row r = j * GROUP + h: new token j, query head h of the group
    if QUERIES == 1:  # a plain decode: one token, whose address and position fold to scalars
        j = tl.zeros((BLOCK_H,), dtype=tl.int32)
    else:
        j = rows // GROUP  # [BLOCK_H]
    head = kv_head * GROUP + rows % GROUP  # [BLOCK_H] query heads of this KV head
    row_valid = (rows < QUERIES * GROUP) & (j < q_len)
    token = q_start.to(tl.int64) + j  # [BLOCK_H]: the row's token in q and out
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    mask = row_valid[:, None] & d_mask[None, :]
    q = tl.load(Q + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=mask, other=0.0)  # [BLOCK_H, BLOCK_D]
    q_pos = first_pos + j  # [BLOCK_H] causal: row r sees the keys at positions <= q_pos[r]
    block_table = BLOCK_TABLES + seq.to(tl.int64) * stride_bt
    kv_head_offset = kv_head.to(tl.int64) * stride_ch

    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        # the block ids are loaded in the iteration that uses them, unlike the prefill loops
        # (attention_varlen.tile_blocks): Triton then keeps one K/V tile per program in shared
        # memory, so more programs fit on an SM, which a memory-bound decode needs more than
        # the prefetch (measured: prefetching the block ids made decode markedly slower)
        block = tile_blocks(block_table, start_n, end, BLOCK_SIZE, BLOCK_N)
        acc, m_i, l_i = attention_tile(
            acc, m_i, l_i, q, K_CACHE, V_CACHE, block, kv_head_offset, stride_cb,
            stride_cs, start_n, q_pos, end, offs_d, d_mask, qk_scale, window, softcap,
            True, SLIDING, SOFTCAP, BLOCK_SIZE, BLOCK_N, DOT_PRECISION)

    o = online_softmax_finish(acc, l_i)  # 0 for a row that saw no key in this split
    if SINGLE_SPLIT:
        tl.store(OUT + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(OUT.dtype.element_ty), mask=mask)
    else:
        lse = log_sum_exp(m_i, l_i)  # -inf for a row that saw no key (m_i = -inf, l_i = 0)
        part_row = seq.to(tl.int64) * QUERIES + j  # [BLOCK_H]: the partials are per token
        part = part_row[:, None] * stride_pb + head[:, None] * stride_ph + split * stride_ps
        tl.store(O_PART + part + offs_d[None, :], o, mask=mask)
        tl.store(LSE_PART + part_row * stride_lb + head * stride_lh + split, lse,
                 mask=row_valid)


@jit(do_not_specialize=('num_splits',))
def _decode_merge_kernel(
    OUT, O_PART, LSE_PART, QUERY_START_LOC,
    stride_ot, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    num_splits,
    QUERIES: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # next power of two >= num_splits
    USE_PDL: tl.constexpr,
):
    pdl_trigger(USE_PDL)
    pdl_wait(USE_PDL)
    part_row = tl.program_id(0).to(tl.int64)  # seq * QUERIES + j: new token j of sequence seq
    head = tl.program_id(1)
    seq = part_row // QUERIES
    j = part_row % QUERIES
    q_start = tl.load(QUERY_START_LOC + seq).to(tl.int64)
    if tl.load(QUERY_START_LOC + seq + 1) - q_start <= j:  # no such token (padding, short)
        return
    token = q_start + j
    splits = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    lse = tl.load(LSE_PART + part_row * stride_lb + head * stride_lh + splits,
                  mask=splits < num_splits, other=float("-inf"))  # [BLOCK_S]
    mask = (splits[:, None] < num_splits) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(O_PART + part_row * stride_pb + head * stride_ph + splits[:, None] * stride_ps
                + offs_d[None, :], mask=mask, other=0.0)  # [BLOCK_S, BLOCK_D]
    out = merge_splits(lse, o)  # [BLOCK_D]
    tl.store(OUT + token * stride_ot + head * stride_oh + offs_d, out.to(OUT.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Splits per sequence so that ~2 programs per SM stream K/V, each over >= 256 keys: once
    the grid fills the GPU, every extra split only adds partial results to write and merge (at
    B64 ctx1024 one split is the fastest; benchmarks/RESULTS-log.md)."""
    wanted = cdiv(2 * num_sms, max(num_seqs * num_kv_heads, 1))
    return max(1, min(wanted, max_seq_len // 256, 64))


def decode_attention_triton(
    q: torch.Tensor,  # [T, Hq, D]: up to max_query_len new tokens per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hk, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    seq_lens: torch.Tensor,  # [B]
    query_start_loc: torch.Tensor,  # [B + 1]
    scale: float,
    out: torch.Tensor,  # [T, Hq, D]
    *,
    num_splits: int,
    max_query_len: int = 1,
    sliding_window: int | None = None,
    softcap: float | None = None,
    block_n: int,
    num_warps: int,
    num_stages: int,
) -> torch.Tensor:
    """Launch split-KV decode (and the merge when num_splits > 1); checked arguments.
    max_query_len > 1: the multi-query mode (QUERIES), for batches in which no sequence has
    more new tokens than that (a speculative verification's k + 1)."""
    num_seqs = seq_lens.shape[0]
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    block_d = next_power_of_2(head_dim)
    if num_splits > 1:  # one row of partials per (sequence, new token j < max_query_len)
        o_part = torch.empty((num_seqs * max_query_len, num_q_heads, num_splits, head_dim),
                             dtype=torch.float32, device=q.device)
        lse_part = torch.empty((num_seqs * max_query_len, num_q_heads, num_splits),
                               dtype=torch.float32, device=q.device)
    else:  # pass 1 writes `out` directly; the partial buffers are not touched
        o_part = lse_part = out
    pdl = pdl_enabled(q)
    _decode_split_kernel[(num_kv_heads, num_seqs, num_splits)](
        q, k_cache, v_cache, out, o_part, lse_part, block_tables, seq_lens, query_start_loc,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        scale * LOG2E, sliding_window or 0, (softcap or 1.0) * LOG2E, num_splits,
        GROUP=group, QUERIES=max_query_len, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_H=max(16, next_power_of_2(max_query_len * group)), BLOCK_SIZE=k_cache.shape[1],
        BLOCK_N=block_n, SINGLE_SPLIT=num_splits == 1,
        SLIDING=sliding_window is not None, SOFTCAP=softcap is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        USE_PDL=pdl, num_warps=num_warps, num_stages=num_stages, **launch_kwargs(pdl),
    )
    if num_splits > 1:
        _decode_merge_kernel[(num_seqs * max_query_len, num_q_heads)](
            out, o_part, lse_part, query_start_loc,
            out.stride(0), out.stride(1), o_part.stride(0), o_part.stride(1), o_part.stride(2),
            lse_part.stride(0), lse_part.stride(1), num_splits,
            QUERIES=max_query_len, HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_S=next_power_of_2(num_splits), USE_PDL=pdl, num_warps=4,
            **launch_kwargs(pdl),
        )
    return out
