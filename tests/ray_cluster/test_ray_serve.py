"""The OpenAI server on Ray Serve (entrypoints/ray_serve/): 2 engine replicas on the 2 worker
nodes of the local cluster (conftest.py) behind one ingress, asked through the `openai` client.

- Both replicas run, one per node, and both answer; /metrics shows both engines.
- Cache affinity: requests sharing a long prefix go to the replica that served it first (every
  follow-up reads its prompt from that replica's prefix cache).
- Killing a replica: the stream it was serving ends with an error within seconds (no hang), the
  stream on the other replica goes on, and every request sent afterwards is answered.
- Without the cluster: `serve --ray` passes its flags to build_app; the router's policy (the
  prefix holder first, the least loaded when it is far busier, ties in turn, a dead replica's
  prefixes forgotten).
"""

from __future__ import annotations

import concurrent.futures
import socket
import time

import pytest
from helpers.models import save_byte_tokenizer, tiny_hf_model

openai = pytest.importorskip("openai")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica_actors() -> list[dict]:
    import ray._private.state as state

    return [a for a in state.actors().values() if a["State"] == "ALIVE"
            and "EngineReplica" in a.get("Name", "")]


@pytest.fixture(scope="module")
def served(cluster, tmp_path_factory):
    pytest.importorskip("ray.serve")
    from ray import serve

    from tinypaged.entrypoints.ray_serve.app import build_app

    path = tmp_path_factory.mktemp("served")
    tiny_hf_model("llama", seed=3, max_position_embeddings=4096).save_pretrained(path)
    save_byte_tokenizer(path)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_app(str(path), num_replicas=2, served_model_name="tiny", dtype="float32",
                    device="cpu", num_kv_blocks=1024, block_size=8, cpu_threads=1,
                    chat_template="{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
                    server_options={"enable_prompt_tokens_details": True})
    serve.run(app, name="tinypaged", route_prefix="/")
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                        timeout=60), port
    serve.delete("tinypaged")
    serve.shutdown()


def complete(client, prompt: str, max_tokens: int = 4):
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                     temperature=0.0, extra_body={"ignore_eos": True})


@pytest.mark.timeout(300)
def test_two_replicas_on_two_nodes_answer_with_prefix_affinity(served):
    import httpx

    client, port = served
    actors = replica_actors()
    assert len(actors) == 2
    assert len({a["Address"]["NodeID"] for a in actors}) == 2  # one replica per node
    prefixes = [f"{i} " * 100 for i in range(4)]  # 200 characters: 3 routing blocks each
    for p in prefixes:
        out = complete(client, p + "start")
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # follow-ups, all at once
        outs = list(pool.map(lambda i: complete(client, prefixes[i % 4] + f"q{i}"), range(8)))
    cached = [o.usage.prompt_tokens_details.cached_tokens for o in outs]
    assert all(c >= 192 for c in cached), cached  # on the replica that holds the prefix
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    assert 'engine="1"' in metrics  # two engines reported (each answered at least once)
    chat = client.chat.completions.create(model="tiny", max_tokens=3,
                                          messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content is not None


@pytest.mark.timeout(300)
def test_a_killed_replica_fails_its_stream_and_loses_no_other_request(served):
    import ray

    client, _ = served

    def stream(prompt: str):
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=3000,
                                         temperature=0.0, stream=True,
                                         extra_body={"ignore_eos": True})

    first = stream("first stream " * 5)
    next(iter(first))  # running on one replica
    second = stream("second stream " * 5)
    next(iter(second))  # the other replica: the first one's queue is longer
    victim = replica_actors()[0]["Name"]
    ray.kill(ray.get_actor(victim, namespace="serve"))
    start = time.monotonic()
    results = {}

    def drain(name, s, limit=200):
        try:
            for i, _ in enumerate(s):
                if i == limit:  # still streaming well after the kill
                    s.close()
                    break
            results[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - the stream on the killed replica
            results[name] = f"error: {exc}"

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda a: drain(*a), [("first", first), ("second", second)]))
    assert time.monotonic() - start < 60
    assert sorted(v.split(":")[0] for v in results.values()) == ["error", "ok"], results
    outs = [complete(client, f"after the kill {i} " * 3) for i in range(6)]
    assert all(o.usage.completion_tokens == 4 for o in outs)


def test_serve_ray_flags_reach_build_app(monkeypatch):
    pytest.importorskip("ray.serve")
    from tinypaged.entrypoints import cli
    from tinypaged.entrypoints.ray_serve import app as ray_serve

    seen = {}
    monkeypatch.setattr(ray_serve, "build_app", lambda **kw: seen.update(kw) or "app")
    monkeypatch.setattr(ray_serve, "run", lambda app, host, port: seen.update(ran=(app, port)))
    assert cli.main(["serve", "some/model", "--ray", "--num-replicas", "3", "--port", "8123",
                     "-pp", "2", "--served-model-name", "m"]) == 0
    assert seen["ran"] == ("app", 8123) and seen["num_replicas"] == 3
    assert seen["model"] == "some/model" and seen["pipeline_parallel_size"] == 2
    assert seen["served_model_name"] == ["m"]


def test_prefix_router_prefers_the_prefix_holder_unless_it_is_far_busier():
    """PrefixAffinityRouter's policy on its own (no cluster): Serve's replica objects and queue
    lengths stood in for by plain ones."""
    pytest.importorskip("ray.serve")
    import asyncio
    from types import SimpleNamespace

    from tinypaged.entrypoints.ray_serve.router import PrefixAffinityRouter

    queues = {"a": 0, "b": 0}
    router = PrefixAffinityRouter.__new__(PrefixAffinityRouter)
    router._replica_queue_len_cache = SimpleNamespace(get=queues.get)
    router.initialize_state(block_size=4, imbalance=2)
    a, b = SimpleNamespace(replica_id="a"), SimpleNamespace(replica_id="b")

    def choose(prompt):
        request = SimpleNamespace(args=[prompt])
        ranks = asyncio.run(router.choose_replicas([a, b], request))
        router.on_request_routed(request, ranks[0][0].replica_id, None)
        return ranks[0][0].replica_id, [r.replica_id for r in ranks[1]]

    shared = {"prompt_token_ids": list(range(12))}
    first, rest = choose(shared)
    assert rest == ["b" if first == "a" else "a"]  # the other one as the fallback rank
    assert choose({"prompt_token_ids": list(range(100, 112))})[0] != first  # ties in turn
    assert choose(shared)[0] == first and router.cache_hits == 1
    queues[first] = 3  # 3 more than the other: over the imbalance of 2
    second = choose(shared)[0]
    assert second != first and set(router.owner.values()) == {second}
    router._replicas, router._replica_id_set, router._queue_len_gauge_last_update = {}, set(), {}
    router.on_replica_actor_died(second)  # (the base class's bookkeeping needs those three)
    assert not router.owner  # every prefix it held is forgotten
