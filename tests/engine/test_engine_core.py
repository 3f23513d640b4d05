"""The engine loop in its own process (AsyncLLM with multiprocess_mode, engine/core_client.py):
the same outputs as with the loop in a thread,
refusals and aborts across the pipe, a dead engine process or a shutdown ends every open stream,
and the server runs on it unchanged. A tiny random Llama on the CPU; each client spawns one
engine process (a few seconds)."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest
from helpers.server import post, running_server

from tinypaged.bench.model_shapes import write_word_tokenizer
from tinypaged.engine.async_llm import AsyncLLM
from tinypaged.engine.core import use_engine_process
from tinypaged.entrypoints.openai.api_server import build_app
from tinypaged.sampling.params import SamplingParams

VOCAB = 512
KWARGS = dict(load_format="dummy", dtype="float32", max_model_len=256, num_kv_blocks=64,
              enable_prefix_caching=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64,
                  intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="float32",
                  bos_token_id=1, eos_token_id=2)
    (path / "config.json").write_text(json.dumps(config))
    write_word_tokenizer(path, VOCAB, 256)
    return str(path)


@pytest.fixture(scope="module")
def client(model_dir):
    engine = AsyncLLM(model_dir, multiprocess_mode=True, **KWARGS)
    yield engine
    asyncio.run(engine.shutdown())


async def collect(engine, prompt, params, request_id):
    outs = [out async for out in engine.generate(prompt, params, request_id)]
    return outs[-1]


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
