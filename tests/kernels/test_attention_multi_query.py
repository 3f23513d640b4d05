"""The split-KV decode kernel's multi-query mode (attention_decode.py, QUERIES > 1) under the
Triton interpreter: a speculative verification's q = k + 1 new tokens per sequence in one program
per (KV head, sequence, split), against the torch reference, a dense float64 softmax, and the
same batch run as B * q one-token decodes (attention_metadata.as_decodes)."""

import dataclasses
import inspect

import pytest
import torch
from helpers.attention import Batch, assert_close
from helpers.models import (
    PagedRunner,
    build_flat_batch,
    build_model,
    checkpoint_weights,
    tiny_hf_model,
)

from tinypaged.kernels import attention, attention_decode
from tinypaged.kernels.attention import paged_attention, paged_attention_ref, paged_attention_triton
from tinypaged.models.attention_metadata import AttentionMetadata, as_decodes

pytestmark = [  # as test_kernels_attention.py: interpreter notices, empty splits' log2(0)
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered in log2"),
]

# (dtype, head_dim, query heads per KV head, q, block_size, key tile, num_splits): groups 1, 3
# (not a power of two), 4 and 8; q = 2..5; odd head dims; one split and several; q * group
# rows from 2 (padded to 16) to 40 (padded to 64)
CASES = [
    (torch.float32, 80, 1, 2, 16, 32, 1),
    (torch.float16, 96, 4, 5, 16, 16, 3),
    (torch.float32, 64, 8, 3, 32, 32, 4),
    (torch.float16, 80, 8, 5, 16, 64, 1),
    (torch.float32, 96, 4, 4, 32, 16, 2),
    (torch.float16, 128, 1, 5, 16, 32, 5),
    (torch.float32, 80, 3, 5, 16, 16, 3),
    (torch.float16, 64, 4, 2, 16, 16, 4),
]
CASE_IDS = [f"{str(c[0])[6:]}-d{c[1]}-g{c[2]}-q{c[3]}-bs{c[4]}-n{c[5]}-s{c[6]}" for c in CASES]


@pytest.fixture
def decode_kernel_only(monkeypatch):
    """uniform_decode must reach the split-KV decode kernel: the varlen kernel refuses."""
    def refuse(*args, **kwargs):
        raise AssertionError("a uniform decode went to the varlen kernel")

    monkeypatch.setattr(attention, "varlen_attention_triton", refuse)
    monkeypatch.setattr(attention, "hopper_attention_triton", refuse)


def multi_query(batch: Batch, **kwargs) -> torch.Tensor:
    return batch.run(paged_attention_triton, uniform_decode=True, **kwargs)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_multi_query_matches_reference_and_one_token_decodes(case, decode_kernel_only):
    # uneven contexts, one of them only its q new tokens (a prompt verified whole); splits that
    # hold only keys after a row's position, or none of a short sequence's keys
    dtype, head_dim, group, q, block_size, block_n, num_splits = case
    seq_lens = [q, 23, 70, 41]
    batch = Batch([q] * 4, seq_lens, group, head_dim, block_size, dtype)
    config = {"block_n": block_n}
    out = multi_query(batch, num_splits=num_splits, config=config)
    assert out.shape == batch.q.shape and out.dtype == dtype
    assert_close(out, batch.run(paged_attention_ref), dtype)
    if dtype == torch.float32:
        assert_close(out, batch.dense_float64(), dtype)
    md = AttentionMetadata(torch.zeros(4 * q, dtype=torch.int64), batch.query_start_loc,
                           batch.seq_lens, batch.block_tables, max_query_len=q, max_seq_len=70)
    decodes = as_decodes(md, q)
    one_token = paged_attention_triton(
        batch.q, batch.k_cache, batch.v_cache, decodes.block_tables, decodes.seq_lens,
        decodes.query_start_loc, batch.scale, max_query_len=1, max_seq_len=70,
        num_splits=num_splits, config=config)
    assert_close(out, one_token, dtype)


# (window, softcap, num_splits): a window of 1 key, inside a tile, a tile, between tiles, the
# longest context, larger; soft-capping alone and under a window
WINDOW_CAPS = [(1, None, 1), (1, None, 3), (5, None, 3), (16, None, 2), (23, None, 1),
               (40, None, 3), (1000, None, 1), (None, 3.0, 3), (9, 3.0, 1), (9, 3.0, 4)]


@pytest.mark.parametrize("window, softcap, num_splits", WINDOW_CAPS)
def test_multi_query_sliding_window_and_softcap(window, softcap, num_splits, decode_kernel_only):
    # each of the q rows has a window of its own: the first row's starts q - 1 keys earlier
    batch = Batch([4] * 4, [4, 16, 40, 70], 2, 64, 16, torch.float32)
    kwargs = {"sliding_window": window, "softcap": softcap}
    if softcap is not None:
        batch.scale = 2.0  # scores large enough for the cap to change the result
        assert (batch.dense_float64(**kwargs) - batch.dense_float64(sliding_window=window)
                ).abs().max() > 0.1
    out = multi_query(batch, num_splits=num_splits, config={"block_n": 16}, **kwargs)
    assert_close(out, batch.dense_float64(**kwargs), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_multi_query_tiles_outside_the_windows_are_not_read(num_splits, decode_kernel_only):
    q, window, block_n, seq_lens = 4, 20, 16, [70, 45]
    batch = Batch([q, q], seq_lens, 2, 64, 16, torch.float32)
    batch.poison_before_windows(window, block_n)
    out = multi_query(batch, num_splits=num_splits, config={"block_n": block_n},
                      sliding_window=window)
    assert_close(out, batch.dense_float64(sliding_window=window), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_padding_entry_and_shorter_sequences(num_splits, decode_kernel_only):
    # max_query_len 4: a sequence with 0 new tokens (a padding entry) writes nothing and harms
    # no one; one with 2 and one with 1 have their tokens at the end of their contexts
    batch = Batch([4, 0, 2, 1, 4], [30, 9, 17, 33, 4], 4, 64, 16, torch.float32)
    out = torch.full_like(batch.q, float("nan"))
    multi_query(batch, out=out, num_splits=num_splits, config={"block_n": 16})
    assert_close(out, batch.dense_float64(), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_multi_query_large_logits_stay_finite(num_splits, decode_kernel_only):
    # scores of a few hundred over 19 key tiles: the per-token merge takes its max first
    batch = Batch([3, 3, 3], [20, 17, 300], 2, 64, 16, torch.float32)
    batch.scale = 40.0
    out = multi_query(batch, num_splits=num_splits, config={"block_n": 16})
    assert_close(out, batch.dense_float64(), torch.float32)


def test_multi_query_default_splits_without_host_sync(monkeypatch, decode_kernel_only):
    batch = Batch([5, 5], [20, 300], 4, 64, 16, torch.float32)
    expected = batch.dense_float64()

    def sync(*args, **kwargs):
        raise AssertionError("host sync in the Triton launcher")

    monkeypatch.setattr(torch.Tensor, "item", sync)
    monkeypatch.setattr(torch.Tensor, "tolist", sync)
    out = multi_query(batch)  # max_query_len / max_seq_len passed; the split count by default
    monkeypatch.undo()
    assert_close(out, expected, torch.float32)


def test_public_op_takes_uniform_decode_on_both_paths(monkeypatch):
    # the reference has the launcher's arguments (uniform_decode picks a kernel, not a result)
    assert "uniform_decode" in inspect.signature(paged_attention_ref).parameters
    batch = Batch([3, 3], [3, 20], 2, 64, 16, torch.float32)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ref = batch.run(paged_attention, uniform_decode=True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert_close(batch.run(paged_attention, uniform_decode=True, config={"block_n": 16}), ref,
                 torch.float32)


def test_tiny_llama_verification_step_through_uniform_decode(monkeypatch, decode_kernel_only):
    # the plumbing, interpreted end to end: AttentionMetadata.uniform_decode reaches every
    # layer's attention, which runs the multi-query decode (QUERIES = q); the step's logits
    # equal those of the same step through the torch references
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # torch references first
    hf = tiny_hf_model("llama", seed=0)
    model = build_model(hf.config, checkpoint_weights(hf))
    runner = PagedRunner(model, block_size=4, num_blocks=32)
    seqs = [runner.add_sequence() for _ in range(3)]
    runner.step({s: list(range(5 + 4 * s, 14 + 9 * s)) for s in seqs})  # prompts of 9, 14, 19
    q = 4
    new = {s: [30 + 7 * s + i for i in range(q)] for s in seqs}
    expected = torch.cat(list(runner.step(new).values()))  # [3 * q, vocab]
    ids, positions, md = build_flat_batch(
        list(new.values()), [runner.num_cached[s] - q for s in seqs], runner.block_tables, 4)
    calls = []
    real = attention_decode.decode_attention_triton
    monkeypatch.setattr(attention, "decode_attention_triton",
                        lambda *a, **k: calls.append(k["max_query_len"]) or real(*a, **k))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with torch.no_grad():
        hidden = model(ids, positions, dataclasses.replace(md, uniform_decode=True))
        logits = model.compute_logits(hidden)
    assert calls == [q] * hf.config.num_hidden_layers
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
