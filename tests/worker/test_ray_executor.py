"""distributed_executor_backend="ray" (worker/ray_executor.py): tensor-parallel ranks as Ray actors
on a local multi-node cluster (`ray.cluster_utils.Cluster`, several nodes on one machine).

- Without Ray installed: a clear ImportError naming the install command (always runs).
- TINYPAGED_LONG_TESTS=1 (and Ray installed; starting the cluster takes ~1-2 min on a loaded
  2-core machine): TP=2 with rank 1 on another node (the head node has no CPU for actors)
  gives the greedy tokens of TP=1; shutdown kills every actor and removes the placement group;
  a killed actor fails the engine with an error naming the rank, within seconds.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest
from helpers.models import single_thread, tiny_hf_model  # noqa: F401 - autouse fixture

from tinypaged import LLM, SamplingParams
from tinypaged.worker.ray_executor import import_ray

ENGINE = dict(skip_tokenizer_init=True, num_kv_blocks=64, block_size=8, dtype="float32",
              device="cpu", max_num_batched_tokens=24)  # chunked prefill
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
long_only = pytest.mark.skipif(not os.environ.get("TINYPAGED_LONG_TESTS"),
                               reason="a Ray cluster takes minutes here: TINYPAGED_LONG_TESTS=1")


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
def cluster():
    pytest.importorskip("ray")
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})  # actors go elsewhere
    c.add_node(num_cpus=1)
    c.add_node(num_cpus=1)
    ray.init(address=c.address)
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    tiny_hf_model("llama", seed=11).save_pretrained(path)
    return str(path)


def tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


@long_only
def test_tp2_over_ray_nodes_equals_one_rank_and_leaves_nothing(cluster, model_dir):
    import ray

    one = LLM(model_dir, **ENGINE)
    expected = tokens(one)
    one.shutdown()
    llm = LLM(model_dir, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
    executor = llm.engine.executor
    assert len(executor.actors) == 1 and executor.state.where[0][1] != os.getpid()
    here = ray.get_runtime_context().get_node_id()
    assert ray.get(executor.actors[0].node_id.remote()) != here  # rank 1 on another node
    assert tokens(llm) == expected
    actors, pg = list(executor.actors), executor.pg
    llm.shutdown()
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.where.remote(), timeout=30)
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"


@long_only
def test_a_killed_actor_fails_the_engine_within_seconds(cluster, model_dir):
    import ray

    llm = LLM(model_dir, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
    tokens(llm)
    ray.kill(llm.engine.executor.actors[0])
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="tensor-parallel worker rank 1 \\(Ray actor"):
        tokens(llm)
    assert time.monotonic() - start < 30
    with pytest.raises(RuntimeError, match="rank 1"):  # and it stays failed
        tokens(llm)
    llm.shutdown()
