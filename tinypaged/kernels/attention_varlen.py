"""The varlen paged-attention kernel: prefill, chunked prefill and mixed batches in one launch.

See attention.py for the math. This kernel takes any batch: sequence b has q_len_b new tokens
(rows query_start_loc[b] : query_start_loc[b+1] of q) at the end of a context of seq_lens[b]
tokens whose K/V are already in the paged cache.

Grid: (num_tokens // BLOCK_Q + num_seqs, Hk). One program owns BLOCK_Q consecutive new tokens of
one sequence and the GROUP = Hq / Hk query heads that share KV head `program_id(1)`: the
BLOCK_M = BLOCK_Q * GROUP (token, head) pairs are the M rows of each `tl.dot`, so a K/V tile is
loaded once for the whole group. Sequence b's query blocks are numbered from
query_start_loc[b] // BLOCK_Q + b, which bounds the grid by the tensor shapes alone (no host sync,
graph-capturable); a program finds its sequence by binary search and returns at once when it falls
past its sequence's last block.

The key loop walks the context in tiles of BLOCK_N positions, independent of the cache block
size: key p of sequence b sits in row p % block_size of physical block block_tables[b, p //
block_size]. Tiles wholly before the block's first query position need no mask; the tiles after
it (the causal diagonal) mask key p > query position. With a sliding window of W tokens
(SLIDING), the loop starts at the tile holding the block's first query position - W + 1 (tiles
wholly before it are never read), and the tiles up to the last query's window start are masked
too. Softmax is online, in fp32, base 2 (online_softmax.py derives the recurrence); SOFTCAP caps
the scores first.
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import jit, next_power_of_2, tl
from tinypaged.kernels.activation import tanh
from tinypaged.kernels.online_softmax import online_softmax_finish, online_softmax_update

LOG2E = 1.4426950408889634  # scores go to base 2: exp(s) = exp2(s * log2(e))


@jit
def attention_tile(
    acc, m_i, l_i,  # running state: [BLOCK_M, BLOCK_D] fp32 sum of p * v, [BLOCK_M] max, sum of p
    q,  # [BLOCK_M, BLOCK_D]
    K_CACHE, V_CACHE,
    block,  # [BLOCK_N] int64: the cache block of each key of the tile (tile_blocks)
    kv_head_offset, stride_cb, stride_cs,
    start_n,  # first key position of the tile
    q_pos,  # [BLOCK_M] absolute position of each query row (keys <= q_pos are visible)
    key_end,  # keys >= key_end are not part of this tile's range
    offs_d, d_mask,  # [BLOCK_D]
    qk_scale,  # softmax scale * log2(e): scores in base 2
    window,  # SLIDING: key p is visible to a row at q_pos only if q_pos - p < window
    softcap,  # SOFTCAP: the logit cap times log2(e)
    MASKED: tl.constexpr,  # False: every key of the tile is visible to every row
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # of the cache blocks: a power of two makes // and % shifts
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One step of online softmax over BLOCK_N keys (see online_softmax.py); returns the updated
    (acc, m_i, l_i)."""
    k_pos = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    if MASKED:
        k_in = k_pos < key_end
        kv_mask = k_in[:, None] & d_mask[None, :]
    else:
        kv_mask = d_mask[None, :]
    row = block * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs + kv_head_offset  # [BLOCK_N]
    kv_offsets = row[:, None] + offs_d[None, :]  # [BLOCK_N, BLOCK_D]
    k = tl.load(K_CACHE + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)  # FP8 caches widen
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    if SOFTCAP:  # cap * tanh(s / cap), in base 2: the cap is scaled by log2(e) like s
        qk = softcap * tanh(qk / softcap)
    if MASKED:
        visible = k_in[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if SLIDING:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))
    p, alpha, m_new, l_i = online_softmax_update(m_i, l_i, qk)  # p [BLOCK_M, BLOCK_N]
    v = tl.load(V_CACHE + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@jit
def tile_blocks(block_table, start_n, key_end, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_N] int64: the cache block of keys start_n .. start_n + BLOCK_N - 1 (0 past key_end).

    The key loops load tile i + 1's blocks while tile i is computed and pass them in: with the
    block-table load in the same iteration as the K/V loads it addresses, Triton's pipeliner
    waits for every outstanding copy at each tile, so no K/V load overlaps the math."""
    k_pos = start_n + tl.arange(0, BLOCK_N)
    return tl.load(block_table + k_pos // BLOCK_SIZE, mask=k_pos < key_end, other=0).to(tl.int64)


@jit
def _find_sequence(QUERY_START_LOC, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """The last b with query_start_loc[b] // BLOCK_Q + b <= q_block (binary search)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(QUERY_START_LOC + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# stride_bt is the step's block-table width, ceil(max_seq_len / block_size): 1 in the
# start-up warm-up, anything in serving (a cached prompt's prefill met it first: a compile)
@jit(do_not_specialize=('num_seqs', 'stride_bt'))
def _varlen_attention_kernel(
    Q, K_CACHE, V_CACHE, OUT, BLOCK_TABLES, SEQ_LENS, QUERY_START_LOC,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    num_seqs, qk_scale, window, softcap,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,  # rows per program, tokens per program
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,  # cache block, key tile
    SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # heaviest first: under the causal mask a sequence's later query blocks see more keys, and
    # the GPU starts programs in index order, so reversing the order shortens the tail
    q_block = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(QUERY_START_LOC, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(QUERY_START_LOC + seq)
    q_len = tl.load(QUERY_START_LOC + seq + 1) - q_start
    q_block_in_seq = q_block - (q_start // BLOCK_Q + seq)
    if q_block_in_seq * BLOCK_Q >= q_len:
        return
    prefix_len = tl.load(SEQ_LENS + seq) - q_len  # cached tokens before the new ones

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block_in_seq * BLOCK_Q + rows // GROUP  # [BLOCK_M] new-token index in the sequence
    head = kv_head * GROUP + rows % GROUP  # [BLOCK_M] query head
    row_valid = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = tl.where(row_valid, prefix_len + q_idx, -1)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    token = (q_start + q_idx).to(tl.int64)
    q_mask = row_valid[:, None] & d_mask[None, :]
    q = tl.load(Q + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=q_mask, other=0.0)  # [BLOCK_M, BLOCK_D]

    first_pos = prefix_len + q_block_in_seq * BLOCK_Q  # position of the block's first token
    key_end = prefix_len + tl.minimum((q_block_in_seq + 1) * BLOCK_Q, q_len)  # last + 1
    unmasked_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    block_table = BLOCK_TABLES + seq.to(tl.int64) * stride_bt
    kv_head_offset = kv_head.to(tl.int64) * stride_ch

    if SLIDING:  # keys before the first row's window are skipped; in the tiles up to the last
        # row's window start the window cuts through the tile, so it is masked
        window_start = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
        full_start = tl.minimum(
            tl.cdiv(tl.maximum(key_end - window, 0), BLOCK_N) * BLOCK_N, unmasked_end)
    else:
        window_start = 0
        full_start = 0

    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    block = tile_blocks(block_table, window_start, key_end, BLOCK_SIZE, BLOCK_N)
    for start_n in range(window_start, full_start, BLOCK_N):  # empty without SLIDING
        acc, m_i, l_i = attention_tile(
            acc, m_i, l_i, q, K_CACHE, V_CACHE, block, kv_head_offset, stride_cb,
            stride_cs, start_n, q_pos, key_end, offs_d, d_mask, qk_scale, window, softcap,
            True, SLIDING, SOFTCAP, BLOCK_SIZE, BLOCK_N, DOT_PRECISION)
        block = tile_blocks(block_table, start_n + BLOCK_N, key_end, BLOCK_SIZE, BLOCK_N)
    for start_n in range(full_start, unmasked_end, BLOCK_N):
        acc, m_i, l_i = attention_tile(
            acc, m_i, l_i, q, K_CACHE, V_CACHE, block, kv_head_offset, stride_cb,
            stride_cs, start_n, q_pos, key_end, offs_d, d_mask, qk_scale, window, softcap,
            False, SLIDING, SOFTCAP, BLOCK_SIZE, BLOCK_N, DOT_PRECISION)
        block = tile_blocks(block_table, start_n + BLOCK_N, key_end, BLOCK_SIZE, BLOCK_N)
    for start_n in range(unmasked_end, key_end, BLOCK_N):
        acc, m_i, l_i = attention_tile(
            acc, m_i, l_i, q, K_CACHE, V_CACHE, block, kv_head_offset, stride_cb,
            stride_cs, start_n, q_pos, key_end, offs_d, d_mask, qk_scale, window, softcap,
            True, SLIDING, SOFTCAP, BLOCK_SIZE, BLOCK_N, DOT_PRECISION)
        block = tile_blocks(block_table, start_n + BLOCK_N, key_end, BLOCK_SIZE, BLOCK_N)

    out = online_softmax_finish(acc, l_i)
    tl.store(OUT + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(OUT.dtype.element_ty), mask=q_mask)


def varlen_attention_triton(
    q: torch.Tensor,  # [T, Hq, D], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hk, D]
    v_cache: torch.Tensor,  # same shape and strides as k_cache
    block_tables: torch.Tensor,  # [B, max_blocks], last dim contiguous
    seq_lens: torch.Tensor,  # [B]
    query_start_loc: torch.Tensor,  # [B + 1]
    scale: float,
    out: torch.Tensor,  # [T, Hq, D]
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
) -> torch.Tensor:
    """Launch the varlen kernel; checked arguments (see attention.paged_attention)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    block_m = max(block_m, next_power_of_2(group))  # at least one token per program
    block_q = block_m // group
    grid = (num_tokens // block_q + seq_lens.shape[0], num_kv_heads)
    _varlen_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        seq_lens.shape[0], scale * LOG2E, sliding_window or 0, (softcap or 1.0) * LOG2E,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim),
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_SIZE=k_cache.shape[1], BLOCK_N=block_n,
        SLIDING=sliding_window is not None, SOFTCAP=softcap is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
