"""What a speculative step costs beside a plain decode step, at 0% acceptance (`oracle_miss`).

    PYTHONPATH=. python benchmarks/spec_profile.py gpu [--batches 1 8] [--k 4]     # an H200
    PYTHONPATH=. python benchmarks/spec_profile.py host [--batches 1 8] [--k 4]    # the CPU

Both run the same requests twice: without speculation, then with `oracle_miss` (every draft
rejected, so each step emits one token per sequence, as a plain decode step does: any
difference in step time is the machinery's cost). The oracle's table is the first run's greedy
output. `gpu --method oracle` accepts every draft instead (k + 1 tokens a sequence a step): the
step's cost when it takes all of them (its extra over oracle_miss is what accepted tokens cost).

gpu   Llama-3-8B shape (random weights; or --model DIR, a checkpoint's own weights), prompts of
      --prompt-len random tokens, async scheduling and CUDA graphs as served
      (TINYPAGED_SPEC_DECODE_ATTENTION=decodes or =varlen in front: the verification graphs'
      attention as one-token decodes or through the varlen kernel, as before the multi-query
      decode). Per decode step: wall ms (timed, no profiler); from torch.profiler over --profiled
      steps, GPU ms per kernel kind (GEMMs, attention, the sampler / rejection sampler, the rest)
      and GPU busy (the union of the kernels' intervals); idle = timed wall - busy (the GPU waiting
      for the host); the mean of each step's largest idle gap (profiled: the profiler slows the
      host, so somewhat longer); CUDA-graph replays per step (1: every step replayed one; a
      verification step replays the graphs captured for k + 1 tokens a sequence). Kernels are put in
      a kind by the range they were launched in ("sampling": the sampler or the rejection sampler)
      or else by name. Host columns (timed steps, wall ms): the engine thread blocked on a step's
      tokens, and (speculation) from their arrival to the next forward's launch: with
      TINYPAGED_SPEC_OVERLAP=0, host work that the GPU waits for; overlapped (the default) that
      launch is the step after next, queued while the GPU computes the one in flight, so GPU idle
      is what tells. Then the engine-thread calls in that gap, each timed (GAP_PHASES: the
      scheduler's update and schedule, the proposer, build_step, the runner's execute), and the CUDA
      runtime calls each made in the profiled steps (a graph launch, the input copies, any
      synchronization): not overlapped, all of them delay the next launch (which calls; their
      times are inflated by the profiler, a graph launch's most of all).
host  a tiny random Llama on the CPU (torch references), async scheduling on: this thread's
      CPU time per step outside the model's forward and logits, split into the part before
      the forward is launched (under speculation the GPU idles through it: the step needs the
      previous step's accepted tokens first) and the part after it (overlaps the forward); the
      least of --repeats runs.
      --profile: a cProfile of the speculative run's largest batch.
      --no-model: the forward and the logits replaced by zeros (greedy then emits token 0,
      so oracle_miss's drafts are still rejected): the host path alone, without the CPU
      forward's allocations and cache traffic between steps, nearer what a GPU host runs and
      far less noisy on a shared machine.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import re
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from tinypaged import LLM, SamplingParams
from tinypaged.bench.tiny_models import tiny_llama_config_dir

GPU_KINDS = [  # (kind, pattern on the lower-cased kernel name), first match wins
    ("attention", r"attention|_decode_split|_decode_merge"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|gemv|splitk|split_k|cublas|_mma"),
    ("copies", r"memcpy|memset"),
]


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (batch, length), generator=g).tolist()


def _engine(path: str, spec: dict | None, load_format: str = "dummy", **kwargs) -> LLM:
    return LLM(path, load_format=load_format, skip_tokenizer_init=True, seed=0,
               speculative_config=spec, **kwargs)


def _record(llm: LLM, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _start(engine, prompts: list[list[int]], output_len: int, tag: str, warm: int) -> None:
    """Add the requests and run the prefill and `warm` decode steps."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params)
    for _ in range(1 + warm):
        engine.step(finished_only=True)


def _finish(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step(finished_only=True)


def _miss_config(k: int, prompts: list[list[int]], conts: list[list[int]],
                 method: str = "oracle_miss") -> dict:
    return {"method": method, "num_speculative_tokens": k,
            "oracle_token_ids": [[p, c] for p, c in zip(prompts, conts)]}


def _release() -> None:
    """Free an engine the caller has shut down and dropped (its graphs hold cycles)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------- gpu


def _scoped(name: str, fn):
    def call(*args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)
    return call


def _gpu_kind(name: str, scope: str) -> str:
    if scope == "sp:sample":
        return "sampling"
    low = name.lower()
    if "rejection" in low:
        return "sampling"
    return next((k for k, pattern in GPU_KINDS if re.search(pattern, low)), "other")


def _attribute(trace: dict, num_steps: int) -> dict:
    """ms per step of each kernel kind, GPU busy, and the mean largest gap, from a trace."""
    events = trace["traceEvents"]
    ranges = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                    if e.get("cat") == "user_annotation" and e["name"] == "sp:sample")
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and "correlation" in e.get("args", {})}
    by_kind: dict = defaultdict(float)
    intervals = []
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        ts = launches.get(e.get("args", {}).get("correlation"))
        scope = "sp:sample" if ts is not None and any(a <= ts <= b for a, b in ranges) else ""
        by_kind[_gpu_kind(e["name"] if e["cat"] == "kernel" else e["cat"], scope)] += e["dur"]
        intervals.append((e["ts"], e["ts"] + e["dur"]))
    intervals.sort()
    busy, end, gaps = 0.0, None, []
    for a, b in intervals:
        if end is not None and a > end:
            gaps.append(a - end)
        if end is None or b > end:
            busy += b - (a if end is None else max(a, end))
            end = b
    span = intervals[-1][1] - intervals[0][0] if intervals else 0.0
    largest = sorted(gaps, reverse=True)[:num_steps]  # one gap a step, at most
    out = {k: v / 1e3 / num_steps for k, v in by_kind.items()}
    out.update(busy=busy / 1e3 / num_steps, span=span / 1e3 / num_steps,
               largest_gap=sum(largest) / 1e3 / max(len(largest), 1))
    return out


class _HostClock:
    """Wall time the engine thread spends waiting for a step's tokens (`collect`), and, where
    a step's launch follows the tokens it needs (speculation), from their arrival to the return
    of the launch (its forward queued): the host work the GPU waits for."""

    def __init__(self, executor) -> None:
        self.executor, self.collect, self.execute = executor, executor.collect, executor.execute
        self.waited = self.critical = 0.0
        self.num_critical, self.arrived = 0, None

        def collect(tokens):
            start = time.perf_counter()
            try:
                return self.collect(tokens)
            finally:
                self.arrived = time.perf_counter()
                self.waited += self.arrived - start

        def execute(*args, **kwargs):
            try:
                return self.execute(*args, **kwargs)
            finally:
                if self.arrived is not None:
                    self.critical += time.perf_counter() - self.arrived
                    self.num_critical += 1
                    self.arrived = None

        executor.collect, executor.execute = collect, execute

    def undo(self) -> None:
        del self.executor.collect, self.executor.execute  # back to the class's methods


# The engine-thread calls that sit between a verification's tokens and the next launch, timed
# one by one (the `gap` columns): (label, object path from the engine, method name).
GAP_PHASES = [
    ("update", "scheduler", "update"),  # apply: append the tokens, roll back rejected slots
    ("propose", "spec.proposer", "propose"),
    ("schedule", "scheduler", "schedule"),
    ("build_step", "runner", "build_step"),  # host arrays of the step
    ("execute", "runner", "execute"),  # inputs to the device and the graph's replay
]


def _owner(engine, path: str):
    obj = engine
    for name in path.split("."):
        obj = getattr(obj, name, None) if obj is not None else None
    return obj


class _PhaseClock:
    """Wall ms of each GAP_PHASES call; with `scope`, each also inside a record_function named
    gap:<label>, so a profiler trace shows which CUDA runtime calls each makes."""

    def __init__(self, engine, scope: bool = False) -> None:
        self.total: dict = defaultdict(float)
        self.patched = []
        for label, path, method in GAP_PHASES:
            obj = _owner(engine, path)
            if obj is None:
                continue
            fn = getattr(obj, method)

            def timed(*args, _fn=fn, _label=label, **kwargs):
                start = time.perf_counter()
                try:
                    if scope:
                        with torch.profiler.record_function("gap:" + _label):
                            return _fn(*args, **kwargs)
                    return _fn(*args, **kwargs)
                finally:
                    self.total[_label] += time.perf_counter() - start

            setattr(obj, method, timed)
            self.patched.append((obj, method))

    def undo(self) -> None:
        for obj, method in self.patched:
            delattr(obj, method)  # back to the class's method


def _gap_calls(trace: dict, num_steps: int) -> list[tuple[str, str, float, float]]:
    """(phase, CUDA runtime/driver call, calls a step, us a step) of the calls made inside each
    gap:<phase> range of a trace, most time first."""
    events = trace["traceEvents"]
    ranges = sorted((e["ts"], e["ts"] + e["dur"], e["name"][4:]) for e in events
                    if e.get("cat") == "user_annotation" and e["name"].startswith("gap:"))
    calls: dict = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") not in ("cuda_runtime", "cuda_driver"):
            continue
        phase = next((name for a, b, name in ranges if a <= e["ts"] <= b), None)
        if phase is not None:
            calls[phase, e["name"]][0] += 1
            calls[phase, e["name"]][1] += e.get("dur", 0.0)
    rows = [(ph, name, n / num_steps, us / num_steps) for (ph, name), (n, us) in calls.items()]
    return sorted(rows, key=lambda r: -r[3])


def _gpu_run(llm: LLM, prompts, args, tag: str) -> dict:
    engine = llm.engine
    samplers = [engine]
    if engine.spec is not None:
        samplers.append(engine.spec)
    saved = [s.sampler for s in samplers]
    runner = engine.runner
    graphs = [g for g in (runner.graphs, runner.spec_graphs) if g is not None]
    _start(engine, prompts, args.output_len, tag + "-t", warm=4)
    torch.cuda.synchronize()
    replays = sum(g.num_runs for g in graphs)
    host = _HostClock(engine.executor)
    phases = _PhaseClock(engine)
    start = time.perf_counter()
    for _ in range(args.timed):
        engine.step(finished_only=True)
    torch.cuda.synchronize()
    wall = 1e3 * (time.perf_counter() - start) / args.timed
    host.undo()
    phases.undo()
    scoped = _PhaseClock(engine, scope=True)
    replays = (sum(g.num_runs for g in graphs) - replays) / args.timed
    for s in samplers:
        s.sampler = _scoped("sp:sample", s.sampler)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(args.profiled):
            engine.step(finished_only=True)
        torch.cuda.synchronize()
    for s, fn in zip(samplers, saved):
        s.sampler = fn
    scoped.undo()
    _finish(engine)
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        trace = json.loads(Path(f"{tmp}/trace.json").read_text())
        row = _attribute(trace, args.profiled)
        row["gap_calls"] = _gap_calls(trace, args.profiled)
    row["phases"] = {k: 1e3 * v / args.timed for k, v in phases.total.items()}
    row["wall"], row["graph_replays"] = wall, replays
    row["host_wait"] = 1e3 * host.waited / args.timed
    row["tokens_to_launch"] = 1e3 * host.critical / max(host.num_critical, 1)
    row["idle"] = max(wall - row["busy"], 0.0)  # the profiler slows the host, not the GPU
    return row


def run_gpu(args) -> None:
    from tinypaged.bench.offline import SHAPES, shape_dir

    kwargs = dict(dtype="bfloat16", max_model_len=2048, max_num_seqs=max(args.batches),
                  gpu_memory_utilization=args.gpu_memory_utilization,
                  cudagraph_mode=args.cudagraph_mode)
    if args.model:  # a real checkpoint, its own weights (a GGUF file has no dummy load)
        path = args.model
        vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
        kwargs["load_format"] = "auto"
        args.model_shape = Path(path).name
    else:
        path, vocab = str(shape_dir(args.model_shape)), SHAPES[args.model_shape]["vocab_size"]
    prompts = {b: _prompts(b, args.prompt_len, vocab, seed=b) for b in args.batches}
    rows = {}
    llm = _engine(path, None, **kwargs)
    conts = {b: _record(llm, prompts[b], args.output_len) for b in args.batches}
    for b in args.batches:
        rows["no spec", b] = _gpu_run(llm, prompts[b], args, f"base{b}")
    llm.shutdown()
    del llm
    _release()
    every = [p for b in args.batches for p in prompts[b]]
    table = _miss_config(args.k, every, [c for b in args.batches for c in conts[b]],
                         args.method)
    llm = _engine(path, table, **kwargs)
    for b in args.batches:
        rows[args.method, b] = _gpu_run(llm, prompts[b], args, f"spec{b}")
    stats = llm.engine.get_stats()["spec_decode"]
    llm.shutdown()
    del llm
    _release()
    print_gpu(rows, stats, args, torch.cuda.get_device_name())


def print_gpu(rows: dict, stats: dict, args, device: str) -> None:
    kinds = ["gemm", "attention", "sampling", "copies", "other"]
    print(f"{device}, {args.model_shape} shape, prompt {args.prompt_len}, "
          f"k={args.k}: ms per decode step (one token per sequence in both; acceptance "
          f"{100 * stats['acceptance_rate']:.1f}%)")
    print("| run | batch | wall | " + " | ".join(kinds)
          + " | GPU busy | GPU idle | largest gap | graph replays | host wait | tokens to launch |")
    print("|---|---|---|" + "---|" * (len(kinds) + 6))
    for (name, b), r in rows.items():
        launch = "-" if name == "no spec" else f"{r['tokens_to_launch']:.3f}"
        cells = " | ".join(f"{r.get(k, 0.0):.3f}" for k in kinds)
        print(f"| {name} | {b} | {r['wall']:.3f} | {cells} | {r['busy']:.3f} | {r['idle']:.3f} "
              f"| {r['largest_gap']:.3f} | {r['graph_replays']:.2f} | {r['host_wait']:.3f} "
              f"| {launch} |")
    labels = [label for label, _, _ in GAP_PHASES]
    print("\nEngine-thread calls, wall ms a step (timed steps; under speculation all of them "
          "lie between the tokens and the launch):")
    print("| run | batch | " + " | ".join(labels) + " |")
    print("|---|---|" + "---|" * len(labels))
    for (name, b), r in rows.items():
        print(f"| {name} | {b} | "
              + " | ".join(f"{r['phases'].get(k, 0.0):.3f}" for k in labels) + " |")
    for (name, b), r in rows.items():
        if name == "no spec":
            continue
        # which calls a phase makes; their times are the profiler's (a graph launch shows
        # 0.3-0.5 ms here, 10-20 us timed without it: RESULTS-log.md, session 53)
        print(f"\nCUDA runtime calls inside each phase, {name} batch {b} (profiled steps, "
              "times under the profiler; calls and us a step):")
        for phase, call, n, us in r["gap_calls"][:14]:
            print(f"  {phase:<11} {call:<40} {n:6.1f} {us:9.1f}")
    for b in args.batches:
        base, spec = rows["no spec", b], rows[args.method, b]
        print(json.dumps({"batch": b, "method": args.method,
                          "ratio": round(base["wall"] / spec["wall"], 3),  # per step
                          "extra_ms": round(spec["wall"] - base["wall"], 3),
                          "extra_busy_ms": round(spec["busy"] - base["busy"], 3),
                          "extra_idle_ms": round(spec["idle"] - base["idle"], 3)}))


# ------------------------------------------------------------------------------------ host


def _host_run(llm: LLM, prompts, args, tag: str, profiler: cProfile.Profile | None) -> dict:
    """ms of this thread's CPU per step: before the forward's launch, and the rest (the
    forward and the logits excluded)."""
    engine = llm.engine
    model, clock = engine.runner.model, time.thread_time
    marks = {"model": 0.0, "before": 0.0, "step_start": 0.0, "first": None}
    forward, logits = model.forward, model.compute_logits
    run_forward, run_logits = forward, logits
    if args.no_model:
        vocab = engine.vocab_size

        def run_forward(input_ids, *a, **kw):
            return torch.zeros(len(input_ids), 1)

        def run_logits(hidden):
            return torch.zeros(len(hidden), vocab)

    def timed_forward(*a, **kw):
        now = clock()
        if marks["first"] is None:  # the first forward call of the step: its launch
            marks["first"] = now
            marks["before"] += now - marks["step_start"]
        try:
            return run_forward(*a, **kw)
        finally:
            marks["model"] += clock() - now

    def timed_logits(*a, **kw):
        now = clock()
        try:
            return run_logits(*a, **kw)
        finally:
            marks["model"] += clock() - now

    model.forward, model.compute_logits = timed_forward, timed_logits
    _start(engine, prompts, args.steps + 16, tag, warm=4)
    marks.update(model=0.0, before=0.0)
    total = 0.0
    if profiler is not None:
        profiler.enable()
    for _ in range(args.steps):
        marks["first"], marks["step_start"] = None, clock()
        engine.step(finished_only=True)
        total += clock() - marks["step_start"]
    if profiler is not None:
        profiler.disable()
    model.forward, model.compute_logits = forward, logits
    _finish(engine)
    host = total - marks["model"]
    return {"before": 1e3 * marks["before"] / args.steps,
            "after": 1e3 * (host - marks["before"]) / args.steps,
            "model": 1e3 * marks["model"] / args.steps}


def _host_best(llm: LLM, prompts, args, tag: str, profiler: cProfile.Profile | None) -> dict:
    """The smallest of --repeats runs, part by part: a shared machine only adds time."""
    runs = [_host_run(llm, prompts, args, f"{tag}-{i}", profiler if i == 0 else None)
            for i in range(args.repeats)]
    return {key: min(r[key] for r in runs) for key in runs[0]}


def run_host(args) -> None:
    torch.set_num_threads(1)
    path = tiny_llama_config_dir("tinypaged-spec-host-")
    kwargs = dict(dtype="float32", device="cpu", max_num_seqs=max(args.batches),
                  num_kv_blocks=4096, kernels="torch", async_scheduling=True)
    prompts = {b: [[3 + (i + j) % 97 for j in range(32)] for i in range(b)] for b in args.batches}
    llm = _engine(path, None, **kwargs)
    conts = {b: _record(llm, prompts[b], args.steps + 16) for b in args.batches}
    rows = {("no spec", b): _host_best(llm, prompts[b], args, f"base{b}", None)
            for b in args.batches}
    llm.shutdown()
    del llm
    _release()
    every = [p for b in args.batches for p in prompts[b]]
    llm = _engine(path, _miss_config(args.k, every, [c for b in args.batches for c in conts[b]]),
                  **kwargs)
    profiler = cProfile.Profile(time.thread_time) if args.profile else None
    for b in args.batches:
        last = b == max(args.batches)
        rows["oracle_miss", b] = _host_best(llm, prompts[b], args, f"spec{b}",
                                            profiler if last else None)
    stats = llm.engine.get_stats()["spec_decode"]
    llm.shutdown()
    del llm
    _release()
    print(f"host CPU ms per step (tiny Llama, torch references, k={args.k}, acceptance "
          f"{100 * stats['acceptance_rate']:.1f}%)")
    print("| run | batch | before the forward | after it | total host | model (excluded) |")
    print("|---|---|---|---|---|---|")
    for (name, b), r in rows.items():
        print(f"| {name} | {b} | {r['before']:.3f} | {r['after']:.3f} | "
              f"{r['before'] + r['after']:.3f} | {r['model']:.3f} |")
    if profiler is not None:
        pstats.Stats(profiler).sort_stats(args.sort).print_stats(
            r"tinypaged/(?!kernels|models)", 30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["gpu", "host"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--method", choices=["oracle_miss", "oracle"], default="oracle_miss",
                        help="gpu: oracle accepts every draft (k + 1 tokens a step): what a "
                        "step costs when it takes all of them")
    parser.add_argument("--model-shape", default="llama3-8b", help="gpu")
    parser.add_argument("--model", help="gpu: a model folder with real weights, in place of "
                        "--model-shape (e.g. the default model's, whose GGUF has no dummy load)")
    parser.add_argument("--prompt-len", type=int, default=512, help="gpu")
    parser.add_argument("--output-len", type=int, default=96, help="gpu: tokens per request")
    parser.add_argument("--timed", type=int, default=40, help="gpu: decode steps timed")
    parser.add_argument("--profiled", type=int, default=20, help="gpu: decode steps profiled")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="gpu")
    parser.add_argument("--cudagraph-mode", default="FULL_DECODE_ONLY",
                        help="gpu: the decode steps measured replay full graphs either way; "
                             "piecewise graphs (prompt steps) only cost capture time here")
    parser.add_argument("--steps", type=int, default=60, help="host: steps timed")
    parser.add_argument("--repeats", type=int, default=3, help="host: runs, the least kept")
    parser.add_argument("--profile", action="store_true", help="host: cProfile the spec run")
    parser.add_argument("--sort", default="tottime", help="host: cProfile order")
    parser.add_argument("--no-model", action="store_true",
                        help="host: zeros for the forward and the logits (the host path alone)")
    args = parser.parse_args()
    if args.mode == "gpu":
        per_step = args.k + 1 if args.method == "oracle" else 1
        if args.output_len < per_step * (8 + args.timed + args.profiled):
            raise ValueError(f"--output-len must cover 8 + --timed + --profiled decode steps "
                             f"of {per_step} tokens, got {args.output_len}")
        return run_gpu(args)
    return run_host(args)


if __name__ == "__main__":
    main()
