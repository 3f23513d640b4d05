"""Hostile input against the HTTP side (FakeEngine, a test double of AsyncLLM): bodies that do
not decode, text that is not Unicode, prompts too long to be worth tokenizing, extreme numbers,
clients that hang up before sending their body, huge URLs. Each is a 4xx with OpenAI's error
body; nothing is a 500 or is logged as an internal error."""

from __future__ import annotations

import logging
import socket
import time

import httpx
import pytest
from helpers.server import FakeEngine, assert_error, post, running_server

from tinypaged.entrypoints.openai.api_server import build_app


@pytest.fixture(scope="module")
def fake():
    engine = FakeEngine(max_model_len=64)
    with running_server(build_app(engine, max_body_bytes=1_000_000)) as url:
        yield engine, url


CHAT = "/v1/chat/completions"

UNDECODABLE = [  # (path, raw body, param, words in the message)
    ("/v1/completions", b'{"prompt": "t5 \\ud800"}', "prompt", "surrogate"),
    ("/tokenize", b'{"prompt": "t5 \\udfff x"}', "prompt", "surrogate"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages", "surrogate"),
    ("/v1/completions", b'{"prompt": "a", "stop": ["\\ud800"]}', "stop", "surrogate"),
    ("/v1/completions", b'{"\\ud800": 1, "prompt": "a"}', "body", "surrogate"),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, "body", "nested too deeply"),
    ("/v1/completions", b'{"prompt": "a", "top_k": ' + b"9" * 4301 + b"}", "body", "4300"),
    ("/v1/completions", b'{"prompt": "a\xed\xa0\x80"}', "body", "utf-8"),
]


@pytest.mark.parametrize("path,raw,param,word", UNDECODABLE)
def test_bodies_that_do_not_decode_are_400(fake, path, raw, param, word):
    err = assert_error(post(fake[1], path, raw), 400, param, word)
    assert err["type"] == "invalid_request_error"


def test_paired_surrogate_escapes_are_text(fake):
    r = post(fake[1], "/tokenize", b'{"prompt": "ok \\ud83d\\ude00"}')
    assert r.status_code == 200 and r.json()["tokens"] == [ord(c) for c in "ok \U0001f600"]


EXTREME = [  # values vLLM refuses or bounds (nothing here may reach the batch)
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    ({"repetition_penalty": 1e300}, "repetition_penalty"),
    ({"temperature": 1e308}, "temperature"),
    ({"top_k": 10**400, "temperature": 1}, "top_k"),
    ({"seed": 2**64}, "seed"),
    ({"stop_token_ids": [10**30], "min_tokens": 1}, "stop_token_ids"),
    ({"min_tokens": 10**30}, "min_tokens"),
    ({"max_tokens": 10**30}, "max_tokens"),
]


@pytest.mark.parametrize("fields,param", EXTREME)
def test_extreme_values_are_400(fake, fields, param):
    err = assert_error(post(fake[1], "/v1/completions", {"prompt": "a", **fields}), 400, param)
    assert len(err["message"]) < 400  # the value is shown cut short, never echoed whole


def test_a_prompt_too_long_to_fit_is_refused_before_tokenizing(fake):
    engine, url = fake
    calls = []
    encode = engine.tokenizer.encode
    engine.tokenizer.encode = lambda text, **kw: calls.append(len(text)) or encode(text, **kw)
    try:
        # 64 tokens of context x at most 1 character per token x the margin of 4: 256 characters
        err = assert_error(post(url, "/v1/completions", {"prompt": "y" * 300}), 400, "prompt",
                           "300 characters")
        assert err["code"] == "context_length_exceeded" and calls == []
        big = [{"role": "user", "content": "y" * 200}, {"role": "user", "content": "z" * 100}]
        assert_error(post(url, CHAT, {"messages": big}), 400, "messages", "characters")
        assert calls == []
        # Under the bound: tokenized, then measured in tokens.
        assert_error(post(url, "/v1/completions", {"prompt": "y" * 100}), 400, "prompt",
                     "max_model_len")
        assert calls == [100]
    finally:
        engine.tokenizer.encode = encode


def test_huge_path_is_not_echoed(fake):
    r = httpx.get(fake[1] + "/" + "x" * 10_000)
    assert r.status_code == 404 and len(r.json()["error"]["message"]) < 300


def test_client_gone_before_its_body_is_neither_a_500_nor_logged(fake, caplog):
    host, port = fake[1].removeprefix("http://").split(":")
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            with socket.create_connection((host, int(port)), timeout=5) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                          b"application/json\r\ncontent-length: 1000\r\n\r\n{\"prompt\": ")
                time.sleep(0.05)
        time.sleep(0.3)
        r = post(fake[1], "/v1/completions", {"prompt": "a", "max_tokens": 2})
    assert r.status_code == 200
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR], caplog.text
