"""`bench serve`'s parts that a live tinypaged server does not show: SSE split anywhere, CRLF
framing, sized bodies, error answers, the statistics and the arrival process."""

from __future__ import annotations

import asyncio
import json
import random

import numpy as np
import pytest

from tinypaged.bench.http_client import http_request, sse_data
from tinypaged.bench.serve import arrivals, one_request, percentile, random_prompts


async def _gather(chunks):
    async def source():
        for c in chunks:
            yield c

    return [d async for d in sse_data(source())]


def test_sse_payloads_whatever_the_chunking():
    body = b'data: {"a": 1}\r\n\r\n: a comment\n\ndata: {"b": 2}\n\ndata: [DONE]\n\n'
    want = ['{"a": 1}', '{"b": 2}', "[DONE]"]
    assert asyncio.run(_gather([body])) == want
    for cut in range(1, len(body)):  # a chunk boundary anywhere, even inside \r\n
        assert asyncio.run(_gather([body[:cut], body[cut:]])) == want


def test_percentile_is_numpys():
    rng = random.Random(0)
    xs = [rng.random() for _ in range(37)]
    for q in (0, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_prompts_and_poisson_arrivals():
    prompts = random_prompts(50, 100, 0.5, seed=3)
    assert all(50 <= len(p) <= 150 for p in prompts) and len({len(p) for p in prompts}) > 10
    assert prompts == random_prompts(50, 100, 0.5, seed=3)

    async def times():
        loop = asyncio.get_running_loop()
        return [loop.time() async for _ in arrivals(40, 200.0, seed=0)]

    t = asyncio.run(times())
    mean_gap = (t[-1] - t[0]) / 39
    assert 1 / 200 * 0.5 < mean_gap < 1 / 200 * 3  # exponential gaps of mean 5 ms (+ sleep slack)


class _Server:
    """A one-shot HTTP server on 127.0.0.1 that answers every request with `reply` bytes."""

    def __init__(self, reply: bytes):
        self.reply = reply
        self.requests: list[bytes] = []

    async def handle(self, reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        self.requests.append(head + await reader.readexactly(length))
        writer.write(self.reply)
        await writer.drain()
        writer.close()

    async def run(self, work):
        server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return await work(f"http://127.0.0.1:{port}")


BODY = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2, "stream": True}


def test_a_sized_crlf_stream_is_timed():
    events = (b'data: {"choices": [{"text": "a"}]}\r\n\r\n'
              b'data: {"choices": [{"text": "b"}]}\r\n\r\n'
              b'data: {"choices": [], "usage": {"completion_tokens": 2}}\r\n\r\n'
              b"data: [DONE]\r\n\r\n")
    reply = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
             b"Content-Length: %d\r\n\r\n" % len(events)) + events
    server = _Server(reply)
    result = asyncio.run(server.run(lambda url: one_request(url + "/v1/completions", {}, BODY)))
    assert result.success and result.output_tokens == 2 and len(result.itl) == 1
    assert 0 < result.ttft <= result.latency
    head, _, sent = server.requests[0].partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/completions HTTP/1.1") and json.loads(sent) == BODY


def test_an_error_answer_is_a_failed_request():
    error = b'{"error": {"message": "bad prompt", "type": "invalid_request_error"}}'
    reply = b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n" % len(error) + error
    result = asyncio.run(_Server(reply).run(
        lambda url: one_request(url + "/v1/completions", {}, BODY)))
    assert not result.success and "HTTP 400" in result.error and "bad prompt" in result.error


def test_a_body_until_close_and_a_refused_connection():
    reply = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n" + b'{"data": []}'

    async def read(url):
        async with http_request(url + "/v1/models", "GET", {}) as resp:
            return resp.status, await resp.read()

    assert asyncio.run(_Server(reply).run(read)) == (200, b'{"data": []}')
    result = asyncio.run(one_request("http://127.0.0.1:1/v1/completions", {}, BODY))
    assert not result.success and "Error" in result.error
