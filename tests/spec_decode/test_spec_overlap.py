"""Overlapped verification (spec_decode/decoder.py; on by default, set here): each step is
launched before the tokens of the verification in flight are known, as if it accepted every
draft, and moved on the device to where it ended (kernels/spec_shift.py). On the CPU, with async
scheduling forced as the engine's async tests do: every request's output equals the engine's
without speculation (n-gram, the oracles; stops and max_tokens met mid-draft; chunked prefill,
preemption and prefix caching; aborts in flight are in test_spec_async.py), steps really
overlap, sampled continuations keep their distribution, requests that sample from host state
turn it off while they run, and every KV block is free afterwards."""

from __future__ import annotations

import pytest
from helpers.models import count_preemptions, prompts, single_thread  # noqa: F401
from scipy.stats import chi2_contingency

from tinypaged import LLM, SamplingParams

ENGINE = dict(num_kv_blocks=96, block_size=4, max_model_len=128, async_scheduling=True)
BATCH = prompts(5, seed=3, hi=24)


@pytest.fixture(autouse=True)
def overlap(monkeypatch):
    monkeypatch.setenv("TINYPAGED_SPEC_OVERLAP", "1")


def outputs(llm: LLM, params, batch=BATCH) -> list[tuple]:
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for o in outs]


def assert_all_free(llm: LLM) -> None:
    stats = llm.engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    llm.engine.scheduler.check_invariants()


def ngram(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def case(llama):
    """Per-request params (max_tokens 6..18, a stop token and a stop string met mid-run), the
    outputs without speculation, and the oracles' table."""
    plain = LLM(llama, **ENGINE)
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True)
              for i in range(len(BATCH))]
    first = plain.generate([{"prompt_token_ids": p} for p in BATCH], params, use_tqdm=False)
    text = first[4].outputs[0].text
    params[3] = SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True,
                               stop_token_ids=[first[3].outputs[0].token_ids[7]])
    params[4] = SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True,
                               stop=[text[len(text) // 2 : len(text) // 2 + 2]])
    base = outputs(plain, params)
    assert base[3][1] == "stop" and base[4][1] == "stop"
    table = [[p, o.outputs[0].token_ids + [0] * 20] for p, o in zip(BATCH, first)]
    return params, base, table


# oracle_miss moves every sequence back by k each step: it runs the model, the rejection walk
# and the move through the Triton kernels (the interpreter), as a GPU runs them
@pytest.mark.parametrize("method,k,kernels", [("ngram", 4, "auto"), ("ngram", 1, "auto"),
                                              ("oracle", 4, "auto"), ("oracle_miss", 3, "triton")])
def test_outputs_equal_no_speculation(llama, case, method, k, kernels):
    params, base, table = case
    config = ngram(k) if method == "ngram" else {
        "method": method, "num_speculative_tokens": k, "oracle_token_ids": table}
    llm = LLM(llama, speculative_config=config, kernels=kernels, **ENGINE)
    assert llm.engine.spec.overlap
    assert outputs(llm, params) == base
    assert llm.engine.spec.num_overlapped > 2
    spec = llm.engine.get_stats()["spec_decode"]
    assert spec["num_drafts"] > 0
    if method == "oracle":  # every guess right: the drafts follow the true tokens throughout
        assert spec["num_accepted_tokens"] == spec["num_draft_tokens"]
    if method == "oracle_miss":  # every step moved back by k: the positions follow the device
        assert spec["num_accepted_tokens"] == 0
    assert_all_free(llm)
    if method != "ngram":  # the oracles know the table's prompts only
        return
    # The blocks registered behind verifications in flight hold the tokens their hashes name:
    # prompts that go on with the outputs hit them and continue as without speculation.
    longer = [p + list(b[0]) for p, b in zip(BATCH, base)]
    few = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    again = llm.generate([{"prompt_token_ids": p} for p in longer], few, use_tqdm=False)
    assert outputs(LLM(llama, **ENGINE), few, longer) == [
        (o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
        for o in again]
    assert [o.num_cached_tokens for o in again] == [(len(p) - 1) // 4 * 4 for p in longer]
    assert_all_free(llm)


def test_chunked_prefill_preemption_prefix_cache(llama):
    batch = prompts(4, seed=4, lo=16, hi=30)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    base = outputs(LLM(llama, skip_tokenizer_init=True, **ENGINE), params, batch)
    # 16 blocks of 4 tokens for 4 sequences of up to 46 tokens, 8 tokens a step
    llm = LLM(llama, skip_tokenizer_init=True, **dict(ENGINE, num_kv_blocks=16),
              max_num_batched_tokens=8, speculative_config=ngram(4))
    preempted = count_preemptions(llm.engine.scheduler)
    assert outputs(llm, params, batch) == base
    assert preempted[0] > 0 and llm.engine.spec.num_overlapped > 4
    assert_all_free(llm)


def test_host_state_requests_turn_it_off_while_they_run(llama):
    """A penalized request runs beside greedy ones: no step overlaps while it lives, and every
    output equals the engine's without speculation."""
    batch = prompts(3, seed=5, lo=9, hi=30)
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.3,
                             ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, min_tokens=4)]
    base = outputs(LLM(llama, **ENGINE), params, batch)
    llm = LLM(llama, speculative_config=ngram(3), **ENGINE)
    assert outputs(llm, params, batch) == base
    assert llm.engine.spec.num_overlapped == 0
    assert outputs(llm, params[:1], batch[:1]) == base[:1]  # alone, it overlaps
    assert llm.engine.spec.num_overlapped > 2
    assert_all_free(llm)


def test_logprobs_equal_no_speculation(llama):
    """Logprobs need only the emitted tokens, so a request asking for them does not turn
    overlap off: its tokens and top-2 logprobs equal the engine's without speculation."""
    batch = prompts(3, seed=7, lo=9, hi=30)
    params = SamplingParams(temperature=0.0, max_tokens=14, logprobs=2, ignore_eos=True)
    base = LLM(llama, **ENGINE).generate([{"prompt_token_ids": p} for p in batch], params,
                                         use_tqdm=False)
    llm = LLM(llama, speculative_config=ngram(3), **ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert llm.engine.spec.num_overlapped > 2
    for x, y in zip(base, outs):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert len(y.outputs[0].logprobs) == len(y.outputs[0].token_ids)
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert lx.keys() == ly.keys()
            assert all(abs(lx[t] - ly[t]) < 1e-4 for t in lx)
    assert_all_free(llm)


def test_sampled_continuations_keep_their_distribution(llama):
    """300 seeded samples of a 3-token continuation (top-k 2: 8 outcomes), speculated by the
    oracle (drafts accepted with probability p, so the steps move back by varying counts),
    against 300 without speculation: a chi-square test of the two tables."""
    prompt = {"prompt_token_ids": prompts(1, seed=8, lo=12, hi=12)[0]}
    greedy = LLM(llama, **ENGINE).generate(prompt, SamplingParams(temperature=0.0, max_tokens=8,
                                                                  ignore_eos=True),
                                           use_tqdm=False)[0].outputs[0].token_ids
    table = [[prompt["prompt_token_ids"], greedy + [0] * 8]]
    config = {"method": "oracle", "num_speculative_tokens": 2, "oracle_token_ids": table}
    params = [SamplingParams(temperature=1.0, top_k=2, max_tokens=3, ignore_eos=True, seed=s)
              for s in range(300)]
    counts = []
    for llm in (LLM(llama, **ENGINE), LLM(llama, speculative_config=config, **ENGINE)):
        outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
        seen: dict[tuple, int] = {}
        for o in outs:
            key = tuple(o.outputs[0].token_ids)
            seen[key] = seen.get(key, 0) + 1
        counts.append(seen)
    assert llm.engine.spec.num_overlapped > 0
    keys = sorted(set(counts[0]) | set(counts[1]))
    assert 2 < len(keys) <= 8
    stat = chi2_contingency([[c.get(key, 0) for key in keys] for c in counts])
    assert stat.pvalue > 1e-3, (counts, stat)


def test_samples_of_one_request_and_the_model_length_limit(llama):
    """n = 2 greedy samples of a request (siblings sharing its prompt blocks), and requests
    generating up to max_model_len (no max_tokens), whose last drafts are cut by the assumed
    length of the verification in flight."""
    batch = prompts(3, seed=6, lo=20, hi=40)
    params = [SamplingParams(temperature=0.0, max_tokens=18, n=2, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)]
    engine = dict(ENGINE, max_model_len=64)

    def run(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]

    base = run(LLM(llama, **engine))
    assert base[1][0][1] == "length" and len(batch[1]) + len(base[1][0][0]) == 64
    llm = LLM(llama, speculative_config=ngram(4), **engine)
    assert run(llm) == base
    assert llm.engine.spec.num_overlapped > 4
    assert_all_free(llm)
