"""Split-KV ("flash-decoding") paged attention for batches of one new token per sequence.

See attention.py for the math. With one query token per sequence, a program per (sequence, KV
head) gives B * Hk programs, too few to keep 132 SMs streaming K/V when the batch is small. So each
sequence's context is cut into NUM_SPLITS ranges of whole BLOCK_N tiles, one program per
(sequence, KV head, split):

    pass 1, grid (Hk, B, NUM_SPLITS): o_s = softmax over split s of q k^T, times V   [GROUP, D]
                                      lse_s = log2 of that split's sum of exp2 scores [GROUP]
    pass 2, grid (B, Hq):              out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M),
                                       M = max_s lse_s   (online_softmax.py derives both)

The GROUP = Hq / Hk query heads sharing a KV head are the M rows of `tl.dot` (padded to
BLOCK_H >= 16, the smallest MMA), so every K/V row is read from memory once. Splits that start past
a sequence's end write lse = -inf and o = 0 and weigh nothing in the merge: a fixed NUM_SPLITS is
valid for any lengths (CUDA-graph capture). NUM_SPLITS is a runtime argument, so a new split count
compiles nothing new; with NUM_SPLITS == 1, pass 1 writes the output itself. Partial results are
fp32: o_part [B, Hq, NUM_SPLITS, D], lse_part [B, Hq, NUM_SPLITS].

The KV heads are the grid's first axis: the GPU starts programs in index order, so the Hk programs
of a sequence run side by side and together read whole cache rows ([BLOCK_SIZE, Hk, D] per block,
contiguous) instead of one head's 256-byte slice of each row, while the other heads' slices come
much later. It helps most where contexts are many or uneven (large batches); elsewhere the two
orders measured the same (benchmarks/RESULTS-log.md).

With a sliding window of W tokens (SLIDING) the splits share only the keys from the tile holding
position seq_len - W on, so a long context costs what its window costs; the first tile masks
the keys before the window. SOFTCAP caps the scores before the softmax (see attention.py).
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import cdiv, jit, next_power_of_2, tl
from tinypaged.kernels.attention_varlen import LOG2E, attention_tile, tile_blocks
from tinypaged.kernels.online_softmax import log_sum_exp, merge_splits, online_softmax_finish


@jit(do_not_specialize=('num_splits',))
def _decode_split_kernel(
    Q, K_CACHE, V_CACHE, OUT, O_PART, LSE_PART, BLOCK_TABLES, SEQ_LENS, QUERY_START_LOC,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    stride_pb, stride_ph, stride_ps,  # o_part strides (lse_part is o_part's without D)
    stride_lb, stride_lh,
    qk_scale, window, softcap, num_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,  # num_splits == 1: write the output, skip the partials
    SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(QUERY_START_LOC + seq).to(tl.int64)
    has_query = tl.load(QUERY_START_LOC + seq + 1) > token  # False for a 0-token padding entry
    seq_len = tl.load(SEQ_LENS + seq)
    if SLIDING:  # the splits share the window's keys only, from the tile holding its first key
        context_start = tl.maximum(seq_len - window, 0) // BLOCK_N * BLOCK_N
    else:
        context_start = 0
    split_len = tl.cdiv(tl.cdiv(seq_len - context_start, num_splits), BLOCK_N) * BLOCK_N
    start = context_start + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    rows = tl.arange(0, BLOCK_H)
    head = kv_head * GROUP + rows  # [BLOCK_H] query heads of this KV head
    row_valid = (rows < GROUP) & has_query
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(Q + token * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_valid[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    q_pos = tl.full((BLOCK_H,), 0, dtype=tl.int32) + seq_len - 1  # the new token is the last
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

    o = online_softmax_finish(acc, l_i)  # 0 for an empty split
    mask = row_valid[:, None] & d_mask[None, :]
    if SINGLE_SPLIT:
        tl.store(OUT + token * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(OUT.dtype.element_ty), mask=mask)
    else:
        lse = log_sum_exp(m_i, l_i)  # -inf for an empty split (m_i = -inf, l_i = 0)
        part = seq.to(tl.int64) * stride_pb + head[:, None] * stride_ph + split * stride_ps
        tl.store(O_PART + part + offs_d[None, :], o, mask=mask)
        tl.store(LSE_PART + seq.to(tl.int64) * stride_lb + head * stride_lh + split, lse,
                 mask=row_valid)


@jit(do_not_specialize=('num_splits',))
def _decode_merge_kernel(
    OUT, O_PART, LSE_PART, QUERY_START_LOC,
    stride_ot, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # next power of two >= num_splits
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    token = tl.load(QUERY_START_LOC + seq).to(tl.int64)
    if tl.load(QUERY_START_LOC + seq + 1) <= token:
        return
    splits = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    lse = tl.load(LSE_PART + seq * stride_lb + head * stride_lh + splits,
                  mask=splits < num_splits, other=float("-inf"))  # [BLOCK_S]
    mask = (splits[:, None] < num_splits) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(O_PART + seq * stride_pb + head * stride_ph + splits[:, None] * stride_ps
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
    q: torch.Tensor,  # [B, Hq, D], one token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hk, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    seq_lens: torch.Tensor,  # [B]
    query_start_loc: torch.Tensor,  # [B + 1]
    scale: float,
    out: torch.Tensor,  # [B, Hq, D]
    *,
    num_splits: int,
    sliding_window: int | None = None,
    softcap: float | None = None,
    block_n: int,
    num_warps: int,
    num_stages: int,
) -> torch.Tensor:
    """Launch split-KV decode (and the merge when num_splits > 1); checked arguments."""
    num_seqs = seq_lens.shape[0]
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    block_d = next_power_of_2(head_dim)
    if num_splits > 1:
        o_part = torch.empty((num_seqs, num_q_heads, num_splits, head_dim),
                             dtype=torch.float32, device=q.device)
        lse_part = torch.empty((num_seqs, num_q_heads, num_splits),
                               dtype=torch.float32, device=q.device)
    else:  # pass 1 writes `out` directly; the partial buffers are not touched
        o_part = lse_part = out
    _decode_split_kernel[(num_kv_heads, num_seqs, num_splits)](
        q, k_cache, v_cache, out, o_part, lse_part, block_tables, seq_lens, query_start_loc,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        scale * LOG2E, sliding_window or 0, (softcap or 1.0) * LOG2E, num_splits,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_H=max(16, next_power_of_2(group)), BLOCK_SIZE=k_cache.shape[1], BLOCK_N=block_n,
        SINGLE_SPLIT=num_splits == 1,
        SLIDING=sliding_window is not None, SOFTCAP=softcap is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _decode_merge_kernel[(num_seqs, num_q_heads)](
            out, o_part, lse_part, query_start_loc,
            out.stride(0), out.stride(1), o_part.stride(0), o_part.stride(1), o_part.stride(2),
            lse_part.stride(0), lse_part.stride(1), num_splits,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=next_power_of_2(num_splits),
            num_warps=4,
        )
    return out
