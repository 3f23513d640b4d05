"""`tinypaged bench serve`: load on any OpenAI-compatible server, after `vllm bench serve`.

It sends --num-prompts streaming requests to /v1/completions, arriving as a Poisson process of
--request-rate per second ("inf": all at once), at most --max-concurrency of them in flight, and
times each request from the moment it is sent:

    TTFT   time to first token: until the first chunk that carries a choice
    ITL    inter-token latency: the gap between successive such chunks (a chunk may carry
           several tokens when the server falls behind; as vLLM, one gap per chunk)
    TPOT   time per output token after the first: (E2EL - TTFT) / (output tokens - 1)
    E2EL   end-to-end latency: until the stream ends

and reports mean, median and p99 of each, plus request and token throughput over the run
(first request sent to last answer in). Output tokens are the `usage.completion_tokens` of the
stream's last chunk (`stream_options.include_usage`), so the client needs no tokenizer.

Prompts are random token ids sent as the `prompt` array: lengths --random-input-len (spread by
--random-range-ratio), ids uniform in [1000, 30000), inside the vocabulary of every common model,
so two servers of the same model see the same tokens. `max_tokens` is --random-output-len and,
with --ignore-eos, `ignore_eos` (vLLM's extension) makes every request generate all of them.

The HTTP client is the standard library's asyncio streams (HTTP/1.1, one connection per
request, chunked or sized bodies, http or https): nothing to install on a GPU machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from tinypaged.bench.http_client import http_request, sse_data

PROMPT_IDS = (1000, 30000)  # token ids of the random prompts: [lo, hi)


@dataclass
class RequestResult:
    prompt_len: int
    success: bool = False
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # seconds, send to end of stream
    itl: list[float] = field(default_factory=list)  # seconds between successive chunks
    output_tokens: int = 0
    error: str = ""


def random_prompts(num: int, input_len: int, range_ratio: float, seed: int) -> list[list[int]]:
    """`num` prompts of random token ids, lengths uniform in input_len * [1 - r, 1 + r]."""
    rng = random.Random(seed)
    lo, hi = max(1, int(input_len * (1 - range_ratio))), int(input_len * (1 + range_ratio))
    return [
        [rng.randrange(*PROMPT_IDS) for _ in range(rng.randint(lo, max(lo, hi)))]
        for _ in range(num)
    ]


async def arrivals(num: int, rate: float, seed: int) -> AsyncIterator[int]:
    """Yield 0..num-1 at Poisson arrival times of `rate` per second (inf: at once)."""
    rng = random.Random(seed)
    for i in range(num):
        yield i
        if math.isfinite(rate) and i + 1 < num:
            await asyncio.sleep(rng.expovariate(rate))


async def one_request(url: str, headers: dict, body: dict) -> RequestResult:
    """Send one streaming completion; time its chunks."""
    result = RequestResult(prompt_len=len(body["prompt"]))
    start = last = time.perf_counter()
    try:
        async with http_request(url, "POST", headers, json.dumps(body).encode()) as resp:
            if resp.status != 200:
                text = (await resp.read())[:300].decode(errors="replace")
                result.error = f"HTTP {resp.status}: {text}"
                return result
            async for data in sse_data(resp.chunks()):
                now = time.perf_counter()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])[:300]
                    return result
                if chunk.get("choices"):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
            result.latency = time.perf_counter() - start
        result.success = result.ttft > 0.0
        if not result.success:
            result.error = "the stream ended without any choice"
    except (OSError, ValueError, KeyError, asyncio.IncompleteReadError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation between order statistics (numpy's)."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(results: list[RequestResult], duration: float, percentiles: list[float]) -> dict:
    """vLLM's result fields: counts, throughputs, and mean/median/std/pNN of each latency (ms)."""
    done = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    series = {
        "ttft": [r.ttft for r in done],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }
    summary = {
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
    }
    for name, xs in series.items():
        ms = [1000 * x for x in xs]
        summary[f"mean_{name}_ms"] = statistics.fmean(ms) if ms else float("nan")
        summary[f"median_{name}_ms"] = statistics.median(ms) if ms else float("nan")
        summary[f"std_{name}_ms"] = statistics.pstdev(ms) if ms else float("nan")
        for p in percentiles:
            summary[f"p{p:g}_{name}_ms"] = percentile(ms, p)
    return summary


def print_summary(s: dict, percentiles: list[float]) -> None:
    rows = [
        ("successful requests", f"{s['completed']}"),
        ("failed requests", f"{s['failed']}"),
        ("duration (s)", f"{s['duration']:.2f}"),
        ("input tokens", f"{s['total_input_tokens']}"),
        ("output tokens", f"{s['total_output_tokens']}"),
        ("request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("output token throughput (tok/s)", f"{s['output_throughput']:.1f}"),
        ("total token throughput (tok/s)", f"{s['total_token_throughput']:.1f}"),
    ]
    for name in ("ttft", "tpot", "itl", "e2el"):
        stats = ["mean", "median", *(f"p{p:g}" for p in percentiles)]
        rows.append((f"{name.upper()} (ms) " + " / ".join(stats),
                     " / ".join(f"{s[f'{k}_{name}_ms']:.2f}" for k in stats)))
    width = max(len(k) for k, _ in rows) + 2
    for key, value in rows:
        print(f"{key:<{width}}{value}")


async def _models(base_url: str, headers: dict) -> str:
    async with http_request(base_url + "/v1/models", "GET", headers) as resp:
        body = await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"GET {base_url}/v1/models: HTTP {resp.status}: {body[:200]!r}")
    return json.loads(body)["data"][0]["id"]


async def run(args: argparse.Namespace) -> dict:
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    base = args.base_url or f"http://{args.host}:{args.port}"
    model = args.model or await _models(base.rstrip("/"), headers)
    prompts = random_prompts(args.num_prompts, args.random_input_len, args.random_range_ratio,
                             args.seed)
    url = base.rstrip("/") + args.endpoint
    limit = asyncio.Semaphore(args.max_concurrency or len(prompts) or 1)

    async def limited(prompt: list[int]) -> RequestResult:
        body = {"model": model, "prompt": prompt, "max_tokens": args.random_output_len,
                "stream": True, "stream_options": {"include_usage": True},
                "temperature": 0.0, "ignore_eos": args.ignore_eos}
        async with limit:
            return await one_request(url, headers, body)

    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    print(f"{len(prompts)} requests to {url} ({model}), {rate} req/s, "
          f"max concurrency {args.max_concurrency or 'none'}")
    start = time.perf_counter()
    tasks = [asyncio.create_task(limited(prompts[i]))
             async for i in arrivals(len(prompts), args.request_rate, args.seed)]
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    summary = summarize(results, duration, percentiles)
    print_summary(summary, percentiles)
    if any(r.success and not r.output_tokens for r in results):
        print("note: some streams ended without usage.completion_tokens (stream_options."
              "include_usage): their tokens are not counted, and TPOT leaves them out")
    errors = [r.error for r in results if not r.success]
    if errors:
        print(f"first error of {len(errors)}: {errors[0]}")
    return {
        "model_id": model, "base_url": base, "endpoint": args.endpoint,
        "num_prompts": args.num_prompts, "request_rate": rate,
        "max_concurrency": args.max_concurrency, **summary,
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
        "errors": [r.error for r in results],
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    """vLLM's flag names and defaults, where vLLM has the flag."""
    p.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000 "
                   "(default: http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/completions")
    # vLLM's command lines run unchanged: its completions backends and its random dataset are
    # the only ones here.
    p.add_argument("--backend", default="vllm", choices=["vllm", "openai"],
                   help="both: the OpenAI completions API")
    p.add_argument("--dataset-name", default="random", choices=["random"])
    p.add_argument("--model", default=None, help="default: the first of the server's /v1/models")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="mean arrivals per second, Poisson (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight (default: no limit)")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in LEN * [1 - r, 1 + r]")
    p.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos: every request generates --random-output-len tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    p.add_argument("--save-result", action="store_true", help="write the result as JSON")
    p.add_argument("--result-dir", default=".")
    p.add_argument("--result-filename", default=None,
                   help="default: tinypaged-bench-serve-<rate>qps-<time>.json")


def main(args: argparse.Namespace) -> dict:
    if args.endpoint.rstrip("/").endswith("chat/completions") or not args.endpoint.startswith("/"):
        raise SystemExit(f"--endpoint must be a completions path like /v1/completions (the "
                         f"prompts are token ids), got {args.endpoint!r}")
    if not 0 <= args.random_range_ratio < 1:
        raise SystemExit(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if args.request_rate <= 0:
        raise SystemExit(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise SystemExit(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    result = asyncio.run(run(args))
    if args.save_result:
        name = args.result_filename or (
            f"tinypaged-bench-serve-{result['request_rate']}qps-"
            f"{time.strftime('%Y%m%d-%H%M%S')}.json")
        path = Path(args.result_dir) / name
        path.write_text(json.dumps(result, indent=2))
        print(f"result written to {path}")
    return result

