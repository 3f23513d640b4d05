"""The server under fire, measured (issue #14): /health latency under load, what 200 clients
timing out at once cost the next request, and how SIGTERM ends open streams.

    PYTHONPATH=. python benchmarks/serve_under_fire.py [--model M] [--clients 200] [--seconds 30]
        [any `tinypaged serve` flag]

Starts `python -m tinypaged serve M` (the default model when none is given; needs starlette,
uvicorn and httpx), checks that a greedy request answers, then:
1. `--clients` streaming clients for `--seconds`, a third hanging up at random, while a probe
   times /health and /metrics every 50 ms (target: every probe under 100 ms);
2. 200 clients whose requests time out together, then the latency of one 1-token request,
   against the step time (the median gap between tokens of a lone stream);
3. SIGTERM with 50 long streams open: seconds to exit, and whether every stream ended with an
   error event and [DONE] (target: within --shutdown-timeout + 1 s).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def completion(max_tokens: int, stream: bool = True) -> dict:
    return {"prompt": "Tell me a long story about", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": stream}


async def stream_gaps(client: httpx.AsyncClient, url: str) -> list[float]:
    gaps, last = [], None
    async with client.stream("POST", url + "/v1/completions", json=completion(64)) as r:
        async for line in r.aiter_lines():
            now = time.perf_counter()
            if line.startswith("data: {") and last is not None:
                gaps.append(now - last)
            last = now
    return gaps


async def load(client: httpx.AsyncClient, url: str, seconds: float, rng: random.Random) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            async with client.stream("POST", url + "/v1/completions",
                                     json=completion(rng.randint(8, 128))) as r:
                cut = rng.randint(1, 40) if rng.random() < 1 / 3 else None  # hang up there
                lines = 0
                async for _ in r.aiter_lines():
                    lines += 1
                    if cut is not None and lines >= cut:
                        break
        except httpx.HTTPError:
            pass


async def measure(url: str, args) -> dict:
    limits = httpx.Limits(max_connections=args.clients + 300, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        r = await client.post(url + "/v1/completions", json=completion(8, stream=False))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
        step_s = statistics.median(await stream_gaps(client, url))

        tasks = [asyncio.create_task(load(client, url, args.seconds, random.Random(i)))
                 for i in range(args.clients)]
        probes: list[float] = []
        end = time.monotonic() + args.seconds
        async with httpx.AsyncClient(timeout=60) as probe:  # its own connections
            while time.monotonic() < end:
                t0 = time.perf_counter()
                await probe.get(url + "/health")
                await probe.get(url + "/metrics")
                probes.append(time.perf_counter() - t0)
                await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)

        doomed = [asyncio.create_task(client.post(url + "/v1/completions",
                                                  json=completion(200, stream=False)))
                  for _ in range(200)]
        await asyncio.sleep(1.0)
        for t in doomed:
            t.cancel()  # 200 clients time out together
        await asyncio.gather(*doomed, return_exceptions=True)
        t0 = time.perf_counter()
        r = await client.post(url + "/v1/completions", json=completion(1, stream=False))
        next_s = time.perf_counter() - t0
        assert r.status_code == 200
    probes.sort()
    return {
        "step_ms": round(step_s * 1e3, 2),
        "health_metrics_ms_p50": round(probes[len(probes) // 2] * 1e3, 2),
        "health_metrics_ms_max": round(probes[-1] * 1e3, 2),
        "health_metrics_over_100ms": sum(p > 0.1 for p in probes),
        "probes": len(probes),
        "next_request_after_200_timeouts_ms": round(next_s * 1e3, 2),
        "next_request_in_steps": round(next_s / step_s, 1),
    }


async def sigterm(url: str, proc: subprocess.Popen, shutdown_timeout: float) -> dict:
    async with httpx.AsyncClient(timeout=120) as client:
        async def one() -> str:
            r = await client.post(url + "/v1/completions", json=completion(1000))
            return r.text

        tasks = [asyncio.create_task(one()) for _ in range(50)]
        await asyncio.sleep(2.0)
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        bodies = await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.get_running_loop().run_in_executor(None, proc.wait, 60)
        exit_s = time.perf_counter() - t0
    # A stream that had begun ends with an error event and [DONE]; one still waiting for its
    # first token gets a JSON 503.
    ended = ("data: [DONE]\n\n", '"code":"server_shutting_down"}}')
    clean = sum(isinstance(b, str) and b.endswith(ended) for b in bodies)
    return {"sigterm_exit_s": round(exit_s, 2), "shutdown_timeout_s": shutdown_timeout,
            "streams_ended_cleanly": f"{clean}/50", "exit_code": proc.returncode}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the built-in default model")
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--shutdown-timeout", type=float, default=3.0)
    p.add_argument("--log-level", default="warning")
    args, serve_flags = p.parse_known_args()
    port = free_port()
    cmd = [sys.executable, "-m", "tinypaged", "serve", *([args.model] if args.model else []),
           "--port", str(port), "--shutdown-timeout", str(args.shutdown_timeout),
           "--log-level", args.log_level, *serve_flags]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        result = asyncio.run(measure(url, args))
        result.update(asyncio.run(sigterm(url, proc, args.shutdown_timeout)))
    finally:
        if proc.poll() is None:
            proc.kill()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
