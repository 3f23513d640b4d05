"""Pipeline parallelism with batches in flight (engine/batch_queue.py, worker/pipeline.py): gloo
processes on the CPU, one PP=2 engine shared by the tests of this file.

- Many requests (mixed prompt lengths, shared prefixes, chunked prefill, a cache small enough to
  preempt): greedy tokens equal the single-process engine's; two batches were in flight at once;
  afterwards every KV block is free and no batch is left in flight.
- The stages overlap: with a fixed sleep in each stage's forward (after its input arrived,
  before its output leaves), N batches take about N sleeps, not 2 N, and the first stage's
  sleeps overlap the last stage's, by the timestamps both processes logged.
- A step too big for a slot of the shared-memory ring (it takes the workers' pipes) first runs
  the queued steps through the last stage; the tokens stay right.
- A request aborted while its batch is in flight: the others' tokens are unchanged, no block
  leaks. A step that fails on the host with a batch in flight (`fail_running`) leaves the stages
  in step: the next requests get the right tokens.
"""

from __future__ import annotations

import multiprocessing
import time

import numpy as np
import pytest
from helpers.models import (  # noqa: F401 - single_thread: autouse fixture
    run_engine,
    saved_tiny_model,
    single_thread,
)

from tinypaged import LLM, SamplingParams
from tinypaged.models.pipeline import is_last_stage
from tinypaged.worker import pipeline

ENGINE = dict(skip_tokenizer_init=True, num_kv_blocks=24, block_size=8, dtype="float32",
              device="cpu", max_num_batched_tokens=24, max_num_seqs=8)  # chunked prefill
DELAY = multiprocessing.Value("d", 0.0)  # each stage's sleep; the forked workers share it


def prompts(count: int = 12, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(2, 250, 17).tolist()
    return [(shared[: int(rng.integers(0, 18))] if i % 2 else [])
            + rng.integers(2, 250, int(rng.integers(1, 30))).tolist() for i in range(count)]


def params(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=3 + i % 6, ignore_eos=True)


def greedy(llm: LLM, batch: list[list[int]], same: SamplingParams | None = None
           ) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in batch],
                        same or [params(i) for i in range(len(batch))], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return saved_tiny_model(tmp_path_factory, "llama", seed=5, num_hidden_layers=3)


@pytest.fixture(scope="module")
def expected(model_dir):
    return run_engine(model_dir, lambda llm: {seed: greedy(llm, prompts(seed=seed))
                                              for seed in (1, 2, 3)}, **ENGINE)


@pytest.fixture(scope="module")
def pp_llm(model_dir, expected, tmp_path_factory):  # one process group at a time: after it
    """PP=2, its stage_forward wrapped before the workers fork: while DELAY is set, each stage
    sleeps that long per step and logs (stage, start, end) to the returned file."""
    log = tmp_path_factory.mktemp("stages") / "stages.txt"
    real = pipeline.stage_forward

    def slow(*args):
        last = is_last_stage()
        hidden = real(*args) if last else None  # the last stage computes after receiving
        if DELAY.value:
            start = time.monotonic()
            time.sleep(DELAY.value)
            with open(log, "a") as f:
                f.write(f"{int(last)} {start} {time.monotonic()}\n")
        return hidden if last else real(*args)  # the others, before sending

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "stage_forward", slow)
        llm = LLM(model_dir, pipeline_parallel_size=2, **ENGINE)
        try:
            yield llm, log
        finally:
            llm.shutdown()


def assert_all_free(llm: LLM) -> None:
    sched = llm.engine.scheduler
    assert not sched.has_unfinished() and not llm.engine.requests
    assert sched.num_free_blocks == sched.num_total_blocks
    assert not sched.in_flight and sched.num_batches_in_flight == 0
    assert not llm.engine.batch_queue.batches
    sched.check_invariants()


@pytest.mark.timeout(120)
def test_pp2_with_batches_in_flight_is_greedy_equal_to_one_rank(pp_llm, expected):
    llm, _ = pp_llm
    assert greedy(llm, prompts(seed=1)) == expected[1]
    assert llm.engine.batch_queue.max_in_flight == 2
    assert llm.engine.iteration_stats.num_preemptions > 0  # a cache of 24 blocks for 8 seqs
    assert_all_free(llm)


@pytest.mark.timeout(120)
def test_steps_too_big_for_a_slot_run_the_queued_last_stages_first(pp_llm, expected,
                                                                   monkeypatch):
    """Every step takes the workers' pipes (a slot of 64 bytes): before each is written, the
    steps still queued run through the last stage (a worker blocked in its send would not read
    the pipe); the tokens stay right."""
    from tinypaged.distributed import shm_broadcast
    from tinypaged.worker import executor

    llm, _ = pp_llm
    runs = []
    last_stage = llm.engine.executor.last_stage
    real = last_stage.run_through

    def run_through(last=None):
        runs.append(last)  # None: every queued step, as submit asks before a pipe write
        real(last)

    monkeypatch.setattr(last_stage, "run_through", run_through)
    monkeypatch.setattr(shm_broadcast, "SLOT_BYTES", 64)
    monkeypatch.setattr(executor, "SLOT_BYTES", 64)
    assert greedy(llm, prompts(seed=2)) == expected[2]
    assert None in runs
    assert_all_free(llm)


@pytest.mark.timeout(120)
def test_stages_overlap(pp_llm):
    llm, log = pp_llm
    d = 0.1
    DELAY.value = d
    try:
        start = time.monotonic()
        greedy(llm, [[3 + i, 4, 5, 6] for i in range(8)],
               SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        elapsed = time.monotonic() - start
    finally:
        DELAY.value = 0.0
    rows = [line.split() for line in log.read_text().splitlines()]
    first = [(float(s), float(e)) for last, s, e in rows if last == "0"]
    final = [(float(s), float(e)) for last, s, e in rows if last == "1"]
    batches = len(final)
    assert len(first) == batches >= 6
    # Taking turns would need 2 sleeps per batch; overlapping, about one (plus the first).
    assert elapsed < 1.5 * batches * d, (elapsed, batches)
    together = sum(max(0.0, min(e0, e1) - max(s0, s1)) for s0, e0 in first for s1, e1 in final)
    assert together > 0.5 * (batches - 1) * d, (together, batches)
    assert_all_free(llm)


@pytest.mark.timeout(120)
def test_abort_while_in_flight_and_a_failed_step_keep_the_stages_in_step(pp_llm, expected):
    llm, _ = pp_llm
    engine = llm.engine
    batch = prompts(seed=2)
    for i, p in enumerate(batch):
        engine.add_request(str(i), {"prompt_token_ids": p}, params(i))
    engine.step()  # batch 0 done, batch 1 still in the pipeline
    (queued,) = engine.batch_queue.batches
    victim = queued.out.scheduled[0].seq.request_id
    assert queued.out.scheduled[0].seq.seq_id in engine.scheduler.in_flight
    engine.abort_request(victim)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != victim
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
    assert got == {str(i): t for i, t in enumerate(expected[2]) if str(i) != victim}
    assert_all_free(llm)

    # A fault on the host after batch 0's last stage ran, batch 1 in flight: the engine loop
    # fails the running requests (engine/core.py); the stages must still agree on the order.
    for i, p in enumerate(prompts(seed=3)):
        engine.add_request(f"x{i}", {"prompt_token_ids": p}, params(i))
    process = engine._process
    engine._process = lambda *a: (_ for _ in ()).throw(RuntimeError("a host fault"))
    try:
        with pytest.raises(RuntimeError, match="a host fault"):
            engine.step()
        assert len(engine.batch_queue.batches) == 1
    finally:
        engine._process = process
    assert set(engine.fail_running()) <= {f"x{i}" for i in range(12)}
    for rid in list(engine.requests):
        engine.abort_request(rid)
    assert_all_free(llm)
    assert greedy(llm, prompts(seed=3)) == expected[3]

    # Every request aborted while a batch is in flight: the engine still steps it through.
    for i in range(2):
        engine.add_request(f"y{i}", {"prompt_token_ids": [5 + i, 6, 7]}, params(5))
    engine.step()  # both prompts in one batch
    engine.step()  # their decodes in two batches; one finished, one in flight
    assert len(engine.batch_queue.batches) == 1
    for i in range(2):
        engine.abort_request(f"y{i}")
    assert engine.has_unfinished_requests()
    while engine.has_unfinished_requests():
        assert engine.step() == []
    assert_all_free(llm)


@pytest.mark.timeout(120)
def test_shutdown_with_a_batch_in_flight_stops_every_stage_cleanly(pp_llm):
    """The last test of the engine: the stage waiting to send the batch in flight is let
    through, so every worker reads the stop, answers and exits 0."""
    llm, _ = pp_llm
    for i in range(2):
        llm.engine.add_request(f"z{i}", {"prompt_token_ids": [5 + i, 6, 7]}, params(5))
    llm.engine.step()
    llm.engine.step()
    assert llm.engine.batch_queue.batches
    workers = [w.process for w in llm.engine.executor.workers]
    start = time.monotonic()
    llm.shutdown()
    assert time.monotonic() - start < 5  # the workers answered the stop (no kill at 10 s)
    assert [p.exitcode for p in workers] == [0]
