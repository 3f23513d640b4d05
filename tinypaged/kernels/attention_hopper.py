"""Prefill attention for Hopper (sm_90): the varlen kernel's math, shaped for the H100/H200.

Same inputs, outputs and grid as attention_varlen.py (see attention.py for the math): one
program owns BLOCK_Q new tokens of one sequence times the GROUP query heads of KV head
`program_id(1)` packed into BLOCK_M = BLOCK_Q * GROUP rows, and streams the sequence's keys
through the block table in tiles of BLOCK_N. What changes is how a tile is computed:

- Big tiles, two warpgroups: BLOCK_M 128 rows by BLOCK_N 64 keys on 8 warps, so each `tl.dot`
  is a warpgroup MMA (wgmma) of 64 rows per warpgroup. Within a program the MMAs and the
  softmax between them run one after the other; registers capped at 128 let two programs share
  an SM, so one's softmax overlaps the other's MMA (HOPPER_CONFIG in attention.py).
- K/V stay in flight: the block ids of the next tile are loaded while this one is computed
  (attention_varlen.tile_blocks says why that matters), so Triton keeps num_stages - 1 tiles of
  asynchronous copies ahead of the math.
- Only the diagonal is masked: the keys below the block's first query position are visible to
  every row, so that loop has no mask, no `where`, no bounds; the last one or two tiles (the
  causal diagonal) mask key p > query position with a large negative score (-1e6 in base 2:
  exp2 of it is 0, and a row never sees only masked keys, so no -inf and no NaN guard).
- The scale is folded into one multiply-add: with s = q . k raw, the running max is taken
  over s * c (c = softmax scale * log2(e)) and p = exp2(s * c - m) (online_softmax.py derives
  the recurrence); acc is rescaled in place and P @ V accumulates into it.
- K/V by TMA when a tile lies inside one cache block (block_size a multiple of BLOCK_N): the
  copy engine fetches the [BLOCK_N, D] tile of one KV head from block
  block_tables[b, p // block_size] through a descriptor over the cache seen as
  [num_blocks, block_size, Hk * D]. With smaller blocks (16 is the engine's default) the tile
  spans several blocks, so its rows are gathered by pointer loads, which Triton pipelines with
  cp.async the same way.

Sliding windows and soft-capping stay on the portable kernel (attention.py dispatches).
"""

from __future__ import annotations

import functools

import torch

from tinypaged.kernels._triton import jit, next_power_of_2, tl
from tinypaged.kernels.attention_varlen import LOG2E, _find_sequence, tile_blocks


@functools.cache
def is_hopper(device_index: int) -> bool:
    """sm_90 (H100, H200, H20): the GPUs this kernel is written for."""
    return torch.cuda.get_device_capability(device_index) == (9, 0)


@jit
def _tile_blocks(block_table, start_n, key_end, USE_TMA: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The cache block of each key of the tile at start_n ([BLOCK_N]), or with TMA the one block
    that holds the whole tile (a scalar); 0 for keys at or past key_end."""
    if USE_TMA:
        blocks = tl.load(block_table + start_n // BLOCK_SIZE, mask=start_n < key_end, other=0)
    else:
        blocks = tile_blocks(block_table, start_n, key_end, BLOCK_SIZE, BLOCK_N)
    return blocks


@jit
def _load_kv_tile(CACHE, blocks, kv_head, start_n, k_in, offs_d, stride_cb, stride_cs,
                  stride_ch, MASKED: tl.constexpr, USE_TMA: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The [BLOCK_N, HEAD_DIM] K or V rows of key positions start_n + 0..BLOCK_N-1 of one KV
    head, from the tile's `blocks`; rows with k_in False read as 0 (MASKED tiles only)."""
    if USE_TMA:
        tile = CACHE.load([blocks, start_n % BLOCK_SIZE, kv_head * HEAD_DIM])  # [1, N, D]
        tile = tile.reshape(BLOCK_N, HEAD_DIM)
        if MASKED:  # keys past the sequence: whatever the block holds there reads as 0
            tile = tl.where(k_in[:, None], tile, 0.0)
    else:
        k_pos = start_n + tl.arange(0, BLOCK_N)
        row = blocks * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        offsets = row[:, None] + offs_d[None, :]  # [BLOCK_N, HEAD_DIM]
        if MASKED:
            tile = tl.load(CACHE + offsets, mask=k_in[:, None], other=0.0)
        else:
            tile = tl.load(CACHE + offsets)
    return tile


@jit
def _hopper_tile(acc, m_i, l_i, q, K_CACHE, V_CACHE, blocks, kv_head, start_n, q_pos,
                 key_end, offs_d, stride_cb, stride_cs, stride_ch, qk_scale,
                 MASKED: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One online-softmax step over keys start_n .. start_n + BLOCK_N - 1; returns the updated
    (acc [BLOCK_M, D] fp32, m_i [BLOCK_M] base-2 max, l_i [BLOCK_M] sum)."""
    k_pos = start_n + tl.arange(0, BLOCK_N)
    k_in = k_pos < key_end
    k = _load_kv_tile(K_CACHE, blocks, kv_head, start_n, k_in, offs_d, stride_cb, stride_cs,
                      stride_ch, MASKED, USE_TMA, BLOCK_SIZE, BLOCK_N, HEAD_DIM)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] raw
    if MASKED:
        visible = k_pos[None, :] <= q_pos[:, None]
        s = s * qk_scale + tl.where(visible, 0.0, -1.0e6)  # exp2(-1e6 - m) = 0
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)  # 0 on the first tile (m_i = -inf)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    v = _load_kv_tile(V_CACHE, blocks, kv_head, start_n, k_in, offs_d, stride_cb, stride_cs,
                      stride_ch, MASKED, USE_TMA, BLOCK_SIZE, BLOCK_N, HEAD_DIM)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# stride_bt is the step's block-table width, ceil(max_seq_len / block_size): 1 in the
# start-up warm-up, anything in serving (a cached prompt's prefill met it first: a compile)
@jit(do_not_specialize=('num_seqs', 'stride_bt'))
def _hopper_attention_kernel(
    Q, K_CACHE, V_CACHE, OUT, BLOCK_TABLES, SEQ_LENS, QUERY_START_LOC,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    num_seqs, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # fp32 inputs (interpreter tests): full precision, not TF32
):
    q_block = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest first, as attention_varlen
    kv_head = tl.program_id(1)
    seq = _find_sequence(QUERY_START_LOC, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(QUERY_START_LOC + seq)
    q_len = tl.load(QUERY_START_LOC + seq + 1) - q_start
    q_block_in_seq = q_block - (q_start // BLOCK_Q + seq)
    if q_block_in_seq * BLOCK_Q >= q_len:
        return
    prefix_len = tl.load(SEQ_LENS + seq) - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block_in_seq * BLOCK_Q + rows // GROUP  # [BLOCK_M] new-token index
    head = kv_head * GROUP + rows % GROUP  # [BLOCK_M] query head
    row_valid = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = tl.where(row_valid, prefix_len + q_idx, -1)  # invalid rows: q = 0, every key hidden
    offs_d = tl.arange(0, HEAD_DIM)
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(Q + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_valid[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]

    first_pos = prefix_len + q_block_in_seq * BLOCK_Q
    key_end = prefix_len + tl.minimum((q_block_in_seq + 1) * BLOCK_Q, q_len)
    unmasked_end = (first_pos + 1) // BLOCK_N * BLOCK_N  # keys < this are seen by every row
    block_table = BLOCK_TABLES + seq.to(tl.int64) * stride_bt

    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    # the block ids of tile i + 1 are loaded while tile i is computed: K/V addresses then come
    # from registers, and Triton's pipeliner keeps num_stages - 1 K/V tiles in flight (an
    # address loaded in the same iteration would make it wait for every copy, each tile)
    blocks = _tile_blocks(block_table, 0, key_end, USE_TMA, BLOCK_SIZE, BLOCK_N)
    for start_n in range(0, unmasked_end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        acc, m_i, l_i = _hopper_tile(
            acc, m_i, l_i, q, K_CACHE, V_CACHE, blocks, kv_head, start_n, q_pos, key_end,
            offs_d, stride_cb, stride_cs, stride_ch, qk_scale, False, USE_TMA, BLOCK_SIZE,
            BLOCK_N, HEAD_DIM, DOT_PRECISION)
        blocks = _tile_blocks(block_table, start_n + BLOCK_N, key_end, USE_TMA, BLOCK_SIZE,
                              BLOCK_N)
    for start_n in range(unmasked_end, key_end, BLOCK_N):  # the causal diagonal
        start_n = tl.multiple_of(start_n, BLOCK_N)
        acc, m_i, l_i = _hopper_tile(
            acc, m_i, l_i, q, K_CACHE, V_CACHE, blocks, kv_head, start_n, q_pos, key_end,
            offs_d, stride_cb, stride_cs, stride_ch, qk_scale, True, USE_TMA, BLOCK_SIZE,
            BLOCK_N, HEAD_DIM, DOT_PRECISION)
        blocks = _tile_blocks(block_table, start_n + BLOCK_N, key_end, USE_TMA, BLOCK_SIZE,
                              BLOCK_N)

    out = acc / l_i[:, None]  # l_i >= 1 for every valid row: its max key weighs exp2(0)
    tl.store(OUT + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(OUT.dtype.element_ty), mask=row_valid[:, None])


def hopper_supports(q: torch.Tensor, sliding_window: int | None, softcap: float | None) -> bool:
    """What this kernel covers: fp16/bf16, head_dim 64 or 128, no window, no soft-cap."""
    return (q.dtype in (torch.float16, torch.bfloat16) and q.shape[2] in (64, 128)
            and sliding_window is None and softcap is None)


def _kv_operand(cache: torch.Tensor, use_tma: bool, block_n: int):
    """The cache as the kernel reads it: a TMA descriptor over [num_blocks, block_size, Hk * D]
    (each row a slot, heads side by side), or the tensor itself for pointer loads."""
    if not use_tma:
        return cache
    from triton.tools.tensor_descriptor import TensorDescriptor

    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    return TensorDescriptor(cache, [num_blocks, block_size, num_kv_heads * head_dim],
                            [cache.stride(0), cache.stride(1), 1], [1, block_n, head_dim])


def hopper_attention_triton(
    q: torch.Tensor,  # [T, Hq, D], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hk, D]
    v_cache: torch.Tensor,  # same shape and strides as k_cache
    block_tables: torch.Tensor,  # [B, max_blocks], last dim contiguous
    seq_lens: torch.Tensor,  # [B]
    query_start_loc: torch.Tensor,  # [B + 1]
    scale: float,
    out: torch.Tensor,  # [T, Hq, D]
    *,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    tma: bool,
    maxnreg: int | None,
) -> torch.Tensor:
    """Launch the Hopper kernel (arguments checked by attention.paged_attention). tma: load K/V
    by TMA where the layout allows it (see the module docstring)."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    block_m = max(block_m, next_power_of_2(group))
    block_q = block_m // group
    use_tma = (tma and block_size % block_n == 0
               and k_cache.stride(1) == num_kv_heads * head_dim and k_cache.stride(2) == head_dim
               and k_cache.stride(0) * k_cache.element_size() % 16 == 0)  # TMA's stride unit
    grid = (num_tokens // block_q + seq_lens.shape[0], num_kv_heads)
    _hopper_attention_kernel[grid](
        q, _kv_operand(k_cache, use_tma, block_n), _kv_operand(v_cache, use_tma, block_n), out,
        block_tables, seq_lens, query_start_loc,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        seq_lens.shape[0], scale * LOG2E,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_Q=block_q,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, USE_TMA=use_tma,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg,
    )
    return out
