"""distributed_executor_backend="ray" (worker/ray_executor.py): tensor- and pipeline-parallel
ranks as Ray actors placed by a placement group, on the local multi-node cluster of conftest.py
(the head node has no CPU, so every actor runs on another node than the engine).

- Without Ray installed: a clear ImportError naming the install command (always runs).
- TP=2 (rank 1 on another node), PP=2 and TP=2 x PP=2 (3 actors over the 2 worker nodes) each
  give the greedy tokens of one rank (with stages, two batches in flight at once); shutdown
  kills every actor (and its process) and removes the placement group.
- A killed actor (PP=2's) fails the engine within seconds with an error naming the rank, and it
  stays failed; shutdown still leaves nothing.
- TP=2 with overlapped speculative verification (n-gram, async scheduling) gives one rank's
  greedy tokens.
Each engine's actors take ~10 s to start here (a Python process importing torch), so four
engines cover the six cases.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest
from helpers.models import (  # noqa: F401 - single_thread: autouse fixture
    run_engine,
    saved_tiny_model,
    single_thread,
)

from tinypaged import LLM, SamplingParams
from tinypaged.worker.ray_executor import import_ray

ENGINE = dict(skip_tokenizer_init=True, num_kv_blocks=64, block_size=8, dtype="float32",
              device="cpu", max_num_batched_tokens=24)  # chunked prefill
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def test_a_missing_ray_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'tinypaged\[ray\]'"):
        import_ray()


def prompts() -> list[dict]:
    rng = np.random.default_rng(0)
    shared = rng.integers(2, 250, 20).tolist()
    return [{"prompt_token_ids": p} for p in
            (shared + [7, 8], shared + [9], rng.integers(2, 250, 5).tolist())]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return saved_tiny_model(tmp_path_factory, "llama", seed=11, num_hidden_layers=3)


@pytest.fixture(scope="module")
def expected(model_dir):
    return run_engine(model_dir, tokens, **ENGINE)


def tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


def process_gone(pid: int, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def actor_dies(actor, timeout_s: float = 30.0) -> bool:
    """True once a call to `actor` fails as a dead actor's does. ray.kill is asynchronous: a call
    sent just after it can still reach the actor and be answered, so one answer proves nothing."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.where.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.RayActorError:
            return True
        except ray.exceptions.GetTimeoutError:
            return False
        time.sleep(0.2)
    return False


def start(model_dir: str, tp: int, pp: int) -> LLM:
    import ray

    llm = LLM(model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp,
              distributed_executor_backend="ray", **ENGINE)
    executor = llm.engine.executor
    assert len(executor.actors) == tp * pp - 1
    here = ray.get_runtime_context().get_node_id()
    nodes = ray.get([a.node_id.remote() for a in executor.actors])
    assert here not in nodes  # every other rank on another node than the engine
    if tp * pp == 4:  # 3 actors of 1 CPU do not fit one 2-CPU node
        assert len(set(nodes)) == 2
    return llm


def shut_down_leaving_nothing(llm: LLM) -> None:
    import ray

    executor = llm.engine.executor
    actors, pg = list(executor.actors), executor.pg
    pids = [pid for _, pid in executor.state.where]
    llm.shutdown()
    for actor in actors:
        assert actor_dies(actor)
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"
    assert all(process_gone(pid) for pid in pids)  # the simulated nodes are this machine


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2)])
def test_ray_ranks_on_other_nodes_equal_one_rank_and_leave_nothing(cluster, model_dir, expected,
                                                                   tp, pp):
    llm = start(model_dir, tp, pp)
    assert tokens(llm) == expected
    if pp > 1:  # the actors' calls of two steps were in flight at once (worker/pipeline.py)
        assert llm.engine.batch_queue.max_in_flight == 2
    shut_down_leaving_nothing(llm)


@pytest.mark.timeout(300)
def test_pp2_equals_one_rank_and_a_killed_actor_fails_it_within_seconds(cluster, model_dir,
                                                                        expected):
    import ray

    llm = start(model_dir, 1, 2)
    assert tokens(llm) == expected
    assert llm.engine.batch_queue.max_in_flight == 2
    ray.kill(llm.engine.executor.actors[0])
    begin = time.monotonic()
    with pytest.raises(RuntimeError, match="tensor-parallel worker rank 1 \\(Ray actor"):
        tokens(llm)
    assert time.monotonic() - begin < 30
    with pytest.raises(RuntimeError, match="rank 1"):  # and it stays failed
        tokens(llm)
    shut_down_leaving_nothing(llm)


@pytest.mark.timeout(300)
def test_tp2_overlapped_verification_equals_one_rank(cluster, model_dir):
    """n-gram speculation under async scheduling over a Ray actor: each step behind a
    verification in flight carries its rows' moves, and the actor takes the verification's
    tokens from rank 0 after it (worker/tp_worker.py), so the tokens are one rank's."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def run(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]

    want = run_engine(model_dir, run, **ENGINE)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2}
    llm = LLM(model_dir, tensor_parallel_size=2, distributed_executor_backend="ray",
              async_scheduling=True, speculative_config=spec, **ENGINE)
    try:
        assert run(llm) == want
        assert llm.engine.spec.overlap and llm.engine.spec.num_overlapped > 2
    finally:
        llm.shutdown()
