"""Prefill attention for Hopper (sm_90) in Gluon: FlashAttention-3's producer/consumer pipeline.

The math is attention_hopper.py's (see attention.py for the contract): one program owns
BLOCK_Q new tokens of one sequence times the GROUP query heads of KV head `program_id(1)`,
packed into BLOCK_M = 128 rows (BLOCK_Q = 128 // GROUP; row r: token r // GROUP, head
r % GROUP; rows from BLOCK_Q * GROUP on are idle when GROUP does not divide 128), and
streams its keys 0 .. key_end - 1 in tiles of BLOCK_N with the online softmax in base 2
(online_softmax.py): with s = q . k raw and c = scale * log2(e),

    m' = max(m, max_j s_j c),  p_j = exp2(s_j c - m'),  alpha = exp2(m - m'),
    l' = alpha l + sum_j p_j,  O' = alpha O + p @ V,  out = O / l.

Only the tiles that cross the causal diagonal are masked (key p > query position: score
-1e6, exp2 gives 0; each valid row sees key 0, so no row is empty and there is no NaN guard).

What Gluon adds over the Triton kernel is explicit control of the Hopper machinery
(FlashAttention-3, Shah et al. 2024, arXiv 2407.08608):

- Warp specialization: a producer partition of ONE warp (24 registers) only issues TMA copies;
  two consumer warpgroups of 64 rows each (240 registers) only run wgmma and the softmax, as
  one 8-warp partition or as two 4-warp partitions, optionally taking turns at the tensor
  cores (MODES below). They meet at mbarriers around a ring of STAGES K and STAGES V buffers:

      producer, tile t, stage s = t % STAGES, n = t // STAGES:
          wait k_empty[s] (parity n ^ 1: a fresh barrier passes parity 1 at once)
          expect k_ready[s] <- BLOCK_N * D * 2 bytes;  TMA K rows -> k_smem[s]
          the same for V with v_empty / v_ready
      consumer: wait k_ready[s] (parity n) ... arrive k_empty[s] once its wgmma read it
      (k_empty / v_empty count one arrive per consumer partition).

- Paged K/V by TMA with 16-token blocks: the cache is seen as 2-D [num_blocks * block_size,
  Hk * D]; a tile of BLOCK_N keys spans BLOCK_N / block_size cache blocks, so the producer
  issues one [block_size, 64] box per block and per half of D (row block_id * block_size,
  column kv_head * D + half * 64) into a row slice of the tile's buffer, all counted on one
  mbarrier. D is split in halves of 64 (128 bytes) because that is the width of a 128-byte
  swizzle: a row slice of a [BLOCK_N, 64] buffer is then a plain offset (whole 8-row swizzle
  atoms), where a [BLOCK_N, 128] buffer interleaves two 64-column panels. Slices past key_end
  point past the last row, and TMA fills them with zeros. In the block that holds seq_len, the
  slots past it were never written (an uninitialized cache may hold NaN, and 0 * NaN = NaN in
  P @ V): K's NaN drops out of the masked scores (a `where`), and the consumer zeroes those V
  rows in shared memory before the last P @ V (a TMA box cannot be narrower than the 8-row
  swizzle atom, so the producer cannot skip single rows).

- wgmma with the intra-warpgroup overlap of FA3: QK^T of tile t is issued, then P @ V of tile
  t - 1, and the softmax of tile t runs while P @ V is still in the tensor cores:

      S_t = Q K_t^T (async) ; O += P_{t-1} V_{t-1} (async) ; wait S_t ; softmax(S_t) -> P_t
      wait O ; O *= alpha_t

  Each consumer stages its Q rows once in shared memory (two [rows, 64] halves: QK^T is two
  chained wgmmas over K = 64), while the producer's first copies are in flight; P goes to the
  second wgmma from registers, and O is one [rows, D] fp32 accumulator: a stage's two V halves
  are adjacent panels of one [BLOCK_N, D] tile, so P @ V is a single wgmma of N = D.

- Launch order: program w takes KV head w // (HEAD_GROUP * n) * HEAD_GROUP + w % HEAD_GROUP
  and query tile n - 1 - (w % (HEAD_GROUP * n)) // HEAD_GROUP of the n tiles: the hardware
  starts programs in order of w, so the heaviest tiles (the last of a sequence) start first
  and the light ones fill the end of the grid, while HEAD_GROUP KV heads at a time keep their
  keys and values in L2 for the tiles that share them.

Only D = 128 with q and cache in fp16/bf16, no window or soft-cap (gluon_supports); the rest
stays on attention_hopper.py / attention_varlen.py. Gluon does not run in the interpreter:
tests compile it for sm_90 on a CPU and replay its schedule in torch
(tests/kernels/test_attention_gluon.py); benchmarks/prefill_gluon.py checks it on an H200.
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import HAS_TRITON, tl
from tinypaged.kernels.attention_varlen import LOG2E

try:  # Gluon ships inside triton (3.5+); without it the module still imports, unsupported
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    HAS_GLUON = HAS_TRITON
    gluon_jit = gluon.jit
except ImportError:
    HAS_GLUON = False
    gluon_jit = lambda fn=None, **kwargs: fn if fn is not None else (lambda f: f)  # noqa: E731

HALF_COLS = 64  # columns of one D half: 64 fp16/bf16 = 128 bytes, the 128-byte swizzle's width
HALF = tl.constexpr(HALF_COLS) if HAS_GLUON else HALF_COLS  # the same, for the kernels
# How the two consumer warpgroups of a program's 128 rows run (`mode`):
#   wide:     one 8-warp consumer partition; its wgmmas span both warpgroups, which therefore
#             move in step (every mbarrier arrive syncs the partition)
#   split:    two 4-warp consumer partitions of 64 rows each, sharing the K/V ring (each empty
#             barrier waits for both); they drift apart, so one's softmax can meet the other's
#             MMAs
#   pingpong: split, with FA3's ordering: a warpgroup waits for its turn before issuing a
#             tile's wgmmas and hands the turn over once they are issued, so the tensor cores
#             run one warpgroup's GEMMs while the other does its softmax
MODES = ("wide", "split", "pingpong")
# (block_m, block_n, num_stages, mode, head_group) the benchmark times
# (benchmarks/prefill_gluon.py)
GLUON_CONFIGS = [(128, 128, 2, "wide", 4), (128, 64, 2, "wide", 4), (128, 128, 2, "split", 4),
                 (128, 128, 2, "pingpong", 4), (128, 64, 2, "pingpong", 4),
                 (128, 64, 3, "pingpong", 4), (128, 128, 3, "pingpong", 4),
                 (128, 128, 3, "pingpong", 1), (128, 128, 3, "pingpong", 2),
                 (128, 128, 3, "pingpong", 8)]
CONFIG_KEYS = ("block_m", "block_n", "num_stages", "mode", "head_group")


@gluon_jit
def _find_sequence(QUERY_START_LOC, num_seqs, q_block, BLOCK_Q: gl.constexpr,
                   num_warps: gl.constexpr):
    """The last b with query_start_loc[b] // BLOCK_Q + b <= q_block: as that value grows with
    b, the count of such b, less one. Counted 32 * num_warps entries a load, so a batch of up
    to that many sequences costs one memory latency (a binary search waits for log2(B) loads
    one after the other, before anything else can start)."""
    CHUNK: gl.constexpr = 32 * num_warps
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    count = 0
    for base in range(0, num_seqs, CHUNK):
        b = base + gl.arange(0, CHUNK, layout=layout)
        first = gl.load(QUERY_START_LOC + b, mask=b < num_seqs, other=0) // BLOCK_Q + b
        count += gl.sum(((first <= q_block) & (b < num_seqs)).to(gl.int32), axis=0)
    return count - 1


@gluon_jit
def _load_q(Q, q_smem, q_start, q_begin, q_len, kv_head, stride_qt, stride_qh,
            C: gl.constexpr, GROUP: gl.constexpr, ROWS: gl.constexpr, BLOCK_Q: gl.constexpr,
            WARPS: gl.constexpr):
    """Gather consumer C's ROWS query rows (D wide) into its halves q_smem[2 C], q_smem[2 C + 1]
    [ROWS, HALF] (rows past the query: 0), ready for its wgmmas. Each consumer loads its own
    rows while the producer's first K/V copies are in flight."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, layout))
    rows = C * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    q_idx = q_begin + rows // GROUP  # [ROWS] new-token index in the sequence
    valid = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    head = kv_head * GROUP + rows % GROUP
    offs = (q_start + q_idx).to(gl.int64) * stride_qt + head * stride_qh
    for half in gl.static_range(2):
        ptrs = Q + gl.expand_dims(offs, 1) + gl.expand_dims(cols + half * HALF, 0)
        q_smem.index(2 * C + half).store(gl.load(ptrs, mask=gl.expand_dims(valid, 1), other=0.0))
    fence_async_shared()  # the generic-proxy stores, before the wgmma (async proxy) reads
    gl.thread_barrier()  # every warp of the partition has written its rows


@gluon_jit
def _producer(kv_desc_k, kv_desc_v, k_smem, v_smem, k_ready, k_empty, v_ready,
              v_empty, block_table, kv_col, key_end, num_tiles, num_rows,
              BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr, STAGES: gl.constexpr):
    """One warp: TMA every K/V tile of the program into the ring (see the module docstring).
    k_smem / v_smem [STAGES * 2, BLOCK_N, HALF]: stage s, half h at index 2 * s + h."""
    tile_bytes: gl.constexpr = BLOCK_N * 2 * HALF * 2  # fp16 / bf16
    last_block = (key_end - 1) // BLOCK_SIZE  # block-table entries past it are not read
    for t in range(num_tiles):
        stage = t % STAGES
        phase = (t // STAGES) & 1
        mbarrier.wait(k_empty.index(stage), phase ^ 1)
        mbarrier.expect(k_ready.index(stage), tile_bytes)
        for j in gl.static_range(BLOCK_N // BLOCK_SIZE):
            idx = t * (BLOCK_N // BLOCK_SIZE) + j
            block = gl.load(block_table + gl.minimum(idx, last_block))
            row = gl.where(idx <= last_block, block * BLOCK_SIZE, num_rows)  # past: zeros
            for half in gl.static_range(2):
                tma.async_copy_global_to_shared(
                    kv_desc_k, [row, kv_col + half * HALF], k_ready.index(stage),
                    k_smem.index(2 * stage + half).slice(j * BLOCK_SIZE, BLOCK_SIZE))
        mbarrier.wait(v_empty.index(stage), phase ^ 1)
        mbarrier.expect(v_ready.index(stage), tile_bytes)
        for j in gl.static_range(BLOCK_N // BLOCK_SIZE):
            idx = t * (BLOCK_N // BLOCK_SIZE) + j
            block = gl.load(block_table + gl.minimum(idx, last_block))
            row = gl.where(idx <= last_block, block * BLOCK_SIZE, num_rows)
            for half in gl.static_range(2):
                tma.async_copy_global_to_shared(
                    kv_desc_v, [row, kv_col + half * HALF], v_ready.index(stage),
                    v_smem.index(2 * stage + half).slice(j * BLOCK_SIZE, BLOCK_SIZE))


@gluon_jit
def _softmax(s, m_i, l_i, q_pos, start_n, qk_scale, MASKED: gl.constexpr,
             BLOCK_N: gl.constexpr):
    """One online-softmax step on raw scores s [BLOCK_M, BLOCK_N] (fp32, the S wgmma layout);
    returns (p, alpha, m_new, l_new), row vectors in SliceLayout(1, s's layout)."""
    if MASKED:
        k_pos = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        visible = gl.expand_dims(k_pos, 0) <= gl.expand_dims(q_pos, 1)
        s = gl.where(visible, s * qk_scale, -1.0e6)  # where, not +: a NaN past seq_len drops
        m_new = gl.maximum(m_i, gl.max(s, 1))
        p = gl.exp2(s - gl.expand_dims(m_new, 1))
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)  # 0 on the first tile (m_i = -inf)
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_new


@gluon_jit
def _softmax_tile(s, m_i, l_i, q_pos, start_n, unmasked_end, qk_scale, BLOCK_N: gl.constexpr):
    """_softmax, masked only when the tile reaches past unmasked_end (the causal diagonal)."""
    if start_n + BLOCK_N > unmasked_end:
        p, alpha, m_new, l_new = _softmax(s, m_i, l_i, q_pos, start_n, qk_scale, True, BLOCK_N)
    else:
        p, alpha, m_new, l_new = _softmax(s, m_i, l_i, q_pos, start_n, qk_scale, False, BLOCK_N)
    return p, alpha, m_new, l_new


@gluon_jit
def _zero_rows_past(v_smem, stage, n_valid, BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
    """Zero rows n_valid .. BLOCK_N - 1 of the V tile in `stage`: its block that holds seq_len
    was copied whole, and slots past seq_len were never written (an uninitialized cache may hold
    NaN there, and P @ V would spread it even with p = 0)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    keep = gl.expand_dims(rows < n_valid, 1)
    for half in gl.static_range(2):
        buf = v_smem.index(2 * stage + half)
        buf.store(gl.where(keep, buf.load(layout), 0.0).to(v_smem.dtype))
    fence_async_shared()  # the generic-proxy stores, before the wgmma (async proxy) reads
    gl.thread_barrier()  # every warp of the partition has written its rows before the MMA


@gluon_jit
def _qk(q_smem, k_smem, stage, s, C: gl.constexpr):
    """Issue S = Q K^T of consumer C for the tile in `stage` (async): two chained wgmmas over
    the D halves."""
    s = warpgroup_mma(q_smem.index(2 * C), k_smem.index(2 * stage).permute((1, 0)), s,
                      use_acc=False, is_async=True)
    return warpgroup_mma(q_smem.index(2 * C + 1), k_smem.index(2 * stage + 1).permute((1, 0)),
                         s, is_async=True)


@gluon_jit
def _take_turn(turn, n, C: gl.constexpr, PINGPONG: gl.constexpr):
    """Pingpong: before its n-th set of wgmmas (n = 0 .. num_tiles) consumer 0 waits for
    consumer 1's set n - 1 to be issued (n = 0: a fresh barrier passes parity 1 at once), and
    consumer 1 for consumer 0's set n. turn [2, 1]: turn[c] is c's; each completes once a set."""
    if PINGPONG:
        mbarrier.wait(turn.index(C), (n & 1) ^ (1 - C))


@gluon_jit
def _pass_turn(turn, C: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - C), count=1)


@gluon_jit
def _consumer(Q, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turn, OUT,
              q_start, q_begin, q_len, prefix_len, seq_len, key_end, kv_head, stride_qt,
              stride_qh, stride_ot, stride_oh, num_tiles, unmasked_end, qk_scale,
              C: gl.constexpr, ROWS: gl.constexpr, PINGPONG: gl.constexpr,
              GROUP: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr,
              BLOCK_SIZE: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr):
    """Consumer C (rows C * ROWS .. + ROWS - 1 of the program, on WARPS warps): its Q rows,
    then QK^T, softmax, PV per tile, then the store."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 2 * HALF, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    dtype: gl.constexpr = q_smem.dtype

    rows = C * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    q_idx = q_begin + rows // GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = gl.where(row_valid, prefix_len + q_idx, -1)  # [ROWS]; -1: every key hidden

    s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    o = gl.zeros([ROWS, 2 * HALF], gl.float32, o_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    # A stage's two [BLOCK_N, HALF] V halves lie one after the other: together they are the
    # [BLOCK_N, D] tile of the same 128-byte-swizzled layout (D in panels of HALF columns, as a
    # TMA copy wider than the swizzle writes them), so P @ V is one wgmma of N = D.
    v_tiles = v_smem._reinterpret(dtype, [STAGES, BLOCK_N, 2 * HALF], v_smem.layout)
    _load_q(Q, q_smem, q_start, q_begin, q_len, kv_head, stride_qt, stride_qh, C, GROUP, ROWS,
            BLOCK_Q, WARPS)

    # tile 0: S alone (nothing to multiply V with yet)
    _take_turn(turn, 0, C, PINGPONG)
    mbarrier.wait(k_ready.index(0), 0)
    s = _qk(q_smem, k_smem, 0, s, C)
    _pass_turn(turn, C, PINGPONG)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    mbarrier.arrive(k_empty.index(0), count=1)
    p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, q_pos, 0, unmasked_end, qk_scale, BLOCK_N)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    for t in range(1, num_tiles):
        stage = t % STAGES
        prev = (t - 1) % STAGES
        _take_turn(turn, t, C, PINGPONG)
        mbarrier.wait(k_ready.index(stage), (t // STAGES) & 1)
        s = _qk(q_smem, k_smem, stage, s, C)  # S_t, in flight
        mbarrier.wait(v_ready.index(prev), ((t - 1) // STAGES) & 1)
        o = warpgroup_mma(p_op, v_tiles.index(prev), o, is_async=True)  # O += P_{t-1} V
        _pass_turn(turn, C, PINGPONG)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))  # QK^T done, PV still running
        mbarrier.arrive(k_empty.index(stage), count=1)
        p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, q_pos, t * BLOCK_N, unmasked_end,
                                           qk_scale, BLOCK_N)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o, ))
        mbarrier.arrive(v_empty.index(prev), count=1)
        o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
    last = (num_tiles - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((num_tiles - 1) // STAGES) & 1)
    if (seq_len % BLOCK_SIZE != 0) & ((key_end - 1) // BLOCK_SIZE == (seq_len - 1) // BLOCK_SIZE):
        # (with two consumers both write the same zeros: the values never differ)
        _zero_rows_past(v_smem, last, key_end - (num_tiles - 1) * BLOCK_N, BLOCK_N, WARPS)
    _take_turn(turn, num_tiles, C, PINGPONG)
    o = warpgroup_mma(p_op, v_tiles.index(last), o, is_async=True)
    _pass_turn(turn, C, PINGPONG)
    o = warpgroup_mma_wait(num_outstanding=0, deps=(o, ))
    mbarrier.arrive(v_empty.index(last), count=1)

    # out = O / l (l >= 1 for every valid row: its max key weighs exp2(0))
    inv_l = gl.expand_dims(gl.convert_layout(1.0 / l_i, gl.SliceLayout(1, o_layout)), 1)
    o_rows = C * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    o_cols = gl.arange(0, 2 * HALF, layout=gl.SliceLayout(0, o_layout))
    o_idx = q_begin + o_rows // GROUP
    o_valid = gl.expand_dims((o_rows < BLOCK_Q * GROUP) & (o_idx < q_len), 1)
    head = kv_head * GROUP + o_rows % GROUP
    base = OUT + gl.expand_dims((q_start + o_idx).to(gl.int64) * stride_ot + head * stride_oh, 1)
    gl.store(base + gl.expand_dims(o_cols, 0), (o * inv_l).to(dtype), mask=o_valid)


@gluon_jit(do_not_specialize=("num_seqs", "stride_bt", "num_rows", "num_q_blocks"))
def _gluon_attention_kernel(
    Q, kv_desc_k, kv_desc_v, OUT, BLOCK_TABLES, SEQ_LENS, QUERY_START_LOC,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    num_seqs, num_rows, num_q_blocks, qk_scale,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_GROUP: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
    PINGPONG: gl.constexpr, num_warps: gl.constexpr,
):
    gl.static_assert(HEAD_DIM == 2 * HALF)
    gl.static_assert(num_warps * 16 * CONSUMERS == BLOCK_M)  # 16 rows a warp, as wgmma has
    # Program w's work: KV heads are taken HEAD_GROUP at a time (programs run in launch order);
    # inside a group, query tile by query tile from the last (heaviest first, so that the
    # light ones fill the end of the grid), every KV head of the group on the same tile (the
    # group's K/V stays in L2 while its tiles run).
    w = gl.program_id(0)
    kv_head = w // (HEAD_GROUP * num_q_blocks) * HEAD_GROUP + w % HEAD_GROUP
    q_block = num_q_blocks - 1 - w % (HEAD_GROUP * num_q_blocks) // HEAD_GROUP
    seq = _find_sequence(QUERY_START_LOC, num_seqs, q_block, BLOCK_Q, num_warps)
    q_start = gl.load(QUERY_START_LOC + seq)
    q_len = gl.load(QUERY_START_LOC + seq + 1) - q_start
    q_begin = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first new token of the tile
    if q_begin >= q_len:
        return
    seq_len = gl.load(SEQ_LENS + seq)
    prefix_len = seq_len - q_len
    key_end = prefix_len + gl.minimum(q_begin + BLOCK_Q, q_len)  # keys < this may be seen
    unmasked_end = (prefix_len + q_begin + 1) // BLOCK_N * BLOCK_N  # seen by every row
    num_tiles = gl.cdiv(key_end, BLOCK_N)
    block_table = BLOCK_TABLES + seq.to(gl.int64) * stride_bt

    ROWS: gl.constexpr = BLOCK_M // CONSUMERS
    dtype: gl.constexpr = Q.dtype.element_ty
    smem_layout: gl.constexpr = kv_desc_k.layout  # NVMMA, 128-byte swizzle, [*, HALF] tiles
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS * 2, ROWS, HALF], smem_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES * 2, BLOCK_N, HALF], smem_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES * 2, BLOCK_N, HALF], smem_layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)  # every consumer has read the tile
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    fence_async_shared()  # the barriers' init, before TMA and wgmma see them
    gl.thread_barrier()

    # (the partitions' argument tuples are written out: a jitted tuple cannot hold a function)
    if CONSUMERS == 1:  # wide: the default partition's 8 warps are the consumer
        gl.warp_specialize([
            (_consumer, (Q, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turn,
                         OUT, q_start, q_begin, q_len, prefix_len, seq_len, key_end, kv_head,
                         stride_qt, stride_qh, stride_ot, stride_oh, num_tiles, unmasked_end,
                         qk_scale, 0, ROWS, False, GROUP, BLOCK_Q, BLOCK_N, BLOCK_SIZE,
                         STAGES, num_warps)),
            (_producer, (kv_desc_k, kv_desc_v, k_smem, v_smem, k_ready, k_empty, v_ready,
                         v_empty, block_table, kv_head * HEAD_DIM, key_end, num_tiles,
                         num_rows, BLOCK_N, BLOCK_SIZE, STAGES)),
        ], [1], [24])
    else:  # split / pingpong: 4 warps each, the default partition is consumer 0
        gl.warp_specialize([
            (_consumer, (Q, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turn,
                         OUT, q_start, q_begin, q_len, prefix_len, seq_len, key_end, kv_head,
                         stride_qt, stride_qh, stride_ot, stride_oh, num_tiles, unmasked_end,
                         qk_scale, 0, ROWS, PINGPONG, GROUP, BLOCK_Q, BLOCK_N, BLOCK_SIZE,
                         STAGES, num_warps)),
            (_consumer, (Q, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turn,
                         OUT, q_start, q_begin, q_len, prefix_len, seq_len, key_end, kv_head,
                         stride_qt, stride_qh, stride_ot, stride_oh, num_tiles, unmasked_end,
                         qk_scale, 1, ROWS, PINGPONG, GROUP, BLOCK_Q, BLOCK_N, BLOCK_SIZE,
                         STAGES, num_warps)),
            (_producer, (kv_desc_k, kv_desc_v, k_smem, v_smem, k_ready, k_empty, v_ready,
                         v_empty, block_table, kv_head * HEAD_DIM, key_end, num_tiles,
                         num_rows, BLOCK_N, BLOCK_SIZE, STAGES)),
        ], [num_warps, 1], [240, 24])


def gluon_supports(q: torch.Tensor, k_cache: torch.Tensor, sliding_window: int | None,
                   softcap: float | None) -> bool:
    """What this kernel covers: fp16/bf16 q and cache, D = 128, no window, no soft-cap, a cache
    whose slots are rows of Hk * D contiguous elements (the 2-D TMA view), block_size dividing
    the key tiles."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    return (HAS_GLUON and q.dtype in (torch.float16, torch.bfloat16) and k_cache.dtype == q.dtype
            and head_dim == 2 * HALF_COLS and sliding_window is None and softcap is None
            and 64 % block_size == 0 and block_size >= 8
            and k_cache.stride(2) == head_dim and k_cache.stride(1) == num_kv_heads * head_dim
            and k_cache.stride(0) == block_size * num_kv_heads * head_dim)


def _descriptor(cache: torch.Tensor):
    """The cache as 2-D [num_blocks * block_size, Hk * D] rows, read in boxes of one block's
    [block_size, HALF] (128-byte swizzle, as the kernel's shared buffers)."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    rows = cache.view(num_blocks * block_size, num_kv_heads * head_dim)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    return TensorDescriptor(rows, list(rows.shape), list(rows.stride()),
                            [block_size, HALF_COLS], layout)


def gluon_attention(
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
    num_stages: int,
    mode: str,
    head_group: int,
) -> torch.Tensor:
    """Launch the Gluon kernel (arguments checked by attention.paged_attention; the shape by
    gluon_supports). block_m 128 rows on two consumer warpgroups run as `mode` says (MODES);
    block_n 64 or 128 keys; num_stages K/V tiles in the ring; head_group KV heads whose tiles
    interleave in launch order (lowered to a divisor of Hk)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    if block_m != 128 or block_n not in (64, 128) or group > block_m or mode not in MODES:
        raise ValueError(f"unsupported Gluon tile: block_m {block_m}, block_n {block_n}, "
                         f"mode {mode!r}, GQA group {group}")
    block_q = block_m // group
    consumers = 1 if mode == "wide" else 2
    head_group = max(d for d in range(1, min(head_group, num_kv_heads) + 1)
                     if num_kv_heads % d == 0)
    k_desc, v_desc = _descriptor(k_cache), _descriptor(v_cache)
    num_q_blocks = num_tokens // block_q + seq_lens.shape[0]  # each sequence's, one spare
    _gluon_attention_kernel[(num_q_blocks * num_kv_heads, )](
        q, k_desc, v_desc, out, block_tables, seq_lens, query_start_loc,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        seq_lens.shape[0], num_blocks * block_size, num_q_blocks, scale * LOG2E,
        GROUP=group, HEAD_DIM=head_dim, HEAD_GROUP=head_group, BLOCK_M=block_m,
        BLOCK_Q=block_q, BLOCK_SIZE=block_size, BLOCK_N=block_n, STAGES=num_stages,
        CONSUMERS=consumers, PINGPONG=mode == "pingpong", num_warps=8 // consumers,
    )
    return out
