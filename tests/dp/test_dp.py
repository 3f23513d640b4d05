"""Data parallelism in one node (dp/): two engine processes behind the router, for the server
(DPAsyncLLM) and for LLM(data_parallel_size=2). Every request is answered once with the greedy
tokens of one engine, both engines work, a shared prefix lands on the engine that caches it,
aborts reach the right engine, /metrics labels each engine, and a killed engine fails its own
requests with an error naming it while the other keeps serving. A tiny random Llama on the CPU;
each DP=2 engine spawns two processes (a few seconds)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import pytest
from helpers.models import write_dummy_llama
from helpers.server import post, running_server

from tinypaged.dp.client import DPAsyncLLM
from tinypaged.engine.llm import LLM
from tinypaged.entrypoints.openai.api_server import build_app
from tinypaged.sampling.params import SamplingParams

VOCAB = 512
BS = 16
KWARGS = dict(load_format="dummy", dtype="float32", max_model_len=256, num_kv_blocks=64,
              block_size=BS, enable_prefix_caching=True)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
PROMPTS = [[3 + (7 * i + j) % 500 for j in range(5 + 3 * i)] for i in range(8)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_dummy_llama(tmp_path_factory.mktemp("tiny-llama"), VOCAB)


@pytest.fixture(scope="module")
def reference(model_dir):
    """DP=1: one engine in this process."""
    llm = LLM(model_dir, **KWARGS)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def dp(model_dir):
    engine = DPAsyncLLM(model_dir, data_parallel_size=2, **KWARGS)
    yield engine
    asyncio.run(engine.shutdown())


async def final(engine, prompt, params, request_id):
    outs = [out async for out in engine.generate(prompt, params, request_id)]
    return outs[-1]


@pytest.mark.skipif(not os.environ.get("TINYPAGED_LONG_TESTS"),
                    reason="two more engine processes (~20 s on 2 cores): TINYPAGED_LONG_TESTS=1")
def test_llm_data_parallel_equals_one_engine(model_dir, reference):
    llm = LLM(model_dir, data_parallel_size=2, **KWARGS)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference
        assert [o.prompt_token_ids for o in outs] == PROMPTS
        assert min(llm.engine.router.routed) > 0 and sum(llm.engine.router.routed) == 8
    finally:
        llm.shutdown()
    assert all(c.proc.exitcode is not None for c in llm.engine.clients)


def test_every_request_answered_once_greedy_equal_both_engines_used(dp, reference):
    async def run():
        return await asyncio.gather(*(final(dp, {"prompt_token_ids": p}, GREEDY, f"r{i}")
                                      for i, p in enumerate(PROMPTS)))

    outs = asyncio.run(run())
    assert [o.request_id for o in outs] == [f"r{i}" for i in range(8)]
    assert all(o.finished for o in outs)
    assert [o.outputs[0].token_ids for o in outs] == reference
    per_engine = dp.get_stats()["per_engine"]
    assert all(s["iteration_stats"].num_steps > 0 for s in per_engine)  # both stepped
    assert dp.router.load == [0, 0]


def test_a_shared_prefix_lands_on_the_engine_that_caches_it(dp):
    prefix = [100 + i for i in range(4 * BS)]  # four full blocks

    async def run():
        first = await final(dp, {"prompt_token_ids": prefix + [5]}, GREEDY, "p0")
        before = list(dp.router.routed)
        rest = await asyncio.gather(*(final(dp, {"prompt_token_ids": prefix + [6 + i, 7]},
                                            GREEDY, f"p{i + 1}") for i in range(4)))
        return first, before, rest

    first, before, rest = asyncio.run(run())
    assert first.num_cached_tokens == 0
    moved = [a - b for a, b in zip(dp.router.routed, before)]
    assert sorted(moved) == [0, 4]  # all four on one engine ...
    assert all(o.num_cached_tokens == 4 * BS for o in rest)  # ... the one holding the prefix


async def started(dp, prompt: list[int], request_id: str):
    """A long request's stream once its first output came, and the engine that runs it."""
    stream = dp.generate({"prompt_token_ids": prompt}, LONG, request_id)
    await anext(stream)
    return stream, dp._owner[request_id]


def test_abort_reaches_the_engine_that_has_the_request(dp):
    async def run():
        stream, i = await started(dp, [9, 8, 7], "long")
        assert dp.get_stats()["per_engine"][i]["num_running"] == 1
        await dp.abort("long")
        deadline = time.monotonic() + 10
        while dp.get_stats()["per_engine"][i]["num_running"]:
            assert time.monotonic() < deadline, "the abort did not reach the engine"
            await asyncio.sleep(0.05)
        await stream.aclose()
        # A stream closed early (a client that went away) is dropped by its engine too.
        stream, i = await started(dp, [9, 8, 6], "closed")
        await stream.aclose()
        while dp.get_stats()["per_engine"][i]["num_running"]:
            assert time.monotonic() < deadline + 10, "closing the stream did not abort it"
            await asyncio.sleep(0.05)

    asyncio.run(run())
    assert dp.router.load == [0, 0] and not dp._owner


def test_metrics_label_each_engine(dp):
    with running_server(build_app(dp)) as url:
        r = post(url, "/v1/completions", {"model": dp.model_name, "prompt": [5, 6, 7],
                                          "max_tokens": 3})
        assert r.status_code == 200, r.text
        text = httpx.get(url + "/metrics", timeout=10).text
    for i in (0, 1):
        assert re.search(rf'^tinypaged:num_requests_running{{engine="{i}",model_name="[^"]+"}} ',
                         text, re.M), text


def test_a_killed_engine_fails_its_requests_and_the_other_serves(dp):
    async def run():
        stream, victim = await started(dp, [4, 5, 6], "doomed")
        os.kill(dp.engines[victim].core_client.proc.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=f"data-parallel engine {victim} stopped"):
            async for _ in stream:
                pass
        assert time.monotonic() - start < 10
        outs = await asyncio.gather(*(final(dp, {"prompt_token_ids": p}, GREEDY, f"after{i}")
                                      for i, p in enumerate(PROMPTS[:3])))
        return victim, outs

    victim, outs = asyncio.run(run())
    assert all(o.finished for o in outs)
    assert dp.router.alive[victim] is False and dp.router.routed[victim] >= 1
    assert dp.is_running
