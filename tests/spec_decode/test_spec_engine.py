"""Speculative decoding end to end on tiny random models: greedy output token for token equal to
decoding without speculation for every proposer (n-gram, the oracles), k = 1..5 and batches whose
sequences speculate different k; composing with chunked prefill, preemption, prefix caching,
penalties, logprobs, stop strings and seeds; every KV block free afterwards; bad configs refused."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from helpers.models import (  # noqa: F401  (single_thread: an autouse fixture)
    count_preemptions,
    prompts,
    save_byte_tokenizer,
    save_tiny,
    single_thread,
)

from tinypaged import LLM, SamplingParams
from tinypaged.config import EngineConfig
from tinypaged.spec_decode.draft_model import DraftModelProposer

ENGINE = dict(num_kv_blocks=96, block_size=4, max_model_len=128)


def greedy(max_tokens: int = 20, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run(llm: LLM, batch, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_all_free(llm: LLM) -> None:
    stats = llm.engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    llm.engine.scheduler.check_invariants()


def ngram(k: int, lo: int = 1, hi: int = 3) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo,
            "prompt_lookup_max": hi}


LONG = os.environ.get("TINYPAGED_LONG_TESTS") == "1"
KINDS = ["llama", "qwen3"] + (["glm4_moe", "gemma2"] if LONG else [])


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_no_speculation(kind, tmp_path):
    save_tiny(kind, tmp_path)
    batch = prompts(4, seed=2, hi=24)
    # Different max_tokens per prompt: sequences near their limit speculate fewer tokens.
    params = [greedy(10 + 3 * i) for i in range(len(batch))]
    base = run(LLM(str(tmp_path), skip_tokenizer_init=True, **ENGINE), batch, params)
    table = [[p, b] for p, b in zip(batch, base)]
    configs = [ngram(5),
               {"method": "oracle", "num_speculative_tokens": 2, "oracle_token_ids": table}]
    if kind == "llama" or LONG:
        configs += [ngram(1), ngram(3, 2, 4),
                    {"method": "oracle_miss", "num_speculative_tokens": 4,
                     "oracle_token_ids": table}]
    for config in configs:
        llm = LLM(str(tmp_path), skip_tokenizer_init=True, speculative_config=config, **ENGINE)
        assert run(llm, batch, params) == base, config
        spec = llm.engine.get_stats()["spec_decode"]
        assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] >= spec["num_drafts"]
        if config["method"] == "oracle":
            assert spec["num_accepted_tokens"] == spec["num_draft_tokens"]
        if config["method"] == "oracle_miss":
            assert spec["num_accepted_tokens"] == 0
        assert_all_free(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill_preemption_prefix_cache(llama, async_scheduling):
    batch = prompts(4, seed=4, lo=16, hi=30)
    params = greedy(16)
    base = run(LLM(llama, skip_tokenizer_init=True, **ENGINE), batch, params)
    # 16 blocks of 4 tokens for 4 sequences of up to 46 tokens, 8 tokens a step: chunked
    # prefills, preemptions (with drafts in flight), and recomputes through the prefix cache.
    llm = LLM(llama, skip_tokenizer_init=True, num_kv_blocks=16, block_size=4,
              max_model_len=128, max_num_batched_tokens=8, speculative_config=ngram(4),
              async_scheduling=async_scheduling)
    preempted = count_preemptions(llm.engine.scheduler)
    assert run(llm, batch, params) == base
    assert preempted[0] > 0
    assert_all_free(llm)


def test_penalties_logprobs_stops_and_seeds(llama):
    plain = LLM(llama, **ENGINE)
    spec = LLM(llama, speculative_config=ngram(3), **ENGINE)
    batch = prompts(3, seed=5, lo=9, hi=30)
    cases = [
        greedy(16, repetition_penalty=1.3, frequency_penalty=0.2),
        greedy(12, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=20, min_tokens=4),
    ]
    for params in cases:
        a = plain.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        b = spec.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        for x, y in zip(a, b):
            assert x.outputs[0].token_ids == y.outputs[0].token_ids, params
            if params.logprobs:
                for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
                    assert lx.keys() == ly.keys()
                    assert all(abs(lx[t] - ly[t]) < 1e-4 for t in lx)
    # Prefix-cache hits after many rejections give the same tokens (b: the third run).
    assert all(o.num_cached_tokens > 0 for o in b)
    # A stop string / stop token met in the middle of accepted drafts ends the text there.
    ref = plain.generate({"prompt_token_ids": batch[0]}, greedy(20), use_tqdm=False)[0]
    stop_id = ref.outputs[0].token_ids[6]
    text = ref.outputs[0].text  # two whole characters mid-text (a byte tokenizer leaves U+FFFD)
    stop_text = next(text[i : i + 2] for i in range(3, len(text) - 3)
                     if "\ufffd" not in text[i : i + 2])
    for params in (greedy(20, stop_token_ids=[stop_id]), greedy(20, stop=[stop_text])):
        x = plain.generate({"prompt_token_ids": batch[0]}, params, use_tqdm=False)[0].outputs[0]
        y = spec.generate({"prompt_token_ids": batch[0]}, params, use_tqdm=False)[0].outputs[0]
        assert (x.token_ids, x.text, x.finish_reason) == (y.token_ids, y.text, y.finish_reason)
        assert len(y.token_ids) < 20
    # Seeded sampling through verification repeats itself.
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=11, ignore_eos=True)
    first, second = (run(spec, batch, seeded) for _ in range(2))
    assert first == second
    assert_all_free(spec)


def test_bad_configs_are_refused(llama):
    with pytest.raises(ValueError, match="not implemented"):
        LLM(llama, speculative_config={"method": "medusa", "model": "x",
                                       "num_speculative_tokens": 2}, **ENGINE)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(llama, speculative_config={"method": "ngram"}, **ENGINE)
    with pytest.raises(ValueError, match="not supported"):
        LLM(llama, speculative_config={**ngram(2), "bogus": 1}, **ENGINE)
    llm = LLM(llama, speculative_config=ngram(2), **ENGINE)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate("hello", SamplingParams(prompt_logprobs=1), use_tqdm=False)
    # a draft model runs on rank 0 beside the target (tensor parallelism: test_spec_async.py),
    # not across pipeline stages
    staged = SimpleNamespace(config=EngineConfig(model=llama, pipeline_parallel_size=2))
    with pytest.raises(ValueError, match="pipeline_parallel_size > 1"):
        DraftModelProposer(llama, staged)


def test_metrics_and_cli(llama):
    import json

    from tinypaged.spec_decode.metrics import Counter, Vector

    llm = LLM(llama, speculative_config=ngram(3), **ENGINE)
    run(llm, prompts(2, seed=6), greedy(16))
    metrics = {m.name: m for m in llm.get_metrics()}
    spec = llm.engine.get_stats()["spec_decode"]
    drafts = metrics["tinypaged:spec_decode_num_drafts"]
    assert isinstance(drafts, Counter) and drafts.value == spec["num_drafts"] > 0
    assert (metrics["tinypaged:spec_decode_num_accepted_tokens"].value
            == spec["num_accepted_tokens"])
    per_pos = metrics["tinypaged:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(per_pos, Vector) and len(per_pos.values) == 3
    assert per_pos.values[0] >= per_pos.values[1] >= per_pos.values[2]
    assert LLM(llama, **ENGINE).get_metrics() == []
    from tinypaged.entrypoints.cli import _engine_kwargs, build_parser
    from tinypaged.spec_decode.metrics import log_line

    assert "acceptance rate" in log_line(spec)
    args = build_parser().parse_args(
        ["generate", llama, "hi", "--speculative-config", json.dumps(ngram(2))])
    assert _engine_kwargs(args, llama)["speculative_config"] == ngram(2)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--speculative-config", "[1]"])


def test_draft_model_greedy_equals_no_speculation(llama, tmp_path):
    from tinypaged.bench.tiny_models import tiny_hf_model

    # A draft with other weights and one layer, and the target as its own draft (every draft
    # accepted): both leave the greedy tokens unchanged.
    tiny_hf_model("llama", seed=9, num_hidden_layers=1).save_pretrained(tmp_path)
    batch = prompts(3, seed=7, hi=24)
    params = [greedy(12 + 3 * i) for i in range(len(batch))]
    base = run(LLM(llama, skip_tokenizer_init=True, **ENGINE), batch, params)
    for draft, k, graphs in ((str(tmp_path), 3, "FULL_AND_PIECEWISE"),
                             (llama, 4, "FULL_DECODE_ONLY")):
        llm = LLM(llama, skip_tokenizer_init=True, **ENGINE, cudagraph_mode=graphs,
                  speculative_config={"model": draft, "num_speculative_tokens": k})
        # the draft's runner takes the target's CUDA-graph settings (graphs on a GPU)
        draft_config = llm.engine.spec.proposer.executor.config
        assert (draft_config.enforce_eager, draft_config.cudagraph_mode) == (False, graphs)
        assert run(llm, batch, params) == base
        spec = llm.engine.get_stats()["spec_decode"]
        assert spec["num_drafts"] > 0
        if draft == llama:
            assert spec["num_accepted_tokens"] == spec["num_draft_tokens"]
        assert_all_free(llm)
        proposer = llm.engine.spec.proposer
        assert not proposer.twins and proposer.blocks.num_free_blocks == proposer.blocks.num_blocks


def test_structured_output_requests_decode_beside_speculating_ones(llama):
    from tinypaged.sampling.structured_output import StructuredOutputsParams

    plain = LLM(llama, **ENGINE)
    spec = LLM(llama, speculative_config=ngram(4, 1, 3), **ENGINE)
    prompt = "abcabcabcabc"
    cases = [StructuredOutputsParams(regex="(abc|abd){2,8}"),
             StructuredOutputsParams(choice=["abcabcabcabc", "abcabd", "xyz"])]
    for so in cases:
        params = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=so)
        x = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        y = spec.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert (x.token_ids, x.text) == (y.token_ids, y.text)
        # ... in one batch with a speculating request, which keeps its own tokens too.
        free = greedy(16)
        outs = spec.generate([prompt, prompt], [params, free], use_tqdm=False)
        assert outs[0].outputs[0].token_ids == x.token_ids
        assert outs[1].outputs[0].token_ids == plain.generate(
            prompt, free, use_tqdm=False)[0].outputs[0].token_ids
    assert spec.engine.get_stats()["spec_decode"]["num_drafts"] > 0
    assert_all_free(spec)
