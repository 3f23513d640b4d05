"""Every error the server answers, with its status and OpenAI error body, plus disconnects,
the queue limit and failure isolation, against FakeEngine (a test double of AsyncLLM)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
from helpers.server import FakeEngine, assert_error, post, running_server, sse_events

from tinypaged.entrypoints.openai.api_server import build_app


@pytest.fixture(scope="module")
def fake():
    engine = FakeEngine()
    with running_server(build_app(engine, max_body_bytes=4000)) as url:
        yield engine, url


def wait_until(cond, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


COMPLETION_400 = [
    ({"prompt": "a", "max_tokens": 0}, "max_tokens", ">= 1"),
    ({"prompt": "a", "max_tokens": "5"}, "max_tokens", "integer"),
    ({"prompt": "a", "max_tokens": 2.5}, "max_tokens", "integer"),
    ({"prompt": "a", "temperature": -0.1}, "temperature", ">= 0"),
    ({"prompt": "a", "temperature": "hot"}, "temperature", "number"),
    ({"prompt": "a", "n": 0}, "n", ">= 1"),
    ({"prompt": "a", "n": True}, "n", "integer"),
    ({"prompt": "a", "top_p": 0}, "top_p", "> 0"),
    ({"prompt": "a", "top_p": 1.5}, "top_p", "<= 1"),
    ({"prompt": "a", "top_k": -2}, "top_k", ">= -1"),
    ({"prompt": "a", "presence_penalty": 3}, "presence_penalty", "<= 2"),
    ({"prompt": "a", "frequency_penalty": -2.5}, "frequency_penalty", ">= -2"),
    ({"prompt": "a", "logprobs": 21}, "logprobs", "<= 20"),
    ({"prompt": "a", "logprobs": -1}, "logprobs", ">= 0, got -1"),
    ({"prompt": "a", "n": 129}, "n", "<= 128"),
    ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty", ">= 0.01"),
    ({"prompt": "a", "stop": ""}, "stop", "non-empty"),
    ({"prompt": "a", "truncate_prompt_tokens": -5}, "truncate_prompt_tokens", "-5"),
    ({"prompt": "a", "stop": 5}, "stop", "string"),
    ({"prompt": "a", "stop_token_ids": [1, -1]}, "stop_token_ids", "token ids"),
    ({"prompt": "a", "seed": "x"}, "seed", "integer"),
    ({"prompt": "a", "stream": "yes"}, "stream", "boolean"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"prompt": "a", "min_tokens": 5, "max_tokens": 2}, "min_tokens", "max_tokens"),
    ({"prompt": "a", "suffix": "b"}, "suffix", "not supported"),
    ({"prompt": "a", "echo": 1}, "echo", "boolean"),
    ({"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs", "<= 20"),
    ({"max_tokens": 3}, "prompt", "required"),
    ({"prompt": 7}, "prompt", "must be"),
    ({"prompt": [[1, 2], "x", 3]}, "prompt", "must be"),
    ({"prompt": []}, "prompt", "must be"),
    ({"prompt": "y" * 64}, "prompt", "max_model_len"),
    ({"prompt": "y" * 60, "max_tokens": 5}, "max_tokens", "at most 4"),
    ({"prompt": "REFUSE"}, "prompt", "refuses"),
    ({"prompt": "a", "model": 3}, "model", "string"),
]


@pytest.mark.parametrize("body,param,word", COMPLETION_400)
def test_completion_400(fake, body, param, word):
    err = assert_error(post(fake[1], "/v1/completions", body), 400, param, word)
    assert err["type"] == "invalid_request_error"


CHAT_400 = [
    ({}, "messages", "required"),
    ({"messages": []}, "messages", "non-empty"),
    ({"messages": ["hi"]}, "messages[0]", "object"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role", "role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages[0].content",
        "only text",
    ),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "messages", "chat template"),
    (
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        "top_logprobs",
        "logprobs",
    ),
    (
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
        "max_completion_tokens",
        ">= 1",
    ),
    (  # SamplingParams' logprobs, named as the body sent it
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": -1},
        "top_logprobs",
        "'top_logprobs' must be >= 0, got -1",
    ),
    (
        {"messages": [{"role": "user", "content": "x" * 30}], "max_tokens": 30},
        "max_tokens",
        "max_model_len",
    ),
    ({"messages": [{"role": "user", "content": "x" * 60}]}, "messages", "max_model_len"),
]


@pytest.mark.parametrize("body,param,word", CHAT_400)
def test_chat_400(fake, body, param, word):
    assert_error(post(fake[1], "/v1/chat/completions", body), 400, param, word)


def test_malformed_json_and_non_object(fake):
    assert_error(post(fake[1], "/v1/completions", b"{not json"), 400, "body", "JSON")
    assert_error(post(fake[1], "/v1/chat/completions", b"[1, 2]"), 400, "body", "object")
    assert_error(post(fake[1], "/v1/completions", b"\xff\xfe"), 400, "body", "JSON")


def test_tokenize_errors(fake):
    assert_error(post(fake[1], "/tokenize", {}), 400, "prompt", "required")
    assert_error(post(fake[1], "/detokenize", {"tokens": "abc"}), 400, "tokens")
    assert_error(post(fake[1], "/detokenize", {"tokens": [2**40]}), 400, "tokens", "decode")


def test_unknown_model_404(fake):
    for path, body in [
        ("/v1/completions", {"prompt": "a"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}),
        ("/tokenize", {"prompt": "a"}),
    ]:
        err = assert_error(post(fake[1], path, {**body, "model": "gpt-9"}), 404, "model", "gpt-9")
        assert err["code"] == "model_not_found"
    r = httpx.get(fake[1] + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(fake[1] + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_oversized_body_refused_before_parsing(fake):
    # Not valid JSON, so a 413 (not a 400) proves the body was refused before parsing.
    assert_error(post(fake[1], "/v1/completions", b"x" * 5000), 413, "body", "4000 bytes")

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(10):
            yield b"y" * 1000

    r = httpx.post(fake[1] + "/v1/completions", content=chunks(), timeout=10)
    assert_error(r, 413, "body")
    # A Content-Length far over the limit is refused without sending the body at all.
    host, port = fake[1].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
            b"\r\ncontent-length: 1000000000\r\n\r\n"
        )
        head = s.recv(65536).decode()
    assert head.startswith("HTTP/1.1 413"), head


def test_api_key():
    engine = FakeEngine()
    with running_server(build_app(engine, api_key="s3cret")) as url:
        body = {"prompt": "a", "max_tokens": 2}
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
            err = assert_error(post(url, "/v1/completions", body, headers=headers), 401, None)
            assert err["code"] == "invalid_api_key"
        assert httpx.get(url + "/v1/models").status_code == 401
        ok = {"authorization": "Bearer s3cret"}
        assert post(url, "/v1/completions", body, headers=ok).status_code == 200
        assert httpx.get(url + "/v1/models", headers=ok).status_code == 200
        assert httpx.get(url + "/health").status_code == 200  # probes need no key
        assert httpx.get(url + "/metrics").status_code == 200


def test_engine_failure_is_500_and_server_keeps_serving(fake):
    err = assert_error(
        post(fake[1], "/v1/completions", {"prompt": "FAIL-EARLY"}),
        500,
        None,
        "injected engine failure",
    )
    assert err["type"] == "server_error"
    # Failing after the stream began: an error event, then [DONE].
    r = post(fake[1], "/v1/completions", {"prompt": "FAIL-LATE", "stream": True})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert "injected engine failure" in events[-2]["error"]["message"]
    text = "".join(e["choices"][0]["text"] for e in events[:-2])
    assert text == "".join(chr(ord("a") + (ord("F") + k) % 26) for k in range(2))  # 2 tokens made
    r = post(fake[1], "/v1/completions", {"prompt": "fine", "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) == 2
    assert not fake[0].live


def test_stream_disconnect_aborts_at_once(fake):
    engine, url = fake
    with (
        httpx.Client(timeout=10) as c,
        c.stream(
            "POST",
            url + "/v1/completions",
            json={"prompt": "SLOW one", "max_tokens": 50, "stream": True},
        ) as r,
    ):
        lines = r.iter_lines()  # (dropping a half-read iterator closes the connection)
        assert next(lines).startswith("data: ")
        (rid,) = engine.live
        time.sleep(0.2)
        assert rid in engine.live  # still generating while the client listens
        closed_at = time.monotonic()
    wait_until(lambda: rid not in engine.live and rid in engine.aborted)
    assert time.monotonic() - closed_at < 0.4  # well before the next 0.5 s step


def test_disconnect_while_waiting_aborts(fake):
    engine, url = fake

    async def go(stream: bool) -> None:
        async with httpx.AsyncClient(timeout=10) as c:
            task = asyncio.create_task(
                c.post(url + "/v1/completions", json={"prompt": "SLOW", "stream": stream})
            )
            await asyncio.sleep(0.1)  # submitted; no output yet (first step takes 0.5 s)
            assert len(engine.live) == 1
            task.cancel()

    for stream in (False, True):
        before = len(engine.aborted)
        asyncio.run(go(stream))
        wait_until(lambda n=before: not engine.live and len(engine.aborted) == n + 1, timeout=0.4)


def test_queue_full_503_with_retry_after():
    engine = FakeEngine(max_num_seqs=2)
    with running_server(build_app(engine, max_queue=1)) as url:

        async def go() -> None:
            async with httpx.AsyncClient(timeout=10) as c:
                hold = [
                    asyncio.create_task(
                        c.post(url + "/v1/completions", json={"prompt": "SLOW", "max_tokens": 50})
                    )
                    for _ in range(3)
                ]  # 2 running + 1 queued fill the server
                await asyncio.sleep(0.2)
                r = await c.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 1})
                assert_error(r, 503, None, "--max-queue 1")
                assert r.headers["retry-after"] == "1"
                two = await c.post(url + "/v1/completions", json={"prompt": ["a", "b"]})
                assert two.status_code == 503
                for t in hold:
                    t.cancel()
                await asyncio.sleep(0.2)
                r = await c.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 1})
                assert r.status_code == 200  # the slots came back

        asyncio.run(go())
        assert not engine.live


def test_shutdown_aborts_requests_still_running_after_the_grace_period():
    engine = FakeEngine()
    results: list = []

    def client(url: str) -> None:
        try:
            body = {"prompt": "SLOW", "max_tokens": 50, "stream": True}
            results.append(httpx.post(url + "/v1/completions", json=body, timeout=30).text)
        except httpx.HTTPError as exc:
            results.append(exc)

    started = time.monotonic()
    with running_server(build_app(engine), graceful_s=0.5) as url:
        thread = threading.Thread(target=client, args=(url,))
        thread.start()
        wait_until(lambda: len(engine.live) == 1)
    # Leaving the block stops the server: 0.5 s of grace, then the stream is cut and aborted.
    thread.join(timeout=10)
    assert time.monotonic() - started < 5
    assert not engine.live and len(engine.aborted) == 1
    assert results  # the client saw the end of its (cut) response or the connection drop


def test_a_stopped_engine_answers_503():
    engine = FakeEngine()
    engine.stopped = True  # is_running is False, as AsyncLLM's once a tensor-parallel worker died
    with running_server(build_app(engine)) as url:
        r = post(url, "/v1/completions", {"prompt": "a", "max_tokens": 2})
        err = assert_error(r, 503, None, "engine has stopped")
        assert err["code"] == "engine_dead"
        r = post(url, "/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "a"}], "stream": True})
        assert_error(r, 503, None)
