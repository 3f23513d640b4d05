"""Async scheduling on the CPU (engine/engine.py): the same outputs as the synchronous engine.

The async path runs on the CPU too (the model runs when launched, so nothing overlaps, but the
steps are scheduled with placeholders and the input ids gathered from the previous step's
sampled tensor exactly as on a GPU). For a mix of greedy, seeded and n=2 requests ending by
max_tokens, stop token ids, stop strings and max_model_len, some aborted mid-run, and some that
read the host between steps (penalties and min_tokens, which sample late; logprobs, which run
step by step), every request's stream of outputs (tokens, text, finish and stop reasons, in
order) is the same in both modes, under prefix caching, chunked prefill, preemption under a tiny
KV cache and one sequence at a time; and over 2 ranks on gloo. Each test also checks that
placeholders were really used, and that no KV block leaked.
"""

from __future__ import annotations

import random
from collections import defaultdict

import numpy as np
import pytest
import torch
from helpers.models import (  # noqa: F401  (autouse fixture)
    count_preemptions,
    save_byte_tokenizer,
    single_thread,
    tiny_hf_model,
)

from tinypaged import LLM, SamplingParams
from tinypaged.scheduler import ScheduledSequence, Sequence
from tinypaged.worker.input_batch import HostBlockTables, build_step, gather_input_ids

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    tiny_hf_model("llama", seed=5).save_pretrained(path)
    save_byte_tokenizer(path)
    return path


def make(path, async_scheduling: bool, **kwargs) -> LLM:
    kwargs = dict(num_kv_blocks=128, block_size=8, max_model_len=MAX_MODEL_LEN) | kwargs
    return LLM(str(path), async_scheduling=async_scheduling, **kwargs)


def count_placeholders(llm: LLM) -> list[int]:
    """Count the placeholder rows of every step the runner builds."""
    runner, count = llm.engine.runner, [0]
    build = runner.build_step

    def counting_build(*args, **kwargs):
        step = build(*args, **kwargs)
        if step.prev_sample_indices is not None:
            count[0] += int((step.prev_sample_indices >= 0).sum())
        return step

    runner.build_step = counting_build
    return count


def stream(llm: LLM, requests, abort_after: dict[str, int] | None = None):
    """Run `requests` [(id, prompt ids, params)] through engine.step(); returns what each
    sample streamed, in order (its successive states: tokens, text, finish and stop reason).
    A request in `abort_after` is aborted once an output shows that many tokens. (Samples are
    compared one by one: how far the samples of a request, or requests, are ahead of each
    other follows the timing of the steps, which async scheduling changes.)"""
    engine = llm.engine
    for rid, prompt, params in requests:
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    seen = defaultdict(list)
    while engine.has_unfinished_requests():
        for out in engine.step():
            rid = out.request_id
            for c in out.outputs:
                state = (tuple(c.token_ids), c.text, c.finish_reason, c.stop_reason)
                states = seen[rid, c.index]
                if (c.token_ids or c.finish_reason) and (not states or states[-1] != state):
                    states.append(state)
            if not out.finished and len(out.outputs[0].token_ids) == (abort_after or {}).get(rid):
                engine.abort_request(rid)
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    engine.scheduler.check_invariants()
    return dict(seen)


def workload(reference: LLM) -> tuple[list, dict[str, int]]:
    """The request mix. Stop token ids and stop strings are taken from a first greedy run of
    `reference`, so that they do occur mid-generation."""
    rng = random.Random(0)
    shared = [rng.randrange(3, 250) for _ in range(20)]  # a shared prefix: cache hits
    prompts = [shared + [rng.randrange(3, 250) for _ in range(rng.randint(1, 12))]
               for _ in range(12)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    first = reference.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                               use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in first]
    texts = [o.outputs[0].text for o in first]
    # Requests 3 and 4 stop on a string: two prompts whose text has whole characters.
    clean = [i for i, t in enumerate(texts) if stop_string(t) and i not in (2, 10)]
    prompts[3], prompts[4] = prompts[clean[0]], prompts[clean[1]]
    texts[3], texts[4] = texts[clean[0]], texts[clean[1]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=0.0, max_tokens=5),
        SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[tokens[2][6]]),
        SamplingParams(temperature=0.0, max_tokens=16, stop=[stop_string(texts[3])]),
        SamplingParams(temperature=0.0, max_tokens=16, stop=[stop_string(texts[4])],
                       include_stop_str_in_output=True),
        SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=12),
        SamplingParams(temperature=1.0, top_p=0.9, seed=8, max_tokens=12, n=2),
        SamplingParams(temperature=0.0, max_tokens=None),  # ends at max_model_len
        SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.5),  # host
        SamplingParams(temperature=0.0, max_tokens=10, logprobs=2),  # host
        SamplingParams(temperature=0.0, max_tokens=10, min_tokens=4,
                       stop_token_ids=[tokens[10][1]]),
        SamplingParams(temperature=0.0, max_tokens=16),  # aborted after 3 tokens
    ]
    return ([(f"r{i}", p, q) for i, (p, q) in enumerate(zip(prompts, params))],
            {"r11": 3})


def stop_string(text: str) -> str:
    """Two characters from the middle of `text` that are whole characters (a byte-level
    tokenizer may leave a partial UTF-8 sequence, shown as U+FFFD, which never matches), or
    "" when there are none."""
    for start in range(2, len(text) - 1):
        if "\ufffd" not in text[start : start + 2]:
            return text[start : start + 2]
    return ""


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        dict(),
        dict(max_num_batched_tokens=8),  # chunked prefill: every prompt spans several steps
        dict(num_kv_blocks=12, block_size=8),  # preemption: 96 cache slots for 12 requests
        dict(max_num_seqs=1, enable_prefix_caching=False),
    ],
    ids=["prefix-cache", "chunked", "preemption", "one-seq"],
)
def test_async_outputs_equal_sync(model_dir, engine_kwargs):
    sync = make(model_dir, False, **engine_kwargs)
    requests, abort_after = workload(sync)
    preempted = count_preemptions(sync.engine.scheduler)
    expected = stream(sync, requests, abort_after)

    llm = make(model_dir, True, **engine_kwargs)
    placeholders = count_placeholders(llm)
    async_preempted = count_preemptions(llm.engine.scheduler)
    assert stream(llm, requests, abort_after) == expected
    assert placeholders[0] > 0  # steps really overlapped
    # Every ending happened: stop ids and strings, max_tokens, max_model_len, abort.
    finals = {rid: states[-1] for (rid, _), states in expected.items()}
    assert finals["r2"][2:] == ("stop", requests[2][2].stop_token_ids[0])
    assert finals["r3"][2] == finals["r4"][2] == "stop"
    assert finals["r7"][2] == "length" and len(requests[7][1]) + len(finals["r7"][0]) == 64
    assert len(finals["r11"][0]) == 3 and finals["r11"][2] is None
    if engine_kwargs.get("num_kv_blocks") == 12:
        assert preempted[0] > 0 and async_preempted[0] > 0


def test_logprobs_requests_never_overlap(model_dir):
    """Alone in the engine, a request with logprobs runs every step synchronously: no step of
    it is built before the previous one's token is on the host. One with penalties overlaps,
    sampling late (after the previous step's token joined its history), with the same
    tokens."""
    for params, overlaps in [
        (SamplingParams(temperature=0.0, max_tokens=8, logprobs=1), False),
        (SamplingParams(temperature=0.0, max_tokens=8, presence_penalty=1.0), True),
    ]:
        llm = make(model_dir, True)
        placeholders = count_placeholders(llm)
        got = stream(llm, [("p", [5, 6, 7], params)])
        assert (placeholders[0] > 0) == overlaps
        assert got == stream(make(model_dir, False), [("p", [5, 6, 7], params)])


def test_offline_steps_overlap_prompt_chunks_included(model_dir):
    """An offline run of plain requests (greedy and seeded sampling, chunked prompts arriving
    beside decodes): every step, whether it carries prompt tokens or only decodes, is still in
    flight when step() returns, so the next one is scheduled while it runs."""
    llm = make(model_dir, True, max_num_batched_tokens=8)
    engine = llm.engine
    launch, launched = engine._launch, []
    engine._launch = lambda out: launched.append(launch(out)) or launched[-1]
    rng = random.Random(1)
    for i in range(6):
        params = (SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True) if i % 2 else
                  SamplingParams(temperature=0.8, seed=i, max_tokens=6, ignore_eos=True))
        prompt = [rng.randrange(3, 250) for _ in range(rng.randint(3, 20))]
        engine.add_request(f"o{i}", {"prompt_token_ids": prompt}, params)
    kinds = set()
    while engine.has_unfinished_requests():
        before = len(launched)
        engine.step(finished_only=True)
        if len(launched) > before:
            step = launched[-1]
            assert engine._in_flight is step, "a launched step was processed at once"
            kinds.add(any(it.num_new_tokens > 1 or not it.sample for it in step.out.scheduled))
    assert kinds == {True, False}  # steps with prompt tokens and pure decodes both overlapped


def test_placeholders_are_gathered_from_the_previous_samples():
    """build_step marks a token past the host's token ids as a placeholder, with its row in
    the previous step's sampled ids; gather_input_ids puts the sampled id there."""
    decoding = Sequence("a", [11, 12, 13])
    decoding.block_table = [4]
    prefilling = Sequence("b", [21, 22])
    prefilling.block_table = [5]
    scheduled = [ScheduledSequence(decoding, 1, 3, True), ScheduledSequence(prefilling, 2, 0, True)]
    step = build_step(scheduled, 8, HostBlockTables(4, 2), prev_sample_rows={decoding.seq_id: 1})
    assert step.input_ids.tolist() == [0, 21, 22]
    assert step.prev_sample_indices.tolist() == [1, -1, -1]
    assert step.positions.tolist() == [3, 0, 1]
    ids = gather_input_ids(torch.from_numpy(step.input_ids),
                           torch.from_numpy(step.prev_sample_indices), torch.tensor([40, 41]))
    assert ids.tolist() == [41, 21, 22]
    with pytest.raises(RuntimeError, match="placeholder"):
        build_step(scheduled, 8, HostBlockTables(4, 2), prev_sample_rows={})
    plain = build_step(scheduled[1:], 8, HostBlockTables(4, 2))
    assert plain.prev_sample_indices is None


@pytest.mark.timeout(180)
def test_tp2_async_matches_sync(model_dir):
    """Over 2 ranks on gloo the workers take the placeholders' ids from rank 0's broadcast."""
    requests, _ = workload(make(model_dir, False))
    requests = [requests[i] for i in (1, 2, 3, 4, 5, 6)]
    expected = stream(make(model_dir, False), requests)
    llm = make(model_dir, True, tensor_parallel_size=2)
    try:
        placeholders = count_placeholders(llm)
        assert stream(llm, requests) == expected
        assert placeholders[0] > 0
    finally:
        llm.shutdown()


def test_round_trip_keeps_prev_sample_indices():
    from tinypaged.worker.model_runner import StepInput
    from tinypaged.worker.tp_worker import pack_step, unpack_step

    step = StepInput(
        input_ids=np.array([0, 5]), positions=np.array([9, 3]), slot_mapping=np.array([9, 19]),
        query_start_loc=np.array([0, 1, 2], np.int32), seq_lens=np.array([10, 4], np.int32),
        block_tables=np.array([[0], [1]], np.int32), logits_indices=np.array([0, 1]),
        max_query_len=1, max_seq_len=10, prev_sample_indices=np.array([3, -1]),
    )
    assert unpack_step(pack_step(step)).prev_sample_indices.tolist() == [3, -1]
