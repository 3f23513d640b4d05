"""The HTTP layer against a fake engine: OpenAI shapes, SSE framing, every error case, disconnects.

`FakeEngine` (helpers/server.py) is a test double of AsyncLLM (same methods, canned outputs,
instant steps), so these tests pin the server's own behaviour in milliseconds. The real engine is
exercised in test_server_e2e.py.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from helpers.server import FakeEngine, post, running_server, sse_events

from tinypaged.entrypoints.openai.api_server import build_app


def expected(prompt: str, num: int, j: int = 0) -> str:
    return "".join(chr(ord("a") + (ord(prompt[0]) + j + k) % 26) for k in range(num))


@pytest.fixture(scope="module")
def fake():
    engine = FakeEngine()
    with running_server(build_app(engine, max_body_bytes=4000)) as url:
        yield engine, url


@pytest.fixture(scope="module")
def client(fake):
    return openai.OpenAI(base_url=fake[1] + "/v1", api_key="unused", max_retries=0)


# ---------------------------------------------------------------------------------- happy paths


def test_models_and_health(fake, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    assert models.data[0].object == "model"
    assert httpx.get(fake[1] + "/health").status_code == 200


def test_completion_shapes(client):
    r = client.completions.create(model="fake-model", prompt="hello", max_tokens=5)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == expected("hello", 5)
    assert r.choices[0].finish_reason == "length" and r.choices[0].index == 0
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 5, 10)


def test_completion_batch_n2_stop_and_params(fake, client):
    r = client.completions.create(
        model="fake-model",
        prompt=["ab", [ord("c")]],
        n=2,
        max_tokens=4,
        temperature=0.7,
        top_p=0.9,
        seed=3,
        extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1},
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [
        expected("ab", 4),
        expected("ab", 4, 1),
        expected("c", 4),
        expected("c", 4, 1),
    ]
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 16
    p = fake[0].seen_params[-1]
    assert (p.n, p.temperature, p.top_p, p.seed, p.top_k, p.min_p) == (2, 0.7, 0.9, 3, 5, 0.1)
    assert p.repetition_penalty == 1.1 and p.max_tokens == 4
    stop_at = expected("x", 6)[3]  # the 4th generated letter
    r = client.completions.create(model="fake-model", prompt="x", max_tokens=6, stop=[stop_at])
    assert r.choices[0].text == expected("x", 3)
    assert r.choices[0].finish_reason == "stop"


def test_default_max_tokens_fills_the_context(fake, client):
    r = client.completions.create(model="fake-model", prompt="z" * 60)
    assert r.usage.completion_tokens == 4  # max_model_len 64 - 60 prompt tokens


def test_completion_logprobs_format(client):
    r = client.completions.create(model="fake-model", prompt="hi", max_tokens=3, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == list(expected("hi", 3))
    assert lp.token_logprobs == [-0.5] * 3
    assert lp.text_offset == [0, 1, 2]
    assert lp.top_logprobs[0] == {expected("hi", 1): -0.5, "A": -2.0, "B": -3.0}


def test_chat_shapes_and_logprobs(fake, client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(
        model="fake-model", messages=msgs, max_completion_tokens=3, logprobs=True, top_logprobs=1
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == expected("[", 3)
    prompt_len = len("[system]be brief[user]hi[assistant]")
    assert r.usage.prompt_tokens == prompt_len and r.usage.completion_tokens == 3
    entry = r.choices[0].logprobs.content[0]
    assert entry.token == msg.content[0] and entry.logprob == -0.5
    assert entry.bytes == list(msg.content[0].encode())
    assert [(t.token, t.logprob) for t in entry.top_logprobs] == [(msg.content[0], -0.5)]
    # list-of-parts content is joined as text
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}
    ]
    r2 = client.chat.completions.create(model="fake-model", messages=parts, max_tokens=2)
    assert r2.usage.prompt_tokens == len("[user]hi[assistant]")


def test_completion_stream_framing_and_usage(fake):
    body = {
        "prompt": "hey",
        "max_tokens": 4,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": 1,
    }
    r = post(fake[1], "/v1/completions", body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}
    chunks = events[:-2]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    assert len({c["id"] for c in events[:-1]}) == 1
    for j in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == j]
        assert "".join(c["text"] for c in mine) == expected("hey", 4, j)
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + ["length"]
        assert sum(len(c["logprobs"]["tokens"]) for c in mine) == 4


def test_chat_stream_role_first(fake, client):
    stream = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "yo"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected("[", 5)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 5 and not chunks[-1].choices


def test_tokenize_detokenize(fake):
    r = post(fake[1], "/tokenize", {"prompt": "abc", "return_token_strs": True})
    assert r.json() == {
        "count": 3,
        "max_model_len": 64,
        "tokens": [97, 98, 99],
        "token_strs": ["a", "b", "c"],
    }
    r = post(fake[1], "/tokenize", {"messages": [{"role": "user", "content": "q"}]})
    assert r.json()["count"] == len("[user]q[assistant]")
    assert post(fake[1], "/detokenize", {"tokens": [104, 105]}).json() == {"prompt": "hi"}
