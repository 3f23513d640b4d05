"""The one engine loop (EngineCore, engine/core.py) on its own, and AsyncLLM running it in a
thread or in a process of its own (multiprocess_mode): the loop's typed messages (one per step,
the prompt only in a request's first output, EngineStopped last), the same outputs and the same
refusals in both modes, aborts across the pipe, a dead engine (thread or process) or a shutdown
ends every open stream, and the server runs on the engine process unchanged. A tiny random Llama
on the CPU; each multiprocess client spawns one engine process (a few seconds)."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import threading
from collections import deque

import pytest
from helpers.models import write_dummy_llama
from helpers.server import post, running_server

from tinypaged.config import EngineConfig
from tinypaged.engine.async_llm import AsyncLLM
from tinypaged.engine.core import EngineCore, use_engine_process
from tinypaged.engine.engine import Engine
from tinypaged.engine.messages import (
    AbortRequest,
    AddRequest,
    EngineStepOutput,
    EngineStopped,
    Shutdown,
)
from tinypaged.entrypoints.openai.api_server import build_app
from tinypaged.sampling.params import SamplingParams
from tinypaged.sampling.structured_output import StructuredOutputsParams

VOCAB = 512
KWARGS = dict(load_format="dummy", dtype="float32", max_model_len=256, num_kv_blocks=64,
              enable_prefix_caching=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_dummy_llama(tmp_path_factory.mktemp("tiny-llama"), VOCAB)


@pytest.fixture(scope="module")
def client(model_dir):
    engine = AsyncLLM(model_dir, multiprocess_mode=True, **KWARGS)
    yield engine
    asyncio.run(engine.shutdown())


async def collect(engine, prompt, params, request_id):
    outs = [out async for out in engine.generate(prompt, params, request_id)]
    return outs[-1]


def run_loop(model_dir, replies: list) -> list:
    """Run EngineCore on a new engine until its inbox, scripted as the replies to successive
    recv() calls (Shutdown once they run out), ends it; returns every message it sent."""
    engine = Engine(EngineConfig.from_kwargs(model=model_dir, **KWARGS))
    replies, sent = deque(replies), []
    EngineCore(engine, lambda block: replies.popleft() if replies else Shutdown(),
               sent.append).run()
    return sent


def test_the_engine_loop_sends_one_message_per_step(model_dir):
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    sent = run_loop(model_dir, [AddRequest("a", [5, 6, 7], greedy),
                                AddRequest("refused", [VOCAB], greedy),
                                AddRequest("b", "t9 t10", greedy), None, None,
                                AbortRequest("b"), None])
    *steps, stopped = sent
    assert isinstance(stopped, EngineStopped) and stopped.error is None
    assert stopped.stats["num_free_blocks"] == stopped.stats["num_total_blocks"]
    assert all(isinstance(m, EngineStepOutput) and m.stats is not None for m in steps)
    assert len(steps) == 3  # each None ends a round of messages: a step; b aborted before #3
    errors = [e for m in steps for e in m.errors]
    assert len(errors) == 1 and errors[0][0] == "refused" and "out of range" in str(errors[0][1])
    outs: dict[str, list] = {}
    for m in steps:
        for out in m.outputs:
            outs.setdefault(out.request_id, []).append(out)
    assert [len(outs["a"]), len(outs["b"])] == [3, 2]
    # The prompt only in a request's first output: the other side keeps it from there.
    assert (outs["a"][0].prompt, outs["a"][0].prompt_token_ids) == (None, [5, 6, 7])
    assert outs["b"][0].prompt == "t9 t10" and outs["b"][0].prompt_token_ids
    assert all(o.prompt is None and o.prompt_token_ids is None
               for o in outs["a"][1:] + outs["b"][1:])
    assert outs["a"][-1].finished and not outs["b"][-1].finished
    # Everything the loop sends crosses a pipe unchanged.
    for message in sent:
        assert repr(pickle.loads(pickle.dumps(message))) == repr(message)


def test_shutdown_drops_open_requests_and_frees_their_blocks(model_dir):
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    sent = run_loop(model_dir, [AddRequest("long", [5] * 40, long), None, None])
    assert [type(m) for m in sent] == [EngineStepOutput, EngineStepOutput, EngineStopped]
    assert sent[1].stats["num_running"] == 1 and sent[-1].error is None
    assert sent[-1].stats["num_running"] == 0
    assert sent[-1].stats["num_free_blocks"] == sent[-1].stats["num_total_blocks"]


def test_requests_pickle():
    params = SamplingParams(max_tokens=5, stop=["x"], logit_bias={3: 1.0},
                            structured_outputs=StructuredOutputsParams(regex="[ab]+"))
    for message in (AddRequest("r", {"prompt_token_ids": [1, 2]}, params), AbortRequest("r"),
                    Shutdown()):
        assert pickle.loads(pickle.dumps(message)) == message


async def generate_all(engine) -> list:
    params = [SamplingParams(max_tokens=6, temperature=0.0),
              SamplingParams(max_tokens=5, temperature=1.0, seed=7, n=2),
              SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=[0])]
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": list(range(20, 60))},
               "t9 t10 t11"]
    finals = await asyncio.gather(*[
        collect(engine, p, sp, f"req-{i}") for i, (p, sp) in enumerate(zip(prompts, params))
    ])
    return [(f.prompt, f.prompt_token_ids, f.finished,
             [(c.token_ids, c.text, c.finish_reason) for c in f.outputs]) for f in finals]


def test_outputs_equal_the_in_process_engine(client, model_dir):
    local = AsyncLLM(model_dir, **KWARGS)
    try:
        want = asyncio.run(generate_all(local))
    finally:
        asyncio.run(local.shutdown())
    assert asyncio.run(generate_all(client)) == want
    assert client.config.max_model_len == 256 and client.tokenizer.decode([9]) == "t9"
    assert client.kv_cache_info["num_blocks"] == 64 and client.is_running


def test_refusals_come_back_as_value_errors(client):
    async def run():
        with pytest.raises(ValueError, match="out of range"):
            await collect(client, [VOCAB + 3], SamplingParams(max_tokens=2), "bad-id")
        long = client.generate([5] * 8, SamplingParams(max_tokens=200, ignore_eos=True), "dup")
        await anext(long)
        with pytest.raises(ValueError, match="already in use"):
            await collect(client, [5], SamplingParams(max_tokens=2), "dup")
        await long.aclose()  # aborts it in the engine process

    asyncio.run(run())


GREEDY = SamplingParams(max_tokens=2, temperature=0.0)
REFUSED = [  # what the engine refuses, and a part of why
    ([VOCAB + 3], GREEDY, "out of range"),
    ([5], SamplingParams(max_tokens=2, stop_token_ids=[VOCAB]), "stop_token_ids"),
    ([5] * 255, GREEDY, "max_model_len"),  # the prompt and max_tokens do not fit
    ("t5 t6", SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(
        regex="a(b")), "structured_outputs.regex"),
    ("t5", {"max_tokens": 2}, "must be a SamplingParams"),
]


async def refusals(engine) -> tuple[list, list[int]]:
    async def refused(i: int, prompt, params) -> tuple[str, str]:
        with pytest.raises(Exception) as info:
            await collect(engine, prompt, params, f"refused-{i}")
        return type(info.value).__name__, str(info.value)

    others = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    fine = [asyncio.create_task(collect(engine, [5, 6, 7], others, f"fine-{i}")) for i in range(2)]
    errors = await asyncio.gather(*(refused(i, p, sp) for i, (p, sp, _) in enumerate(REFUSED)))
    return errors, [(await task).outputs[0].token_ids for task in fine]


def test_refusals_are_the_same_in_a_thread_and_in_a_process(client, model_dir):
    """Each refused request fails alone, with the same exception in both modes: the engine loop
    validates it wherever it runs."""
    local = AsyncLLM(model_dir, **KWARGS)
    try:
        want = asyncio.run(refusals(local))
    finally:
        asyncio.run(local.shutdown())
    assert asyncio.run(refusals(client)) == want
    errors, fine = want
    for (kind, text), (_, _, why) in zip(errors, REFUSED):
        assert kind == "ValueError" and why in text, (kind, text)
    assert [len(ids) for ids in fine] == [4, 4]


def test_a_request_that_does_not_pickle_fails_alone(client):
    """Only the engine process's pipe needs pickling: such a request fails, the next one runs."""
    async def run():
        with pytest.raises(TypeError, match="pickle"):
            await collect(client, {"prompt_token_ids": [5], "lock": threading.Lock()}, GREEDY,
                          "unpicklable")
        return await collect(client, [5], GREEDY, "next")

    assert len(asyncio.run(run()).outputs[0].token_ids) == 2


def test_a_dead_engine_thread_fails_open_streams(model_dir):
    """A tensor-parallel rank dies (simulated) under the engine thread: every open stream ends
    with its error, is_running turns False, later requests are refused at once."""
    engine = AsyncLLM(model_dir, **KWARGS)
    inner, step, dead = engine.engine, engine.engine.step, []

    def dying_step(*args, **kwargs):
        if dead:
            inner.executor.failure = "tensor-parallel worker rank 1 was killed"
            raise RuntimeError("tensor-parallel worker rank 1 was killed")
        return step(*args, **kwargs)

    inner.step = dying_step
    long = SamplingParams(max_tokens=200, ignore_eos=True)

    async def run():
        streams = [engine.generate([5] * 4, long, f"x{i}") for i in range(2)]
        await asyncio.gather(*(anext(s) for s in streams))
        dead.append(True)
        for stream in streams:
            with pytest.raises(RuntimeError, match="rank 1 was killed"):
                async for _ in stream:
                    pass
        assert not engine.is_running
        with pytest.raises(RuntimeError, match="not running: tensor-parallel worker rank 1"):
            await collect(engine, [5], SamplingParams(max_tokens=2), "y")
        await engine.shutdown()

    asyncio.run(run())
    stats = engine.get_stats()
    assert stats["num_running"] == stats["num_waiting"] == 0


def test_an_abort_frees_the_request(client):
    async def run():
        stream = client.generate([7] * 8, SamplingParams(max_tokens=200, ignore_eos=True), "a")
        await anext(stream)
        await stream.aclose()
        done = await collect(client, [8, 9], SamplingParams(max_tokens=3), "after-abort")
        for _ in range(100):
            if client.get_stats()["num_running"] == 0:
                break
            await asyncio.sleep(0.05)
        return done

    done = asyncio.run(run())
    assert done.finished and len(done.outputs[0].token_ids) == 3
    assert client.get_stats()["num_running"] == 0


def test_the_server_streams_from_the_engine_process(client):
    app = build_app(client, "tiny")
    with running_server(app) as url:
        r = post(url, "/v1/completions", {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 5,
                                          "temperature": 0, "ignore_eos": True, "stream": True,
                                          "stream_options": {"include_usage": True}})
        assert r.status_code == 200, r.text
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 5
        r = post(url, "/v1/completions", {"model": "tiny", "prompt": [VOCAB + 1]})
        assert r.status_code == 400 and "out of range" in r.json()["error"]["message"]


def test_a_dead_engine_process_fails_open_streams(model_dir):
    engine = AsyncLLM(model_dir, multiprocess_mode=True, **KWARGS)

    async def run():
        stream = engine.generate([5] * 4, SamplingParams(max_tokens=200, ignore_eos=True), "x")
        await anext(stream)
        os.kill(engine.core_client.proc.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="engine process exited"):
            async for _ in stream:
                pass
        assert not engine.is_running
        with pytest.raises(RuntimeError, match="not running"):
            await collect(engine, [5], SamplingParams(max_tokens=2), "y")
        await engine.shutdown()

    asyncio.run(run())


def test_shutdown_ends_open_streams_and_the_process(model_dir):
    engine = AsyncLLM(model_dir, multiprocess_mode=True, **KWARGS)

    async def run():
        stream = engine.generate([5] * 4, SamplingParams(max_tokens=200, ignore_eos=True), "x")
        await anext(stream)
        await engine.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):
            async for _ in stream:
                pass

    asyncio.run(run())
    assert not engine.core_client.proc.is_alive() and engine.core_client.proc.exitcode == 0


def test_when_serve_uses_an_engine_process(monkeypatch):
    monkeypatch.delenv("TINYPAGED_ENABLE_MULTIPROCESSING", raising=False)
    assert use_engine_process("cuda:1") and not use_engine_process("cpu")
    monkeypatch.setenv("TINYPAGED_ENABLE_MULTIPROCESSING", "1")
    assert use_engine_process("cpu")
    monkeypatch.setenv("TINYPAGED_ENABLE_MULTIPROCESSING", "0")
    assert not use_engine_process("cuda")
    monkeypatch.setenv("TINYPAGED_ENABLE_MULTIPROCESSING", "yes")
    with pytest.raises(ValueError, match="0 or 1.*'yes'"):
        use_engine_process(None)
