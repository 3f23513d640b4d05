"""Where a served step's time goes: `tinypaged serve` in this process, `bench serve` as a client
process at one request rate, every engine step timed from the inside.

    PYTHONPATH=. python benchmarks/serve_profile.py [--model-shape llama3-8b] [--rate 16]
        [--duration 10] [--out DIR]     # a dry run on a CPU: --model DIR --dtype float32

The server is the CLI's (AsyncLLM + build_app under uvicorn, one process, the engine in its own
thread); the engine is wrapped, from outside, to record per `step()` call:

    wall      the call's wall time (with async scheduling: launch step N+1, then process N)
    cpu       the engine thread's own CPU time in it (time.thread_time)
    wait      of that, the wait for step N's sampled ids (the GPU still running)
    gil       wall - cpu - wait: the thread was runnable but did not run, i.e. waited for the
              GIL, held by the event loop thread (HTTP, JSON, SSE) between the engine's bytecodes
    gpu       CUDA-event time of the launched step on the GPU (gaps where the GPU waited for the
              host inside the step included)

split by the launched step's kind: pure decode (a CUDA graph) or mixed (decodes plus prompt
tokens: eager). Also the CPU share of the event loop thread and of the engine thread over the
timed run (both near 1.0 together: the GIL is the bottleneck) and the event loop's lag (how late
a 5 ms timer fires). Prints the client's TTFT / TPOT and the table; writes profile.json to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from tinypaged.async_llm import AsyncLLM
from tinypaged.model_shapes import shape_dir
from tinypaged.server import build_app


class StepProbe:
    """Wraps an engine's step / _launch / executor.collect; records one row per step() call."""

    def __init__(self, engine) -> None:
        self.rows: list[dict] = []
        self.active = False
        self.cuda = engine.device.type == "cuda"
        self._row: dict = {}
        step, launch, collect = engine.step, engine._launch, engine.executor.collect

        def timed_step(*args, **kwargs):
            if not self.active:
                return step(*args, **kwargs)
            self._row = row = {"wait": 0.0, "prefill_tokens": 0, "decodes": 0}
            c0, t0 = time.thread_time(), time.perf_counter()
            outputs = step(*args, **kwargs)
            row["wall"] = time.perf_counter() - t0
            row["cpu"] = time.thread_time() - c0
            row["outputs"] = len(outputs)
            self.rows.append(row)
            return outputs

        def timed_launch(out):
            if not self.active:
                return launch(out)
            n = [it.num_new_tokens for it in out.scheduled]
            self._row["prefill_tokens"] = sum(x for x in n if x > 1)
            self._row["decodes"] = sum(1 for x in n if x == 1)
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
            launched = launch(out)
            if self.cuda:
                end.record()
                self._row["events"] = (start, end)
            return launched

        def timed_collect(tokens):
            t0 = time.perf_counter()
            ids = collect(tokens)
            if self.active and self._row:
                self._row["wait"] += time.perf_counter() - t0
            return ids

        engine.step, engine._launch, engine.executor.collect = timed_step, timed_launch, \
            timed_collect

    def finish(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        for row in self.rows:
            events = row.pop("events", None)
            if events is not None:
                row["gpu"] = events[0].elapsed_time(events[1]) / 1000
            row["gil"] = max(0.0, row["wall"] - row["cpu"] - row["wait"])


def stats_ms(xs: list[float]) -> str:
    if not xs:
        return "-"
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))]
    return f"{1000 * statistics.median(xs):.2f} / {1000 * p99:.2f}"


def step_table(rows: list[dict]) -> list[dict]:
    kinds = {"decode": [r for r in rows if r["decodes"] and not r["prefill_tokens"]],
             "mixed": [r for r in rows if r["prefill_tokens"]]}
    table = []
    for kind, rs in kinds.items():
        if not rs:
            continue
        table.append({
            "kind": kind, "steps": len(rs),
            "decodes": statistics.fmean(r["decodes"] for r in rs),
            "prefill_tokens": statistics.fmean(r["prefill_tokens"] for r in rs),
            **{f"{k}_ms": stats_ms([r[k] for r in rs if k in r])
               for k in ("wall", "gpu", "cpu", "wait", "gil")},
        })
    return table


async def bench(args, port: int, name: str, num: int, rate: str, seed: int) -> dict:
    path = Path(args.out) / f"{name}.json"
    cmd = [sys.executable, "-m", "tinypaged", "bench", "serve", "--port", str(port),
           "--model", args.served_name, "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--ignore-eos", "--seed", str(seed),
           "--num-prompts", str(num), "--request-rate", rate, "--save-result",
           "--result-dir", args.out, "--result-filename", path.name]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.DEVNULL)
    if await proc.wait() != 0:
        raise RuntimeError(f"bench serve failed: {' '.join(cmd)}")
    return json.loads(path.read_text())


def cpu_clock(thread: threading.Thread) -> int:
    return time.pthread_getcpuclockid(thread.ident)


async def serve_and_measure(args, engine: AsyncLLM, probe: StepProbe) -> dict:
    import uvicorn

    app = build_app(engine, [args.served_name])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=args.port,
                                           log_level="warning"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    await bench(args, args.port, "warmup", 32, "inf", 102)
    lags: list[float] = []

    async def lag_probe() -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(0.005)
            lags.append(time.perf_counter() - t0 - 0.005)

    clocks = [cpu_clock(threading.main_thread()), cpu_clock(engine._thread)]
    lagging = asyncio.create_task(lag_probe())
    cpu0, t0 = [time.clock_gettime(c) for c in clocks], time.perf_counter()
    probe.active = True
    result = await bench(args, args.port, f"rate-{args.rate:g}", int(args.rate * args.duration),
                         f"{args.rate:g}", int(args.rate))
    probe.active = False
    wall = time.perf_counter() - t0
    cpu = [time.clock_gettime(c) - c0 for c, c0 in zip(clocks, cpu0)]
    lagging.cancel()
    server.should_exit = True
    await serving
    probe.finish()
    return {"client": {k: result[k] for k in result if not isinstance(result[k], list)},
            "loop_cpu_share": cpu[0] / wall, "engine_cpu_share": cpu[1] / wall,
            "loop_lag_ms": stats_ms(lags), "steps": step_table(probe.rows)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-shape", default="llama3-8b")
    p.add_argument("--model", default=None, help="a model folder instead of --model-shape")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--rate", type=float, default=16.0)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--port", type=int, default=8300)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "serve-profile"))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model = args.model or str(shape_dir(args.model_shape, tokenizer=True))
    args.served_name = args.model_shape
    engine = AsyncLLM(model, load_format="dummy", dtype=args.dtype,
                      max_model_len=args.max_model_len, max_num_seqs=256,
                      max_num_batched_tokens=8192, gpu_memory_utilization=0.85, seed=0,
                      async_scheduling=args.async_scheduling)
    probe = StepProbe(engine.engine)
    try:
        report = asyncio.run(serve_and_measure(args, engine, probe))
    finally:
        asyncio.run(engine.shutdown())
    report["async_scheduling"] = engine.config.async_scheduling
    Path(args.out, "profile.json").write_text(json.dumps(report, indent=2))
    c = report["client"]
    print(f"{args.rate:g} req/s, {args.input_len} in / {args.output_len} out, async scheduling "
          f"{engine.config.async_scheduling}: {c['completed']} done, {c['request_throughput']:.2f} "
          f"req/s; ms median / p99: TTFT {c['median_ttft_ms']:.1f} / {c['p99_ttft_ms']:.1f}, "
          f"TPOT {c['median_tpot_ms']:.2f} / {c['p99_tpot_ms']:.2f}, ITL "
          f"{c['median_itl_ms']:.2f} / {c['p99_itl_ms']:.2f}")
    print(f"CPU share of the wall time: event loop {report['loop_cpu_share']:.2f}, engine thread "
          f"{report['engine_cpu_share']:.2f}; event loop lag (ms median / p99) "
          f"{report['loop_lag_ms']}")
    print(f"{'step':7} {'n':>5} {'decodes':>7} {'prompt':>6}  ms median / p99: {'wall':>13} "
          f"{'gpu':>13} {'cpu':>13} {'wait':>13} {'gil':>13}")
    for r in report["steps"]:
        print(f"{r['kind']:7} {r['steps']:5d} {r['decodes']:7.1f} {r['prefill_tokens']:6.0f}  "
              f"{'':16}{r['wall_ms']:>13} {r['gpu_ms']:>13} {r['cpu_ms']:>13} {r['wait_ms']:>13} "
              f"{r['gil_ms']:>13}")


if __name__ == "__main__":
    main()
