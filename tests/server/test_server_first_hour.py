"""What a new user meets first, through a real server on a tiny random Llama that speaks the
default model's tokenizer and chat template (SmolLM2's, which drops `tools`):

- a missing optional package is a 400 naming the install command (never a 500), and the
  server warns about it at start-up;
- a chat template that drops `tools` is detected: tool_choice "auto" is a 400 that says so,
  "required" is served (constrained to a call) with one warning in the log.
"""

from __future__ import annotations

import asyncio
import logging
import sys

import httpx
import pytest
from helpers.models import single_thread  # noqa: F401
from helpers.server import assert_error, build_tiny_model, post, running_server

from tinypaged import AsyncLLM
from tinypaged.entrypoints.openai import template_tools
from tinypaged.entrypoints.openai.api_server import build_app

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    engine = AsyncLLM(str(build_tiny_model(tmp_path_factory.mktemp("tiny"))), num_kv_blocks=32,
                      block_size=8, max_model_len=256)
    yield engine
    asyncio.run(engine.shutdown())


def test_missing_xgrammar_is_a_400_naming_the_install_and_a_startup_warning(
    engine, monkeypatch, caplog
):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar -> ImportError
    with caplog.at_level(logging.WARNING):
        app = build_app(engine)
    assert any("xgrammar" in r.getMessage() and "pip install" in r.getMessage()
               for r in caplog.records)
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    with running_server(app) as url:
        for path, body in [
            ("/v1/chat/completions", {"messages": ASK, "max_tokens": 4, "response_format": {
                "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}),
            ("/v1/completions", {"prompt": "x", "max_tokens": 4, "guided_regex": "[a-z]+",
                                 "stream": True}),
        ]:
            err = assert_error(post(url, path, body), 400, None, "xgrammar",
                               "pip install 'xgrammar>=0.2.9'")  # the hint of a checkout
            assert err["code"] == "missing_package"
        # the server lives on: an unconstrained request still answers
        r = post(url, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_a_template_that_drops_tools_is_detected(engine, caplog):
    tok = engine.tokenizer
    assert template_tools.template_drops_tools(tok)  # SmolLM2's template
    qwen_like = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                 "{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}")
    assert not template_tools.template_drops_tools(tok, qwen_like)

    app = build_app(engine, tool_call_parser="hermes", enable_auto_tool_choice=True)
    with running_server(app) as url:
        body = {"messages": ASK, "tools": [WEATHER], "max_tokens": 8}
        err = assert_error(post(url, "/v1/chat/completions", {**body, "tool_choice": "auto"}),
                           400, "tools", "does not render 'tools'", "tool_choice 'required'")
        assert err["code"] == "tools_not_supported"
        r = post(url, "/v1/chat/completions", {**body, "tool_choice": "none"})
        assert r.status_code == 200, r.text
        with caplog.at_level(logging.WARNING):
            for _ in range(2):
                r = httpx.post(url + "/v1/chat/completions", timeout=300,
                               json={**body, "max_tokens": 24, "tool_choice": "required"})
                assert r.status_code == 200, r.text
        warnings = [r for r in caplog.records if "does not render 'tools'" in r.getMessage()]
        assert len(warnings) == 1  # once per template
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "tool_calls":  # a random model may run out of tokens
            assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
