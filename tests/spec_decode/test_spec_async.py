"""Speculative decoding under async scheduling (spec_decode/decoder.py: apply -> propose ->
schedule -> launch -> stop checks of the step before), forced on the CPU as the engine's async
tests do: every request's output (tokens, text, finish and stop reason) equals the synchronous
engine's without speculation, for the n-gram, oracle, draft-model and head (MTP, EAGLE-3)
proposers, in batches mixing k and requests ending at different steps, by max_tokens (bounding
the drafts), a stop token or a stop string accepted mid-draft, and aborts while a step is in
flight; steps really overlap, and every KV block (the target's, the draft's, the head's) is free
afterwards."""

from __future__ import annotations

import pytest
from helpers.models import prompts, single_thread  # noqa: F401  (an autouse fixture)
from helpers.spec_heads import save_eagle3, save_glm_mtp

from tinypaged import LLM, SamplingParams
from tinypaged.bench.tiny_models import tiny_hf_model

ENGINE = dict(num_kv_blocks=96, block_size=4, max_model_len=128)
BATCH = prompts(5, seed=3, hi=24)


def outputs(llm: LLM, params) -> list[tuple]:
    outs = llm.generate([{"prompt_token_ids": p} for p in BATCH], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
             o.outputs[0].stop_reason) for o in outs]


def count_overlaps(llm: LLM) -> list[int]:
    """Count the steps that left a verification in flight (taken by the next step); check that
    no sequence is scheduled once it holds its last token (its stop checks still to run)."""
    engine, count = llm.engine, [0]
    step, schedule = engine.step, engine.scheduler.schedule

    def checked_schedule():
        out = schedule()
        assert all(len(it.seq.token_ids) < it.seq.max_length for it in out.scheduled)
        return out

    def counting_step(*args, **kwargs):
        out = step(*args, **kwargs)
        count[0] += engine._in_flight is not None
        return out

    engine.step, engine.scheduler.schedule = counting_step, checked_schedule
    return count


def assert_all_free(llm: LLM) -> None:
    stats = llm.engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    llm.engine.scheduler.check_invariants()
    proposer = llm.engine.spec.proposer
    if hasattr(proposer, "twins"):  # the draft model's or the head's own cache
        assert not proposer.twins
        assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks


@pytest.fixture(scope="module")
def case(llama):
    """The per-request params (max_tokens 6..18, one stop token and one stop string met
    mid-run, found from a first greedy run) and the synchronous engine's outputs."""
    plain = LLM(llama, **ENGINE)
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True)
              for i in range(len(BATCH))]
    first = outputs(plain, params)
    text = first[4][1]
    params[3] = SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True,
                               stop_token_ids=[first[3][0][7]])
    params[4] = SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True,
                               stop=[text[len(text) // 2 : len(text) // 2 + 2]])
    base = outputs(plain, params)
    assert base[3][2] == "stop" and len(base[3][0]) < 6 + 3 * 3
    assert base[4][2] == "stop" and len(base[4][0]) < 6 + 3 * 4
    return params, base, [[p, o[0] + [0] * 20] for p, o in zip(BATCH, first)]


@pytest.mark.parametrize("method, overlap", [  # overlap "0": verified once the tokens are known
    ("ngram", "1"), ("ngram", "0"), ("oracle", "1"), ("oracle_miss", "1"), ("oracle_miss", "0"),
    ("draft", "1"), ("draft_self", "1")])
def test_async_outputs_equal_sync_without_speculation(llama, case, method, overlap, tmp_path,
                                                      monkeypatch):
    monkeypatch.setenv("TINYPAGED_SPEC_OVERLAP", overlap)
    params, base, table = case
    config = {"ngram": {"method": "ngram", "num_speculative_tokens": 4,
                        "prompt_lookup_min": 1, "prompt_lookup_max": 3},
              "oracle": {"method": "oracle", "num_speculative_tokens": 4,
                         "oracle_token_ids": table},
              "oracle_miss": {"method": "oracle_miss", "num_speculative_tokens": 3,
                              "oracle_token_ids": table},
              "draft": {"model": str(tmp_path), "num_speculative_tokens": 3},
              "draft_self": {"model": llama, "num_speculative_tokens": 4}}[method]
    if method == "draft":  # a draft with other weights: drafts partly accepted
        tiny_hf_model("llama", seed=9, num_hidden_layers=1).save_pretrained(tmp_path)
    llm = LLM(llama, speculative_config=config, async_scheduling=True, **ENGINE)
    # overlapped verification: proposers from tokens alone, the runner as the decoder
    overlapped = overlap == "1" and not method.startswith("draft")
    assert llm.engine.spec.overlap == llm.engine.runner.overlap == overlapped
    overlaps = count_overlaps(llm)
    assert outputs(llm, params) == base
    assert overlaps[0] > 2
    assert (llm.engine.spec.num_overlapped > 2) == overlapped
    spec = llm.engine.get_stats()["spec_decode"]
    assert spec["num_drafts"] > 0
    if method in ("oracle", "draft_self"):
        assert spec["num_accepted_tokens"] == spec["num_draft_tokens"]
    if method == "oracle_miss":
        assert spec["num_accepted_tokens"] == 0
    assert_all_free(llm)
    # Not overlapped, the counters are those of the synchronous engine: no wasted row is
    # counted (overlapped, other drafts are proposed: after a guess of the last token)
    sync = LLM(llama, speculative_config=config, async_scheduling=False, **ENGINE)
    assert outputs(sync, params) == base
    assert (sync.engine.get_stats()["spec_decode"] == spec) or overlapped


@pytest.mark.parametrize("overlap", ["0", "1"])  # 1: the next one launched before its tokens
def test_aborts_while_a_verification_is_in_flight(llama, case, overlap, monkeypatch):
    monkeypatch.setenv("TINYPAGED_SPEC_OVERLAP", overlap)
    params, base, table = case
    config = {"method": "oracle", "num_speculative_tokens": 2, "oracle_token_ids": table}
    llm = LLM(llama, speculative_config=config, async_scheduling=True, **ENGINE)
    engine = llm.engine
    for i, (p, sp) in enumerate(zip(BATCH, params)):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp)
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps in (2, 4):  # request 0, then 2, aborted with a step in flight
            assert engine._in_flight is not None
            engine.abort_request(str(steps - 2))
    assert set(done) == {"1", "3", "4"}
    assert [done[r] for r in ("1", "3", "4")] == [base[i][0] for i in (1, 3, 4)]
    assert engine.spec.num_overlapped > 2 or overlap == "0"
    assert_all_free(llm)
    # The engine takes new requests afterwards (a stale in-flight step holds finished ones).
    assert outputs(llm, params) == base
    assert_all_free(llm)


def test_heads_async_equal_sync(tmp_path):
    """MTP whose layer computes the target's own next token (every draft accepted) and a random
    EAGLE-3 head (every draft rejected), with max_tokens ending mid-draft."""
    mtp = tmp_path / "mtp"
    save_glm_mtp(mtp, copy=True, bigram=True)
    llama4 = tmp_path / "llama4"
    hf = tiny_hf_model("llama", seed=3, num_hidden_layers=4)
    hf.save_pretrained(llama4)
    (tmp_path / "eagle3").mkdir()
    save_eagle3(tmp_path / "eagle3", hf.config)
    params = [SamplingParams(temperature=0.0, max_tokens=5 + 4 * i, ignore_eos=True)
              for i in range(len(BATCH))]
    kw = dict(ENGINE, skip_tokenizer_init=True)
    for target, config in ((mtp, {"method": "mtp", "num_speculative_tokens": 3}),
                           (llama4, {"method": "eagle3", "num_speculative_tokens": 2,
                                     "model": str(tmp_path / "eagle3")})):
        base = outputs(LLM(str(target), **kw), params)
        llm = LLM(str(target), speculative_config=config, async_scheduling=True, **kw)
        overlaps = count_overlaps(llm)
        assert outputs(llm, params) == base
        assert overlaps[0] > 2
        spec = llm.engine.get_stats()["spec_decode"]
        if config["method"] == "mtp":
            assert spec["num_accepted_tokens"] == spec["num_draft_tokens"] > 0
        else:
            assert spec["num_accepted_tokens"] == 0 < spec["num_draft_tokens"]
        assert_all_free(llm)


def test_sampling_features_async_equal_sync(llama):
    """Penalties, min_tokens, logprobs, seeded sampling and a grammar (taken at once) give the
    same outputs with async scheduling as without, speculating."""
    from tinypaged.sampling.structured_output import StructuredOutputsParams

    batch = prompts(6, seed=5, lo=9, hi=30)
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.3,
                       frequency_penalty=0.2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, min_tokens=4),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=11, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=20, max_tokens=14, seed=5, logprobs=1,
                       ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(
            regex="(abc|abd){2,8}")),
    ]
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
              "prompt_lookup_max": 3}
    results = []
    for async_scheduling in (False, True):
        llm = LLM(llama, speculative_config=config, async_scheduling=async_scheduling, **ENGINE)
        overlaps = count_overlaps(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
                         o.outputs[0].logprobs) for o in outs])
        assert overlaps[0] > 2 or not async_scheduling
        assert_all_free(llm)
    sync, overlapped = results
    for x, y in zip(sync, overlapped):
        assert x[:3] == y[:3]
        for lx, ly in zip(x[3] or [], y[3] or []):
            assert lx.keys() == ly.keys() and all(abs(lx[t] - ly[t]) < 1e-5 for t in lx)
    assert overlapped[1][3] is not None and overlapped[5][1].startswith("ab")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", ["ngram", "oracle_miss", "draft"])
def test_tp2_async_equals_sync(llama, case, method):
    """Over 2 ranks on gloo: rank 0 joins the workers' per-step broadcast of sampled ids, which
    a verification step does not use, so every rank's collectives stay in step. Verifications
    overlap: each step behind one carries its rows' moves to the workers, and rank 0 broadcasts
    the tokens it emitted after it (oracle_miss: every sequence moves back every step). A draft
    model (not overlapped) runs whole on rank 0 beside the sharded target: the target itself
    as its draft, so every draft is accepted only if the draft computes what the target does."""
    params, base, table = case
    config = {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                        "prompt_lookup_max": 3},
              "oracle_miss": {"method": "oracle_miss", "num_speculative_tokens": 3,
                              "oracle_token_ids": table},
              "draft": {"model": llama, "num_speculative_tokens": 3}}[method]
    llm = LLM(llama, speculative_config=config, async_scheduling=True, tensor_parallel_size=2,
              **ENGINE)
    try:
        overlaps = count_overlaps(llm)
        assert outputs(llm, params) == base
        assert overlaps[0] > 2
        assert llm.engine.spec.overlap == (method != "draft")
        assert llm.engine.spec.num_overlapped > 2 or method == "draft"
        spec = llm.engine.get_stats()["spec_decode"]
        assert spec["num_drafts"] > 0
        if method == "draft":  # whole: twice the heads of rank 0's shard of the target
            proposer = llm.engine.spec.proposer
            target_heads = llm.engine.executor.model.model.layers[0].self_attn.num_heads
            assert proposer.executor.model.model.layers[0].self_attn.num_heads == 2 * target_heads
            assert spec["num_accepted_tokens"] == spec["num_draft_tokens"]
            assert_all_free(llm)
    finally:
        llm.shutdown()
