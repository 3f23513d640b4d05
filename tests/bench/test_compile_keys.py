"""KeyRecorder computes, for each interpreted launch, the key under which an H200 would look the
compiled kernel up; the attention kernels must give a prompt whose prefix is cached the keys the
start-up warm-up already compiled (an H200 stalled 1-2 s on the first fully cached prompt)."""

import pytest
import torch
from helpers.attention import Batch

from tinypaged.bench.compile_keys import KeyRecorder
from tinypaged.kernels.attention import paged_attention_ref, paged_attention_triton

pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered in log2"),
]

BLOCK_SIZE = 16


def attention_keys(q_lens: list[int], seq_lens: list[int], **kwargs) -> dict[str, set]:
    """The keys of one paged_attention_triton call on a step laid out as build_step lays it out:
    block tables as wide as the step's longest context (ModelRunner's StepInput)."""
    batch = Batch(q_lens, seq_lens, group=3, head_dim=64, block_size=BLOCK_SIZE,
                  dtype=torch.float32)
    width = -(-max(seq_lens) // BLOCK_SIZE)
    tables = torch.empty(len(seq_lens), width, dtype=torch.int32)  # strides (width, 1)
    batch.block_tables = tables.copy_(batch.block_tables[:, :width])
    with KeyRecorder() as recorder:
        out = batch.run(paged_attention_triton, **kwargs)
    kwargs.pop("num_splits", None)
    torch.testing.assert_close(out, batch.run(paged_attention_ref, **kwargs),
                               rtol=1e-4, atol=1e-4)
    return dict(recorder.keys)


def test_cached_prompt_prefill_reuses_the_warm_up_kernel():
    # ModelRunner._warm_up: a whole 2-token prompt (one block: block-table stride 1); then the
    # last 2 tokens of prompts of 150 and 256 tokens whose other blocks are cached
    warm_up = attention_keys([2], [2])
    assert list(warm_up) == ["_varlen_attention_kernel"]
    assert attention_keys([2], [150]) == warm_up
    assert attention_keys([2, 1], [256, 40]) == warm_up


def test_decode_kernel_key_does_not_follow_the_context_length():
    short = attention_keys([1, 1], [3, 9], num_splits=2)
    assert attention_keys([1, 1], [150, 9], num_splits=2) == short
    assert attention_keys([1, 1], [256, 300], num_splits=2) == short


def test_new_since_names_the_argument_that_changed():
    first, second = KeyRecorder(), KeyRecorder()
    first.keys["_k"] = {(("X", ("*fp32", "D")), ("n", ("constexpr", 1)), ("num_warps", 4))}
    second.keys["_k"] = first.keys["_k"] | {
        (("X", ("*fp32", "D")), ("n", ("i32", "")), ("num_warps", 4))}
    second.keys["_other"] = {(("BLOCK", ("constexpr", 16)),)}
    assert second.new_since(first) == {
        "_k": [{"n": (("constexpr", 1), ("i32", ""))}],
        "_other": [{"BLOCK": (None, ("constexpr", 16))}],
    }
    assert first.new_since(first) == {}
