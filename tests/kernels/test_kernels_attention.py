"""Paged attention under the Triton interpreter: kernels vs the torch reference, and the reference
vs a dense float64 softmax built from the unpaged keys and values.

On a machine without a GPU, tinypaged.kernels builds its kernels for the interpreter by itself
(kernels/_triton.py), so the launchers `*_triton` run on CPU tensors without TRITON_INTERPRET.
"""

import inspect

import pytest
import torch
from helpers.attention import Batch, assert_close

from tinypaged.kernels import attention
from tinypaged.kernels.attention import paged_attention, paged_attention_ref, paged_attention_triton
from tinypaged.kernels.attention_decode import decode_attention_triton
from tinypaged.kernels.attention_gluon import gluon_attention
from tinypaged.kernels.attention_hopper import hopper_attention_triton
from tinypaged.kernels.attention_varlen import varlen_attention_triton
from tinypaged.models.attention_metadata import AttentionMetadata, as_decodes

# Triton 3.6's interpreter turns loop bounds into ints through 1-element arrays (numpy < 2.4 warns),
# and an empty decode split takes log2(0) = -inf on purpose
pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered in log2"),
]

# (dtype, head_dim, query heads per KV head, block_size, key tile): every value of every axis the
# kernels must handle appears at least once; key tiles smaller, equal and larger than a block
COMBOS = [
    (torch.float32, 64, 1, 16, 32),
    (torch.float16, 128, 3, 32, 16),
    (torch.float16, 64, 8, 16, 64),
    (torch.float32, 128, 8, 32, 32),
]
COMBO_IDS = [f"{str(c[0])[6:]}-d{c[1]}-g{c[2]}-bs{c[3]}-n{c[4]}" for c in COMBOS]


def check_kernel(q_lens, seq_lens, combo, **kwargs):
    dtype, head_dim, group, block_size, block_n = combo
    batch = Batch(q_lens, seq_lens, group, head_dim, block_size, dtype)
    config = {"block_n": block_n, "block_m": 64, **kwargs.pop("config", {})}
    out = batch.run(paged_attention_triton, config=config, **kwargs)
    assert out.shape == batch.q.shape and out.dtype == dtype
    kwargs.pop("num_splits", None)
    assert_close(out, batch.run(paged_attention_ref, **kwargs), dtype)


@pytest.mark.parametrize("combo", COMBOS, ids=COMBO_IDS)
def test_prefill(combo):
    check_kernel([1, 17, 40], [1, 17, 40], combo)


@pytest.mark.parametrize("combo", COMBOS, ids=COMBO_IDS)
def test_chunked_prefill_over_cached_prefix(combo):
    check_kernel([9, 16, 1], [40, 50, 33], combo)


@pytest.mark.parametrize("combo", COMBOS, ids=COMBO_IDS)
def test_decode_split_kv(combo):
    # 4 splits: the length-1 sequence leaves 3 of them empty
    check_kernel([1, 1, 1, 1], [1, 16, 33, 70], combo, num_splits=4)


@pytest.mark.parametrize("combo", COMBOS[:2], ids=COMBO_IDS[:2])
def test_decode_one_split(combo):
    check_kernel([1, 1, 1], [1, 33, 70], combo, num_splits=1)


@pytest.mark.parametrize("combo", COMBOS, ids=COMBO_IDS)
def test_mixed_batch(combo):
    # a decode, a prefill and a chunk over a prefix in one launch
    check_kernel([1, 20, 5, 1], [37, 20, 45, 16], combo)


@pytest.mark.parametrize("combo", COMBOS, ids=COMBO_IDS)
def test_verification_batch_as_one_token_decodes(combo):
    # speculative verification (q = 5 new tokens for every sequence, one of them a whole
    # prompt): as_decodes sends each token through the split-KV decode kernel, attending to
    # the keys up to its own position; the output is the reference's over the original batch
    dtype, head_dim, group, block_size, block_n = combo
    q = 5
    batch = Batch([q] * 3, [5, 23, 70], group, head_dim, block_size, dtype)
    md = AttentionMetadata(torch.zeros(3 * q, dtype=torch.int64), batch.query_start_loc,
                           batch.seq_lens, batch.block_tables, max_query_len=q, max_seq_len=70)
    decodes = as_decodes(md, q)
    assert decodes.max_query_len == 1 and decodes.max_seq_len == 70
    assert decodes.seq_lens.tolist() == [*range(1, 6), *range(19, 24), *range(66, 71)]
    assert decodes.query_start_loc.tolist() == list(range(3 * q + 1))
    assert torch.equal(decodes.block_tables[5:10], batch.block_tables[1].expand(5, -1))
    out = paged_attention_triton(
        batch.q, batch.k_cache, batch.v_cache, decodes.block_tables, decodes.seq_lens,
        decodes.query_start_loc, batch.scale, max_query_len=1, max_seq_len=70, num_splits=3,
        config={"block_n": block_n})
    assert_close(out, batch.run(paged_attention_ref), dtype)


# windows of 1 token, smaller than a key tile, between tiles, equal to the longest context, larger
WINDOWS = [1, 5, 16, 23, 40, 1000]


@pytest.mark.parametrize("window", WINDOWS)
def test_sliding_window_prefill_and_chunks(window):
    # a decode, a prefill, and chunks over a cached prefix in one launch, several query blocks
    # per sequence (block_m 64); each window under another dtype / head / tile combination
    combo = COMBOS[WINDOWS.index(window) % len(COMBOS)]
    check_kernel([1, 20, 40, 9], [37, 20, 40, 45], combo, sliding_window=window)


# Every window once, each split count with the windows that meet a tile edge (1: one key; 16:
# one tile; 40: the longest context) and the others alternating, not the full cross product:
# how the window skips tiles inside a split is test_tiles_outside_the_window_are_not_read's.
WINDOW_SPLITS = [(1, 1), (1, 3), (5, 3), (16, 1), (16, 3), (23, 1), (40, 3), (1000, 1)]


@pytest.mark.parametrize("window, num_splits", WINDOW_SPLITS)
def test_sliding_window_decode(window, num_splits):
    combo = COMBOS[WINDOWS.index(window) % len(COMBOS)]
    check_kernel([1, 1, 1, 1], [1, 16, 40, 70], combo, num_splits=num_splits,
                 sliding_window=window)


@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_tiles_outside_the_window_are_not_read(num_splits):
    q_lens = [1, 1] if num_splits else [5, 1]
    batch = Batch(q_lens, [70, 45], 2, 64, 16, torch.float32)
    window, block_n = 20, 16
    batch.poison_before_windows(window, block_n)
    out = batch.run(paged_attention_triton, num_splits=num_splits,
                    config={"block_n": block_n, "block_m": 16}, sliding_window=window)
    assert_close(out, batch.dense_float64(sliding_window=window), torch.float32)


@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_softcap_with_and_without_window(num_splits):
    # scores scaled up so that the cap (tanh saturating) changes the result
    q_lens = [1, 1, 1] if num_splits else [3, 17, 1]
    for window in (None, 9):
        batch = Batch(q_lens, [20, 17, 50], 2, 64, 16, torch.float32)
        batch.scale = 2.0
        kwargs = {"softcap": 3.0, "sliding_window": window}
        out = batch.run(paged_attention_triton, num_splits=num_splits,
                        config={"block_n": 16, "block_m": 16}, **kwargs)
        dense = batch.dense_float64(**kwargs)
        assert_close(out, dense, torch.float32)
        assert (dense - batch.dense_float64(sliding_window=window)).abs().max() > 0.1


@pytest.mark.parametrize("window", [1, 7, 40])
def test_reference_window_matches_dense_float64(window):
    batch = Batch([9, 1, 4], [40, 33, 4], 2, 64, 16, torch.float32)
    torch.testing.assert_close(batch.run(paged_attention_ref, sliding_window=window).double(),
                               batch.dense_float64(sliding_window=window), atol=1e-5, rtol=1e-5)


def test_mixed_batch_default_tiles_and_splits():
    batch = Batch([1, 20, 1], [37, 20, 16], 4, 64, 16, torch.float32)
    assert_close(batch.run(paged_attention_triton), batch.run(paged_attention_ref), torch.float32)
    decode = Batch([1, 1], [37, 300], 4, 64, 16, torch.float32)
    assert_close(decode.run(paged_attention_triton), decode.run(paged_attention_ref), torch.float32)


def test_sequence_without_new_tokens_is_skipped():
    # varlen and decode paths: a sequence with 0 new tokens writes nothing, others are unharmed
    for q_lens, seq_lens in (([3, 0, 2], [3, 16, 20]), ([1, 0, 1], [5, 9, 17])):
        batch = Batch(q_lens, seq_lens, 2, 64, 16, torch.float32)
        out = batch.run(paged_attention_triton, num_splits=2, config={"block_n": 16})
        assert_close(out, batch.dense_float64(), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_empty_context_gives_zeros_not_nan(num_splits):
    # a padding entry of a CUDA-graph decode batch: one query, no keys at all
    batch = Batch([1, 1, 1], [20, 0, 7], 2, 64, 16, torch.float32)
    out = batch.run(paged_attention_triton, num_splits=num_splits, config={"block_n": 16})
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_close(out[[0, 2]], batch.dense_float64()[[0, 2]], torch.float32)


@pytest.mark.parametrize("q_lens,seq_lens", [([1, 17, 40], [1, 17, 40]), ([9, 1, 4], [40, 33, 4])])
@pytest.mark.parametrize("group", [1, 3])
def test_reference_matches_dense_float64(q_lens, seq_lens, group):
    batch = Batch(q_lens, seq_lens, group, 64, 16, torch.float32)
    torch.testing.assert_close(batch.run(paged_attention_ref).double(), batch.dense_float64(),
                               atol=1e-5, rtol=1e-5)


def test_no_host_sync_when_maxima_are_passed(monkeypatch):
    batch = Batch([1, 1], [20, 33], 2, 64, 16, torch.float32)
    expected = batch.run(paged_attention_ref)

    def sync(*args, **kwargs):
        raise AssertionError("host sync in the Triton launcher")

    monkeypatch.setattr(torch.Tensor, "item", sync)
    monkeypatch.setattr(torch.Tensor, "tolist", sync)
    out = torch.empty_like(batch.q)
    result = batch.run(paged_attention_triton, out=out, config={"block_n": 16})
    assert result is out
    monkeypatch.undo()
    assert_close(out, expected, torch.float32)


def test_public_op_dispatches_to_triton_under_interpreter(monkeypatch):
    batch = Batch([3, 1], [3, 20], 2, 64, 16, torch.float32)
    calls = []
    real = attention.paged_attention_triton
    monkeypatch.setattr(attention, "paged_attention_triton",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ref = batch.run(paged_attention)
    assert calls == []
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert_close(batch.run(paged_attention, config={"block_n": 16}), ref, torch.float32)
    assert calls == [1]


def replace(args, index, value):
    return args[:index] + (value,) + args[index + 1:]


def test_bad_arguments_name_the_argument():
    batch = Batch([2, 1], [2, 20], 2, 64, 16, torch.float32)
    args = batch.args()
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, _ = args
    cases = [
        ("q", replace(args, 0, q[:, 0])),
        ("q", replace(args, 0, q.to(torch.int32))),
        ("k_cache", replace(args, 1, k_cache[..., :32])),
        ("k_cache", replace(args, 1, k_cache.half())),
        ("v_cache", replace(args, 2, v_cache[:, :8])),
        ("multiple", replace(args, 0, q[:, :3])),  # 3 query heads, 2 KV heads
        ("block_tables", replace(args, 3, block_tables[:1])),
        ("block_tables", replace(args, 3, block_tables.float())),
        ("seq_lens", replace(args, 4, seq_lens.float())),
        ("query_start_loc", replace(args, 5, query_start_loc[:2])),
    ]
    for name, bad in cases:
        with pytest.raises(ValueError, match=name):
            paged_attention(*bad)
    with pytest.raises(ValueError, match="out"):
        paged_attention(*args, out=torch.empty_like(q).half())
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention(*args, num_splits=0)
    with pytest.raises(ValueError, match="config"):
        paged_attention(*args, config={"blockm": 64})


@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_large_logits_stay_finite(num_splits):
    # scores of a few hundred: 2^score overflows fp32 (past ~2^128) unless every exponential is
    # taken relative to a max, within a tile, across tiles and across the split-KV partials
    q_lens = [1, 1, 1] if num_splits else [3, 17, 1]
    batch = Batch(q_lens, [20, 17, 300], 2, 64, 16, torch.float32)
    batch.scale = 40.0  # |q . k| ~ 8, so scores ~ 300 (base e) and lse ~ 450 (base 2)
    dense = batch.dense_float64()
    assert (batch.run(paged_attention_ref).double() - dense).abs().max() < 1e-4
    out = batch.run(paged_attention_triton, num_splits=num_splits,
                    config={"block_n": 16, "block_m": 16})
    assert_close(out, dense, torch.float32)


# (dtype, head_dim, group, block_size, rows, key tile, TMA): block 16 with 32-key tiles gathers
# K/V by pointer loads; tiles that fit in a block go through the TMA descriptor (the interpreter
# runs both); a group of 3 leaves 2 of the 32 rows empty
HOPPER_COMBOS = [
    (torch.float16, 64, 4, 16, 64, 32, False),
    (torch.float32, 128, 3, 32, 32, 16, True),
    (torch.float16, 64, 1, 16, 32, 16, True),
]


@pytest.mark.parametrize("combo", HOPPER_COMBOS, ids=lambda c: f"{str(c[0])[6:]}-g{c[2]}-tma{c[6]}")
def test_hopper_kernel_varlen_prefix_and_partial_blocks(combo):
    # the sm_90 prefill kernel, interpreted: a prefill, a chunk whose queries start inside a
    # cached prefix, a one-token chunk, a sequence of several query blocks; every sequence ends
    # inside a cache block (unowned slots hold NaN)
    dtype, head_dim, group, block_size, block_m, block_n, tma = combo
    batch = Batch([20, 9, 1, 45], [20, 40, 33, 45], group, head_dim, block_size, dtype)
    config = {**attention.HOPPER_CONFIG, "block_m": block_m, "block_n": block_n, "tma": tma}
    out = hopper_attention_triton(*batch.args(), torch.empty_like(batch.q), **config)
    assert_close(out, batch.dense_float64(), dtype)


def test_hopper_kernel_large_logits_stay_finite():
    # as test_large_logits_stay_finite: scores of a few hundred over 19 key tiles
    batch = Batch([3, 17, 1], [20, 17, 300], 2, 64, 16, torch.float32)
    batch.scale = 40.0
    config = {**attention.HOPPER_CONFIG, "block_m": 16, "block_n": 16, "tma": False}
    out = hopper_attention_triton(*batch.args(), torch.empty_like(batch.q), **config)
    assert_close(out, batch.dense_float64(), torch.float32)


def test_tile_configs_have_one_source():
    # the launchers take every tile parameter from attention.py's configs: no defaults of their own
    for launcher, config in ((varlen_attention_triton, attention.VARLEN_CONFIG),
                             (decode_attention_triton, attention.DECODE_CONFIG),
                             (hopper_attention_triton, attention.HOPPER_CONFIG),
                             (gluon_attention, attention.GLUON_CONFIG)):
        params = inspect.signature(launcher).parameters
        assert all(params[key].default is inspect.Parameter.empty for key in config), launcher
