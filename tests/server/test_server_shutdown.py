"""Shutdown under load (FakeEngine, a test double of AsyncLLM): SIGTERM stops admissions with
503 + Retry-After, lets requests in flight run for --shutdown-timeout, then ends every open stream
with an OpenAI error event and [DONE] and every request still waiting with a JSON 503."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import uvicorn
from helpers.server import FakeEngine, assert_error, post, running_server, sse_events

from tinypaged.entrypoints.openai.api_server import GracefulServer, build_app


def test_draining_refuses_new_requests_with_retry_after():
    engine = FakeEngine()
    app = build_app(engine)
    with running_server(app) as url:
        app.state.server.begin_shutdown(30.0)
        time.sleep(0.05)
        r = post(url, "/v1/completions", {"prompt": "a", "max_tokens": 2})
        err = assert_error(r, 503, None, "shutting down")
        assert err["code"] == "server_shutting_down" and r.headers["retry-after"] == "1"
        assert httpx.get(url + "/health").status_code == 503


def test_sigterm_ends_streams_and_waiting_requests_within_the_timeout():
    engine = FakeEngine()
    app = build_app(engine)
    userver = GracefulServer(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"), app.state.server, 0.2
    )
    thread = threading.Thread(target=userver.run, daemon=True)
    thread.start()
    while not userver.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{userver.servers[0].sockets[0].getsockname()[1]}"
    results: dict[str, httpx.Response] = {}

    def call(name: str, body: dict) -> None:
        results[name] = httpx.post(url + "/v1/completions", json=body, timeout=30)

    slow = {"prompt": "SLOW", "max_tokens": 50}
    clients = [
        threading.Thread(target=call, args=(f"stream{i}", {**slow, "stream": True}))
        for i in range(3)
    ]
    clients.append(threading.Thread(target=call, args=("quick", {"prompt": "a", "max_tokens": 3})))
    for c in clients:
        c.start()
    time.sleep(0.8)  # the streams have their first tokens; "quick" is done
    clients.append(threading.Thread(target=call, args=("waiting", slow)))  # no output yet
    clients[-1].start()
    while len(engine.live) < 4:  # its first output comes 0.5 s after this, after the drain
        time.sleep(0.005)
    t0 = time.monotonic()
    userver.handle_exit(signal.SIGTERM, None)  # what the signal handler calls
    thread.join(timeout=10)
    for c in clients:
        c.join(timeout=10)
    assert not thread.is_alive() and time.monotonic() - t0 < 0.2 + 1.0
    assert results["quick"].status_code == 200  # finished before the signal
    assert_error(results["waiting"], 503, None, "shut down")
    for i in range(3):
        events = sse_events(results[f"stream{i}"].text)
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "server_shutting_down"
        assert all("choices" in e for e in events[:-2]) and len(events) >= 3
    assert not engine.live
