"""The rest of vLLM's OpenAI surface against the fake engine: status codes that follow vLLM,
/version, /invocations, CORS, token ids beside the text, continuous usage, prompt truncation."""

from __future__ import annotations

import httpx
import openai
import pytest
from helpers.server import FakeEngine, assert_error, post, running_server, sse_events

import tinypaged
from tinypaged.entrypoints.openai.api_server import build_app

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def fake():
    engine = FakeEngine(max_model_len=64)
    app = build_app(engine, enable_prompt_tokens_details=True,
                    cors={"allow_origins": ["http://app.example"]})
    with running_server(app) as url:
        yield engine, url


@pytest.fixture(scope="module")
def client(fake):
    return openai.OpenAI(base_url=fake[1] + "/v1", api_key="none", max_retries=0)


def test_status_codes_as_vllm(fake, client):
    url = fake[1]
    for seed in (2**63, -(2**63) - 1):
        assert_error(post(url, "/v1/completions", {"prompt": "a", "seed": seed}), 400, "seed")
    assert post(url, "/v1/completions", {"prompt": "a", "seed": 2**63 - 1}).status_code == 200
    r = post(url, "/v1/completions", {"prompt": "a", "model": ""})  # "" serves the default
    assert r.status_code == 200 and r.json()["model"] == "fake-model"
    # A completion without max_tokens gets 16 tokens (OpenAI's and vLLM's default) ...
    assert client.completions.create(model="", prompt="hi").usage.completion_tokens == 16
    # ... or what is left of the context; a chat without it runs to the end of the context.
    r = client.completions.create(model="", prompt="z" * 60)
    assert r.usage.completion_tokens == 4
    r = client.chat.completions.create(model="", messages=CHAT["messages"])
    assert r.usage.completion_tokens == 64 - r.usage.prompt_tokens
    r = httpx.post(url + "/v1/completions", content=b'{"prompt": "a"}',
                   headers={"content-type": "application/x-www-form-urlencoded"})
    assert_error(r, 400, "content-type", "application/json")


def test_version_and_invocations(fake):
    url = fake[1]
    assert httpx.get(url + "/version").json() == {"version": tinypaged.__version__}
    r = post(url, "/invocations", CHAT)
    assert r.json()["object"] == "chat.completion"
    assert len(r.json()["choices"][0]["message"]["content"]) == 3
    r = post(url, "/invocations", {"prompt": "a", "max_tokens": 2})
    assert r.json()["object"] == "text_completion" and len(r.json()["choices"][0]["text"]) == 2
    assert_error(post(url, "/invocations", {"max_tokens": 2}), 400, "body", "messages")


def test_cors(fake):
    url = fake[1]
    preflight = {"access-control-request-method": "POST",
                 "access-control-request-headers": "content-type, authorization"}
    r = httpx.options(url + "/v1/chat/completions",
                      headers={"origin": "http://app.example", **preflight})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://app.example"
    assert "POST" in r.headers["access-control-allow-methods"]
    r = httpx.options(url + "/v1/chat/completions",
                      headers={"origin": "http://evil.example", **preflight})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = post(url, "/v1/completions", {"prompt": "a", "max_tokens": 1},
             headers={"origin": "http://app.example"})
    assert r.headers["access-control-allow-origin"] == "http://app.example"


def test_return_token_ids(fake):
    url = fake[1]
    body = {"prompt": ["ab", "c"], "max_tokens": 3, "return_token_ids": True}
    r = post(url, "/v1/completions", body).json()
    for choice, prompt in zip(r["choices"], ["ab", "c"]):
        assert choice["prompt_token_ids"] == [ord(ch) for ch in prompt]
        assert "".join(map(chr, choice["token_ids"])) == choice["text"]
    events = sse_events(post(url, "/v1/completions", {**body, "stream": True}).text)[:-1]
    for index, prompt in enumerate(["ab", "c"]):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == index]
        assert mine[0]["prompt_token_ids"] == [ord(ch) for ch in prompt]
        assert all("prompt_token_ids" not in c for c in mine[1:])
        ids = [t for c in mine for t in c["token_ids"]]
        assert "".join(map(chr, ids)) == "".join(c["text"] for c in mine)
    r = post(url, "/v1/chat/completions", {**CHAT, "return_token_ids": True}).json()
    assert "".join(map(chr, r["prompt_token_ids"])) == "[user]hi[assistant]"
    assert "".join(map(chr, r["choices"][0]["token_ids"])) == r["choices"][0]["message"]["content"]


def test_tokens_as_token_ids_in_logprobs(fake):
    body = {"prompt": "a", "max_tokens": 2, "logprobs": 1, "return_tokens_as_token_ids": True}
    r = post(fake[1], "/v1/completions", body).json()
    lp = r["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{ord(ch)}" for ch in r["choices"][0]["text"]]
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"] for k in top)


def test_continuous_usage_and_prompt_tokens_details(fake):
    body = {"prompt": "abc", "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = sse_events(post(fake[1], "/v1/completions", body).text)[:-1]
    tokens = [e["usage"]["completion_tokens"] for e in events]
    assert tokens == [1, 2, 3, 4, 4]  # one per step, then the closing usage chunk
    assert all(e["usage"]["prompt_tokens"] == 3 for e in events)
    assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    r = post(fake[1], "/v1/chat/completions", CHAT).json()
    assert r["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_truncate_prompt_tokens_and_detokenize_flags(fake):
    engine, url = fake
    body = {"prompt": "abcdefgh", "max_tokens": 2, "truncate_prompt_tokens": 3}
    r = post(url, "/v1/completions", body).json()
    assert r["usage"]["prompt_tokens"] == 3
    assert r["choices"][0]["text"][0] == chr(ord("a") + ord("f") % 26)  # the engine saw "fgh"
    r = post(url, "/v1/completions", {**body, "truncate_prompt_tokens": -1}).json()
    assert r["usage"]["prompt_tokens"] == 8
    assert_error(post(url, "/v1/completions", {**body, "truncate_prompt_tokens": 65}), 400,
                 "truncate_prompt_tokens", "max_model_len")
    flags = {"include_stop_str_in_output": True, "spaces_between_special_tokens": False,
             "skip_special_tokens": False}
    assert post(url, "/v1/completions", {**body, **flags}).status_code == 200
    p = engine.seen_params[-1]
    assert (p.include_stop_str_in_output, p.spaces_between_special_tokens,
            p.skip_special_tokens) == (True, False, False)


@pytest.mark.parametrize("field,value", [
    ("functions", [{"name": "f"}]), ("suffix", "x"), ("use_beam_search", True),
    ("priority", 1), ("prompt_embeds", "AAAA"),
])
def test_unsupported_fields_are_named(fake, field, value):
    r = post(fake[1], "/v1/completions", {"prompt": "a", field: value})
    assert_error(r, 400, field, "not supported")
    r = post(fake[1], "/v1/chat/completions", {**CHAT, "modalities": ["text", "audio"]})
    assert_error(r, 400, "modalities", "text only")
    assert post(fake[1], "/v1/completions", {"prompt": "a", "use_beam_search": False}).is_success


def test_completion_echo(fake):
    body = {"prompt": ["ab", [99, 100]], "max_tokens": 3, "echo": True}
    r = post(fake[1], "/v1/completions", body).json()
    assert [c["text"][:2] for c in r["choices"]] == ["ab", "cd"]
    assert all(len(c["text"]) == 5 for c in r["choices"])
    events = sse_events(post(fake[1], "/v1/completions", {**body, "stream": True}).text)[:-1]
    for index, prompt in enumerate(["ab", "cd"]):
        texts = [e["choices"][0]["text"] for e in events if e["choices"][0]["index"] == index]
        assert texts[0].startswith(prompt) and len("".join(texts)) == 5
