"""The engine end to end on tiny random models: greedy tokens identical to transformers for every
architecture, under prefix caching, chunked prefill, preemption and max_num_seqs=1, with no KV
blocks leaked; seeds, n > 1, logprobs and admission errors."""

from __future__ import annotations

import pytest
import torch
from helpers.models import (
    count_preemptions,
    greedy_reference,
    prompts,
    save_tiny,
)

from tinypaged import LLM, SamplingParams

KINDS = ["llama", "qwen2", "qwen3", "glm", "glm4", "chatglm", "mistral", "gemma2", "gemma3",
         "phi3"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    return path, save_tiny("llama", path)


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run(llm: LLM, batch: list[list[int]], params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_no_leak(llm: LLM) -> None:
    stats = llm.engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    assert stats["num_running"] == stats["num_waiting"] == 0
    llm.engine.scheduler.check_invariants()


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_transformers(kind, tmp_path):
    hf = save_tiny(kind, tmp_path)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, num_kv_blocks=64, block_size=16)
    batch = prompts(4, seed=1)
    ours = run(llm, batch, greedy(10))
    for p, toks in zip(batch, ours):
        assert toks == greedy_reference(hf, p, 10)[0]
    assert_no_leak(llm)


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        dict(enable_prefix_caching=False),
        dict(enable_prefix_caching=True),
        dict(max_num_batched_tokens=8),  # chunked prefill: every prompt spans several steps
        dict(num_kv_blocks=6, block_size=8),  # heavy preemption: 48 cache slots for 12 requests
        dict(max_num_seqs=1),
    ],
    ids=["no-prefix-cache", "prefix-cache", "chunked", "preemption", "one-seq"],
)
def test_scheduling_modes_keep_outputs(llama, engine_kwargs):
    path, hf = llama
    shared = prompts(1, seed=7, lo=35, hi=35)[0]  # a long common prefix exercises the cache
    batch = [shared + p for p in prompts(6, seed=2, lo=1, hi=6)] + prompts(6, seed=3)
    kwargs = dict(num_kv_blocks=128, block_size=16) | engine_kwargs
    llm = LLM(str(path), skip_tokenizer_init=True, **kwargs)
    expected = [greedy_reference(hf, p, 6)[0] for p in batch]
    assert run(llm, batch, greedy(6)) == expected
    assert run(llm, batch, greedy(6)) == expected  # second pass: cached prefixes, if enabled
    assert_no_leak(llm)


def test_sliding_window_model_in_every_scheduling_mode(tmp_path):
    """Gemma 2 (8-token windows on alternate layers, soft-caps): cached prefixes, chunked
    prefills and preemption all keep transformers' greedy tokens."""
    hf = save_tiny("gemma2", tmp_path)
    shared = prompts(1, seed=7, lo=35, hi=35)[0]
    batch = [shared + p for p in prompts(4, seed=2, lo=1, hi=6)] + prompts(4, seed=3)
    expected = [greedy_reference(hf, p, 6)[0] for p in batch]
    for kwargs in (dict(num_kv_blocks=64, block_size=16), dict(max_num_batched_tokens=8),
                   dict(num_kv_blocks=8, block_size=8)):
        llm = LLM(str(tmp_path), skip_tokenizer_init=True, **kwargs)
        assert run(llm, batch, greedy(6)) == expected, kwargs
        assert run(llm, batch, greedy(6)) == expected, kwargs  # cached prefixes
        assert_no_leak(llm)


def test_preemption_really_happens(llama):
    path, hf = llama
    llm = LLM(str(path), skip_tokenizer_init=True, num_kv_blocks=6, block_size=8)
    preempted = count_preemptions(llm.engine.scheduler)
    batch = prompts(8, seed=4, lo=10, hi=20)
    assert run(llm, batch, greedy(12)) == [greedy_reference(hf, p, 12)[0] for p in batch]
    assert preempted[0] > 0
    assert_no_leak(llm)


def test_prefix_cache_hits(llama):
    path, _ = llama
    llm = LLM(str(path), skip_tokenizer_init=True, num_kv_blocks=64, block_size=16)
    prompt = prompts(1, seed=9, lo=50, hi=50)[0]
    first = llm.generate({"prompt_token_ids": prompt}, greedy(2), use_tqdm=False)[0]
    second = llm.generate({"prompt_token_ids": prompt}, greedy(2), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 48  # three full blocks of 16
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


def test_seed_reproducible_whatever_the_batch(llama):
    path, _ = llama
    llm = LLM(str(path), skip_tokenizer_init=True, num_kv_blocks=64)
    target = prompts(1, seed=11)[0]
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = run(llm, [target], seeded)[0]
    others = prompts(5, seed=12)
    mixed_params = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)] * 5
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in others[:2] + [target] + others[2:]],
        mixed_params[:2] + [seeded] + mixed_params[2:], use_tqdm=False,
    )
    assert outs[2].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, seed=99, max_tokens=12, ignore_eos=True)
    assert run(llm, [target], other_seed)[0] != alone


def test_n_samples_and_top_k_one(llama):
    path, hf = llama
    llm = LLM(str(path), skip_tokenizer_init=True, num_kv_blocks=64)
    prompt = prompts(1, seed=13)[0]
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    top1 = SamplingParams(temperature=1.0, top_k=1, max_tokens=10, ignore_eos=True)
    assert run(llm, [prompt], top1)[0] == greedy_reference(hf, prompt, 10)[0]
    assert_no_leak(llm)


def test_logprobs_match_reference(llama):
    path, hf = llama
    llm = LLM(str(path), skip_tokenizer_init=True, num_kv_blocks=64)
    prompt = prompts(1, seed=14)[0]
    out = llm.generate({"prompt_token_ids": prompt}, greedy(5, logprobs=3), use_tqdm=False)[0]
    tokens, ref_logits = greedy_reference(hf, prompt, 5)
    ref = torch.log_softmax(ref_logits, dim=-1)
    comp = out.outputs[0]
    assert comp.token_ids == tokens
    for i, (tok, lp) in enumerate(zip(tokens, comp.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert lp[tok] == pytest.approx(row[tok].item(), abs=1e-4)
        top = row.topk(3)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert lp[t] == pytest.approx(v, abs=1e-4)
    expected = sum(lp[t] for t, lp in zip(tokens, comp.logprobs))
    assert comp.cumulative_logprob == pytest.approx(expected)


def test_stop_token_ids_and_max_tokens(llama):
    path, hf = llama
    llm = LLM(str(path), skip_tokenizer_init=True, num_kv_blocks=64)
    prompt = prompts(1, seed=15)[0]
    tokens = greedy_reference(hf, prompt, 8)[0]
    out = llm.generate({"prompt_token_ids": prompt},
                       greedy(8, stop_token_ids=[tokens[3]]), use_tqdm=False)[0].outputs[0]
    cut = tokens.index(tokens[3])
    assert out.token_ids == tokens[: cut + 1]
    assert out.finish_reason == "stop" and out.stop_reason == tokens[3]
    out = llm.generate({"prompt_token_ids": prompt}, greedy(4), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4


def test_admission_errors_leave_engine_clean(llama):
    path, _ = llama
    llm = LLM(str(path), skip_tokenizer_init=True, num_kv_blocks=4, block_size=16,
              max_model_len=128)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [5] * 120}, greedy(20), use_tqdm=False)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate({"prompt_token_ids": [5, 9999]}, greedy(2), use_tqdm=False)
    with pytest.raises(ValueError):  # 100 tokens need 7 blocks of 16; the cache has 4
        llm.generate({"prompt_token_ids": [5] * 90}, greedy(10), use_tqdm=False)
    assert run(llm, [[5, 6, 7]], greedy(3))[0]  # still serving
    assert_no_leak(llm)


@pytest.mark.parametrize(
    "fields,match",
    [  # the three triggers of issue #14, each refused at admission
        ({"stop_token_ids": [256], "min_tokens": 1}, "stop_token_ids"),
        ({"top_k": 10**400, "temperature": 1.0}, "top_k"),
        ({"stop_token_ids": [10**30], "min_tokens": 1}, "stop_token_ids"),
    ],
)
def test_fields_that_would_raise_in_the_batch_are_refused_at_admission(llama, fields, match):
    path, _ = llama
    llm = LLM(str(path), skip_tokenizer_init=True, num_kv_blocks=32, block_size=16)
    with pytest.raises(ValueError, match=match):
        llm.engine.add_request("bad", [5, 6], SamplingParams(max_tokens=4, **fields))
    assert run(llm, [[5, 6, 7]], greedy(3))[0]
    assert_no_leak(llm)


def test_a_request_that_fails_in_sampling_fails_alone(llama):
    """The second wall: if sampling raises for one request anyway, it alone fails and the rest
    of the step (here: greedy bystanders) gets the tokens it would have had."""
    path, _ = llama
    llm = LLM(str(path), skip_tokenizer_init=True, num_kv_blocks=64, block_size=16)
    batch = prompts(6, seed=4)
    expected = run(llm, batch, greedy(6))
    engine = llm.engine
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}", p, greedy(6))
    poisoned = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=3)
    engine.add_request("poison", [7, 8, 9], poisoned)
    poisoned.stop_token_ids = [10**6]  # past admission: the batched min_tokens mask raises
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    errors = dict(engine.pop_request_errors())
    assert set(errors) == {"poison"} and "poison" not in outputs
    assert [outputs[f"r{i}"].outputs[0].token_ids for i in range(6)] == expected
    assert_no_leak(llm)
