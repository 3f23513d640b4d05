"""EngineClient, the one seam between the server and an engine: AsyncLLM and the test fakes
implement all of it, a fake that lacks a member cannot be built, and the server touches nothing
of an engine beyond it."""

from __future__ import annotations

import sys
import time

import httpx
import pytest
from helpers.server import FakeEngine, ScriptedEngine, post, running_server

from tinypaged.engine.async_llm import AsyncLLM
from tinypaged.engine.client import EngineClient
from tinypaged.entrypoints.openai.api_server import build_app

MEMBERS = {name for name in vars(EngineClient) if not name.startswith("_")}


@pytest.mark.parametrize("cls", [AsyncLLM, FakeEngine, ScriptedEngine])
def test_engines_implement_every_member(cls):
    assert issubclass(cls, EngineClient)
    assert not cls.__abstractmethods__, f"{cls.__name__} lacks {set(cls.__abstractmethods__)}"


def test_the_interface_is_what_the_server_uses():
    assert MEMBERS == {
        "tokenizer", "config", "model_name", "default_sampling_params", "kv_cache_info",
        "is_running", "get_stats", "generate", "abort", "shutdown",
    }
    assert EngineClient.__abstractmethods__ == MEMBERS


@pytest.mark.parametrize("missing", sorted(MEMBERS))
def test_a_fake_missing_a_member_cannot_be_built(missing):
    # A fake written against an older interface fails at once, naming what it lacks.
    partial = type("Partial", (EngineClient,), {
        name: getattr(FakeEngine, name) for name in MEMBERS if name != missing
    })
    with pytest.raises(TypeError, match=missing):
        partial()


def test_the_server_refuses_an_engine_that_is_not_an_engine_client():
    class Duck:
        model_name = "duck"

    with pytest.raises(TypeError, match="EngineClient.*Duck"):
        build_app(Duck())


class StrictEngine(FakeEngine):
    """FakeEngine that fails when code of the tinypaged package reads a public attribute that
    the interface does not have (the engine's scheduler, runner, requests, ...)."""

    def __getattribute__(self, name: str):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("tinypaged") and not name.startswith("__") and name not in MEMBERS:
            raise AssertionError(f"{caller} reads engine.{name}, which EngineClient lacks")
        return super().__getattribute__(name)


def test_the_server_reaches_the_engine_only_through_the_interface():
    engine = StrictEngine()
    with running_server(build_app(engine)) as url:
        for path, body in (
            ("/v1/completions", {"prompt": "hi", "max_tokens": 3}),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream": True}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 3, "logprobs": True}),
            ("/tokenize", {"prompt": "hi"}),
            ("/detokenize", {"tokens": [104, 105]}),
        ):
            assert post(url, path, body).status_code == 200, path
        for path in ("/v1/models", "/health", "/metrics"):
            assert httpx.get(url + path, timeout=10).status_code == 200, path
        # a client that hangs up makes the server abort through the interface too
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json={"prompt": "SLOW", "max_tokens": 8},
                       timeout=0.3)
        deadline = time.monotonic() + 10
        while not engine.aborted and time.monotonic() < deadline:
            time.sleep(0.01)
    assert engine.aborted
