"""Tensor parallelism end to end on the CPU: 2 processes joined by gloo (worker/executor.py).

- Greedy tokens of `LLM(..., tensor_parallel_size=2)` equal those of the single-process engine
  (fp32) for tiny random llama (GQA, 2 KV heads), qwen3 with 1 KV head (replicated on both
  ranks), glm and glm4_moe (experts split across ranks), under chunked prefill and prefix
  caching; each rank read about half the checkpoint; the workers are gone after shutdown() and
  after garbage collection. The same at TP=4 for llama (each KV head on two ranks).
- A killed worker: AsyncLLM's streams end with a RuntimeError naming the rank, the engine stops
  (is_running False) and new requests are refused, all within a pytest timeout (no hang). A
  worker that fails in a step: LLM.generate raises its traceback, and keeps raising.
- Clear errors before any process starts: heads that do not split, too few GPUs.
- The rank-0 path with a 1-rank gloo group (what a one-GPU machine can run of the NCCL path).
- The step's wire format round-trips.

Process start-up is slow on a loaded 2-core machine: every test here starts at most one worker,
except the TP=4 one (three).
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
import signal
import time

import numpy as np
import pytest
import torch
from helpers.models import single_thread, tiny_hf_model  # noqa: F401 - autouse fixture

import tinypaged.engine.engine as engine_module
import tinypaged.worker.executor as executor_module
from tinypaged import LLM, SamplingParams
from tinypaged.engine.async_llm import AsyncLLM
from tinypaged.worker.executor import MultiprocExecutor, tp_devices
from tinypaged.worker.model_runner import StepInput
from tinypaged.worker.tp_worker import pack_step, unpack_step

# kind -> tiny model overrides; qwen3's single KV head is fewer than the 2 ranks
MODELS = {"llama": {}, "qwen3": {"num_key_value_heads": 1}, "glm": {}, "glm4_moe": {}}
ENGINE = dict(skip_tokenizer_init=True, num_kv_blocks=64, block_size=8,
              max_num_batched_tokens=24)  # chunked prefill: prefill and decode share steps


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    dirs = {}
    for kind, overrides in MODELS.items():
        path = tmp_path_factory.mktemp(kind)
        tiny_hf_model(kind, seed=11, **overrides).save_pretrained(path)
        dirs[kind] = path
    return dirs


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    shared = rng.integers(2, 250, 20).tolist()  # a shared prefix: prefix-cache hits
    return [shared + [7, 8], shared + [9], rng.integers(2, 250, 5).tolist(),
            rng.integers(2, 250, 33).tolist()]


def greedy_tokens(llm: LLM, batch: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def wait_dead(processes, timeout: float = 20.0) -> list[bool]:
    deadline = time.monotonic() + timeout
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    return [p.is_alive() for p in processes]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", list(MODELS))
def test_tp2_greedy_matches_tp1(model_dirs, kind):
    path = str(model_dirs[kind])
    batch = prompts()
    expected = greedy_tokens(LLM(path, **ENGINE), batch)

    llm = LLM(path, tensor_parallel_size=2, **ENGINE)
    executor = llm.engine.executor
    workers = [w.process for w in executor.workers]
    try:
        kv_heads = MODELS[kind].get("num_key_value_heads", 2)
        assert llm.engine.runner.model.num_kv_heads == max(1, kv_heads // 2)
        assert greedy_tokens(llm, batch) == expected
        assert greedy_tokens(llm, batch) == expected  # again, over cached prefixes
        stats = llm.engine.get_stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"] == 64
        # Sharded loading: each rank read its half of the big tensors, not the checkpoint.
        total = sum(f.stat().st_size for f in model_dirs[kind].glob("*.safetensors"))
        assert len(executor.bytes_read) == 2
        for read in executor.bytes_read:
            assert 0.4 * total < read < 0.7 * total, (executor.bytes_read, total)
    finally:
        llm.shutdown()
    assert wait_dead(workers) == [False]
    llm.shutdown()  # idempotent


@pytest.mark.timeout(180)
def test_tp4_greedy_matches_tp1(model_dirs):
    """Any N, not only 2: four ranks, llama's 2 KV heads each held by two ranks."""
    path = str(model_dirs["llama"])
    batch = prompts()
    expected = greedy_tokens(LLM(path, **ENGINE), batch)
    llm = LLM(path, tensor_parallel_size=4, **ENGINE)
    workers = [w.process for w in llm.engine.executor.workers]
    try:
        assert len(workers) == 3 and llm.engine.runner.model.num_kv_heads == 1
        assert greedy_tokens(llm, batch) == expected
    finally:
        llm.shutdown()
    assert wait_dead(workers) == [False] * 3


@pytest.mark.timeout(120)
def test_garbage_collection_stops_the_workers(model_dirs):
    llm = LLM(str(model_dirs["llama"]), tensor_parallel_size=2, **ENGINE)
    workers = [w.process for w in llm.engine.executor.workers]
    assert [p.is_alive() for p in workers] == [True]
    del llm
    gc.collect()
    assert wait_dead(workers) == [False]


@pytest.mark.timeout(120)
def test_killed_worker_fails_requests_and_stops_the_engine(model_dirs):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    async def scenario():
        engine = AsyncLLM(str(model_dirs["qwen3"]), tensor_parallel_size=2, **ENGINE)
        worker = engine.engine.executor.workers[0].process
        try:

            async def consume(i: int):
                async for _ in engine.generate({"prompt_token_ids": [5, 6, 7 + i]}, params,
                                               f"req-{i}"):
                    pass

            # Frozen, the worker leaves rank 0 waiting inside the first collective of the step
            # (or about to send it the next step); then it dies.
            os.kill(worker.pid, signal.SIGSTOP)
            tasks = [asyncio.create_task(consume(i)) for i in range(3)]
            await asyncio.sleep(0.5)
            os.kill(worker.pid, signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
            for result in results:
                assert isinstance(result, RuntimeError), result
                assert f"worker rank 1 (pid {worker.pid}) was killed by signal SIGKILL" in str(
                    result)
            assert not engine.is_running  # what /health reports as 503
            with pytest.raises(RuntimeError, match="not running: tensor-parallel worker rank 1"):
                async for _ in engine.generate({"prompt_token_ids": [1, 2]}, params, "late"):
                    pass
        finally:
            await engine.shutdown()

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_worker_error_reaches_the_caller_with_its_traceback(model_dirs, monkeypatch):
    llm = LLM(str(model_dirs["llama"]), tensor_parallel_size=2, **ENGINE)
    workers = [w.process for w in llm.engine.executor.workers]
    try:
        # The worker cannot decode this step: it reports its error and exits; rank 0, left
        # alone in a collective, raises the worker's error instead of gloo's.
        monkeypatch.setattr(executor_module, "pack_step", lambda step: b"garbage!")
        with pytest.raises(RuntimeError, match=r"(?s)worker rank 1 \(pid \d+\) exited with code "
                                               r"1; its error:.*Traceback.*ValueError"):
            greedy_tokens(llm, prompts())
        assert llm.engine.is_dead
        with pytest.raises(RuntimeError, match="worker rank 1"):  # and stays dead
            greedy_tokens(llm, prompts())
    finally:
        llm.shutdown()
    assert wait_dead(workers) == [False]


def test_heads_that_do_not_split_fail_before_any_process_starts(model_dirs):
    before = multiprocessing.active_children()
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by the "
                                         r"tensor-parallel size \(3\)"):
        LLM(str(model_dirs["llama"]), tensor_parallel_size=3, **ENGINE)
    assert multiprocessing.active_children() == before


def test_more_ranks_than_gpus_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert tp_devices(torch.device("cuda", 0), 2) == [torch.device("cuda", 0),
                                                      torch.device("cuda", 1)]
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 needs GPUs cuda:0..cuda:3, "
                                         r"but 2 GPU\(s\) are visible"):
        tp_devices(torch.device("cuda", 0), 4)
    with pytest.raises(ValueError, match="cuda:1..cuda:2"):
        tp_devices(torch.device("cuda", 1), 2)
    assert tp_devices(torch.device("cpu"), 3) == [torch.device("cpu")] * 3


def test_one_rank_group_runs_the_rank0_path(model_dirs, monkeypatch):
    """N=1 through MultiprocExecutor: a gloo group of one, steps as arrays, all-reduces through
    torch.distributed (on a GPU the same check covers NCCL and graph capture)."""
    path = str(model_dirs["glm"])
    batch = prompts()
    expected = greedy_tokens(LLM(path, **ENGINE), batch)
    monkeypatch.setattr(engine_module, "create_executor", MultiprocExecutor)
    llm = LLM(path, **ENGINE)
    try:
        assert torch.distributed.is_initialized()
        assert greedy_tokens(llm, batch) == expected
    finally:
        llm.shutdown()
    assert not torch.distributed.is_initialized()


def test_step_round_trips_through_bytes():
    rng = np.random.default_rng(1)
    step = StepInput(
        input_ids=rng.integers(0, 1000, 7), positions=rng.integers(0, 99, 7),
        slot_mapping=rng.integers(0, 500, 7), query_start_loc=np.array([0, 4, 7], np.int32),
        seq_lens=np.array([30, 9], np.int32),
        block_tables=rng.integers(0, 60, (2, 4)).astype(np.int32),
        logits_indices=np.array([3, 6]), max_query_len=4, max_seq_len=30,
    )
    back = unpack_step(pack_step(step))
    for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens",
                 "block_tables", "logits_indices"):
        ours, theirs = getattr(back, name), getattr(step, name)
        assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs), name
        assert ours.flags.writeable
    assert (back.max_query_len, back.max_seq_len) == (4, 30)
    assert back.verify_rows is None and back.broadcast_verified == 0
    # behind an overlapped verification (spec_decode/decoder.py), whose tokens come after it
    step.verify_rows, step.verify_assumed = np.array([2, -1]), np.array([5, 0])
    step.broadcast_verified = 5
    back = unpack_step(pack_step(step))
    for name in ("input_ids", "verify_rows", "verify_assumed", "block_tables"):
        ours, theirs = getattr(back, name), getattr(step, name)
        assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs), name
        assert ours.flags.aligned
    assert back.broadcast_verified == 5
