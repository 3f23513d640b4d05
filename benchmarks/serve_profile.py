"""Where a served step's time goes: the server of `tinypaged serve` in this process (its engine in
a thread, or with --engine-process in its own process, as `serve` runs on a GPU), `bench serve`
as a client process at one request rate, every engine step timed from the inside.

    PYTHONPATH=. python benchmarks/serve_profile.py [--engine-process] [--model-shape llama3-8b]
        [--rates 16 64] [--duration 10] [--out DIR]   # on a CPU: --model DIR --dtype float32

The engine is wrapped from outside (in the engine process too) to record per `step()` call:

    wall      the call's wall time (with async scheduling: launch step N+1, then process N)
    launch    of that, the host time of launching step N+1 (batch building, kernel launches)
    cpu       the engine thread's own CPU time in the call (time.thread_time)
    wait      of the wall, the wait for step N's sampled ids (the GPU still running)
    gil       wall - cpu - wait: runnable but not running, i.e. waiting for the GIL, which the
              server's event loop holds (HTTP, JSON, SSE) between the engine's bytecodes
    gpu       CUDA-event time of step N+1 on the GPU (gaps where the GPU waited for the host
              inside the step included: a gpu close to launch means a launch-bound step)

split by the launched step's kind: pure decode (a CUDA graph) or mixed (decodes plus prompt
tokens: eager). Also the CPU share of the event loop thread and of the engine's thread over the
timed run (near 1.0 together in one process: the GIL is the bottleneck) and the event loop's lag
(how late a 5 ms timer fires). Prints the client's TTFT / TPOT and the table; profile.json in --out.
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

from tinypaged.bench.model_shapes import shape_dir
from tinypaged.engine import core as engine_core
from tinypaged.engine.async_llm import AsyncLLM
from tinypaged.entrypoints.openai.api_server import build_app

ROWS_ENV = "SERVE_PROFILE_ROWS"  # where the engine process writes its rows at shutdown


class StepProbe:
    """Wraps an engine's step / _launch / executor.collect; records one row per step() call."""

    def __init__(self, engine) -> None:
        self.rows: list[dict] = []
        self.cuda = engine.device.type == "cuda"
        self.clock = time.pthread_getcpuclockid(threading.get_ident())  # the engine's thread
        self._row: dict = {}
        step, launch, collect = engine.step, engine._launch, engine.executor.collect

        def timed_step(*args, **kwargs):
            self._row = row = {"t": time.monotonic(), "wait": 0.0, "launch": 0.0,
                               "prefill_tokens": 0, "decodes": 0}
            c0, t0 = time.thread_time(), time.perf_counter()
            outputs = step(*args, **kwargs)
            row["wall"] = time.perf_counter() - t0
            row["cpu"] = time.thread_time() - c0
            self.rows.append(row)
            return outputs

        def timed_launch(out):
            n = [it.num_new_tokens for it in out.scheduled]
            self._row["prefill_tokens"] = sum(x for x in n if x > 1)
            self._row["decodes"] = sum(1 for x in n if x == 1)
            t0 = time.perf_counter()
            if self.cuda:
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
            launched = launch(out)
            if self.cuda:
                end.record()
                self._row["events"] = (start, end)
            self._row["launch"] = time.perf_counter() - t0
            return launched

        def timed_collect(tokens):
            t0 = time.perf_counter()
            ids = collect(tokens)
            if self._row:
                self._row["wait"] += time.perf_counter() - t0
            return ids

        engine.step, engine._launch, engine.executor.collect = timed_step, timed_launch, \
            timed_collect

    def finish(self) -> list[dict]:
        if self.cuda:
            torch.cuda.synchronize()
        for row in self.rows:
            events = row.pop("events", None)
            if events is not None:
                row["gpu"] = events[0].elapsed_time(events[1]) / 1000
            row["gil"] = max(0.0, row["wall"] - row["cpu"] - row["wait"])
        return self.rows


def profiled_engine_core(config, inbox, outbox) -> None:
    """engine_core.run_engine_core with a StepProbe on its engine; rows to $SERVE_PROFILE_ROWS."""
    import tinypaged.engine.engine

    class ProfiledEngine(tinypaged.engine.engine.Engine):
        def __init__(self, config) -> None:
            super().__init__(config)
            self.probe = StepProbe(self)

        def shutdown(self) -> None:
            rows = self.probe.finish()
            cpu = time.clock_gettime(self.probe.clock)
            Path(os.environ[ROWS_ENV]).write_text(json.dumps({"rows": rows, "cpu_end": cpu}))
            super().shutdown()

    tinypaged.engine.engine.Engine = ProfiledEngine
    engine_core.run_engine_core(config, inbox, outbox)


def stats_ms(xs: list[float]) -> str:
    if not xs:
        return "-"
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))]
    return f"{1000 * statistics.median(xs):.2f} / {1000 * p99:.2f}"


def step_table(rows: list[dict]) -> list[dict]:
    kinds = {"decode": [r for r in rows if r["decodes"] and not r["prefill_tokens"]],
             "mixed": [r for r in rows if r["prefill_tokens"]]}
    return [{
        "kind": kind, "steps": len(rs),
        "decodes": statistics.fmean(r["decodes"] for r in rs),
        "prefill_tokens": statistics.fmean(r["prefill_tokens"] for r in rs),
        **{f"{k}_ms": stats_ms([r[k] for r in rs if k in r])
           for k in ("wall", "launch", "gpu", "cpu", "wait", "gil")},
    } for kind, rs in kinds.items() if rs]


async def bench(args, name: str, num: int, rate: str, seed: int) -> dict:
    path = Path(args.out) / f"{name}.json"
    cmd = [sys.executable, "-m", "tinypaged", "bench", "serve", "--port", str(args.port),
           "--model", args.served_name, "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--ignore-eos", "--seed", str(seed),
           "--num-prompts", str(num), "--request-rate", rate, "--save-result",
           "--result-dir", args.out, "--result-filename", path.name]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.DEVNULL)
    if await proc.wait() != 0:
        raise RuntimeError(f"bench serve failed: {' '.join(cmd)}")
    return json.loads(path.read_text())


async def serve_and_measure(args, engine) -> list[dict]:
    """Warm up, then time one run per rate: the client's result, the window and CPU shares."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(build_app(engine, [args.served_name]),
                                           host="127.0.0.1", port=args.port, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    await bench(args, "warmup", 32, "inf", 102)
    lags: list[float] = []

    async def lag_probe() -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(0.005)
            lags.append(time.perf_counter() - t0 - 0.005)

    threads = {"event_loop": threading.main_thread(), "engine_or_reader": engine._thread}
    clocks = {k: time.pthread_getcpuclockid(t.ident) for k, t in threads.items()}
    lagging = asyncio.create_task(lag_probe())
    reports = []
    for rate in args.rates:
        lags.clear()
        cpu0 = {k: time.clock_gettime(c) for k, c in clocks.items()}
        t0, w0 = time.perf_counter(), time.monotonic()
        result = await bench(args, f"rate-{rate:g}", int(rate * args.duration), f"{rate:g}",
                             int(rate))
        wall, window = time.perf_counter() - t0, (w0, time.monotonic())
        shares = {f"{k}_cpu_share": (time.clock_gettime(c) - cpu0[k]) / wall
                  for k, c in clocks.items()}
        client = {k: v for k, v in result.items() if not isinstance(v, list)}
        reports.append({"rate": rate, "client": client, **shares,
                        "loop_lag_ms": stats_ms(lags), "window": window})
    lagging.cancel()
    server.should_exit = True
    await serving
    return reports


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--engine-process", action="store_true",
                   help="the engine in its own process (AsyncMPClient), as serve on a GPU")
    p.add_argument("--model-shape", default="llama3-8b")
    p.add_argument("--model", default=None, help="a model folder instead of --model-shape")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--rates", type=float, nargs="+", default=[16.0])
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--port", type=int, default=8300)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "serve-profile"))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model = args.model or str(shape_dir(args.model_shape, tokenizer=True))
    args.served_name = args.model_shape
    kwargs = dict(load_format="dummy", dtype=args.dtype, max_model_len=args.max_model_len,
                  max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_utilization=0.85,
                  seed=0)
    rows_path = Path(args.out) / "engine-rows.json"
    if args.engine_process:
        os.environ[ROWS_ENV] = str(rows_path)  # read by the spawned engine process
        engine_core.run_engine_core = profiled_engine_core  # the target AsyncMPClient spawns
        engine = engine_core.AsyncMPClient(model, **kwargs)
    else:
        engine = AsyncLLM(model, **kwargs)
        probe = StepProbe(engine.engine)
    try:
        reports = asyncio.run(serve_and_measure(args, engine))
    finally:
        asyncio.run(engine.shutdown())
    rows = json.loads(rows_path.read_text())["rows"] if args.engine_process else probe.finish()
    where = "its own process" if args.engine_process else "a thread of the server"
    cols = ("wall", "launch", "gpu", "cpu", "wait", "gil")
    for report in reports:
        t0, t1 = report.pop("window")
        report["steps"] = step_table([r for r in rows if t0 <= r["t"] <= t1])
        c = report["client"]
        print(f"== {report['rate']:g} req/s, {args.input_len} in / {args.output_len} out, engine "
              f"in {where}: {c['completed']} done, {c['request_throughput']:.2f} req/s; ms "
              f"median / p99: TTFT {c['median_ttft_ms']:.1f} / {c['p99_ttft_ms']:.1f}, TPOT "
              f"{c['median_tpot_ms']:.2f} / {c['p99_tpot_ms']:.2f}, ITL {c['median_itl_ms']:.2f}"
              f" / {c['p99_itl_ms']:.2f}")
        print(f"CPU share of the wall: event loop {report['event_loop_cpu_share']:.2f}, "
              f"{'reader' if args.engine_process else 'engine'} thread "
              f"{report['engine_or_reader_cpu_share']:.2f}; event loop lag (ms median / p99) "
              f"{report['loop_lag_ms']}")
        print(f"{'step':7} {'n':>5} {'decodes':>7} {'prompt':>6}  (ms median / p99) "
              + " ".join(f"{c:>13}" for c in cols))
        for r in report["steps"]:
            print(f"{r['kind']:7} {r['steps']:5d} {r['decodes']:7.1f} {r['prefill_tokens']:6.0f}"
                  f"  {'':17}" + " ".join(f"{r[f'{c}_ms']:>13}" for c in cols))
    summary = {"engine_process": args.engine_process, "runs": reports}
    Path(args.out, "profile.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
