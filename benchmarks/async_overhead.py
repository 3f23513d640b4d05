"""What async scheduling costs or saves per step, and why: one command on one GPU.

1. Check: a tiny random Llama in float32 gives the same greedy tokens, stop ids and finish reasons
   eager (sync), with CUDA graphs (sync) and with CUDA graphs (async).
2. Decode, Llama-3-8B shape, batch 1 and 8 (and more with --batch-sizes), sync vs async
   interleaved in one engine: ms per step, and the host synchronizations per step (torch's sync
   debug mode, with the Python line that made each).
3. A torch profile of --profile-steps decode steps each way: the top ops by CPU and by CUDA time,
   and the GPU's idle time between its kernels (from the trace), per step.
4. Offline, Qwen3-0.6B shape (bench throughput's workload, --num-prompts prompts): tok/s each
   way, and what the steps were (pure decode in a graph / eager with prompt tokens) and how many
   host synchronizations each kind made.

    PYTHONPATH=. python benchmarks/async_overhead.py [--out DIR] [--budget-s 55]

Stages past --budget-s seconds are skipped (the GPU round gives each script a minute).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import tempfile
import time
import traceback
import warnings
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch

from tinypaged import LLM, SamplingParams
from tinypaged.bench.offline import SHAPES, sample_requests, shape_dir

TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=128,
            intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=4096, max_position_embeddings=512,
            rms_norm_eps=1e-5, tie_word_embeddings=True, torch_dtype="float32")
T0 = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T0


def timed(fn, *args, **kwargs) -> tuple[float, object]:
    """(seconds fn(*args, **kwargs) took, the GPU drained before and after; what it returned)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    torch.cuda.synchronize()
    return time.perf_counter() - t, out


def set_mode(llm: LLM, use_async: bool) -> None:
    llm.engine.config.async_scheduling = use_async


def free(*objs) -> None:
    del objs
    gc.collect()
    torch.cuda.empty_cache()


@contextmanager
def count_syncs(where: Counter):
    """Count the host synchronizations torch reports (sync debug mode) by the first line of
    tinypaged code on the stack."""
    def hook(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "tinypaged" in f.filename
                  and "benchmarks" not in f.filename]
        site = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
        where[site] += 1

    torch.cuda.set_sync_debug_mode(1)
    try:
        with warnings.catch_warnings():  # restores showwarning too
            warnings.simplefilter("always")
            warnings.showwarning = hook
            yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def check_tokens() -> str:
    path = Path(tempfile.mkdtemp(prefix="tinypaged-async-"))
    (path / "config.json").write_text(json.dumps(TINY))
    ids = sample_requests(24, 5, 60, TINY["vocab_size"], seed=3)
    prompts = [{"prompt_token_ids": p} for p in ids]
    greedy = [SamplingParams(temperature=0.0, max_tokens=4 + i % 20, ignore_eos=True)
              for i in range(len(prompts))]
    runs = {}
    for eager in (True, False):
        llm = LLM(str(path), load_format="dummy", skip_tokenizer_init=True, dtype="float32",
                  enable_prefix_caching=False, max_num_seqs=16, enforce_eager=eager,
                  num_kv_blocks=256, max_model_len=256, max_num_batched_tokens=512,
                  async_scheduling=True)  # the runner keeps what async needs; set_mode flips
        for use_async in ((False,) if eager else (False, True)):
            set_mode(llm, use_async)
            outs = llm.generate(prompts, greedy, use_tqdm=False)
            runs[eager, use_async] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason)
                                      for o in outs]
            stops = [SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[t[2]])
                     for t, _ in runs[True, False]]
            outs = llm.generate(prompts, stops, use_tqdm=False)
            runs["stop", eager, use_async] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason)
                                              for o in outs]
        free(llm)
    base, stop = runs[True, False], runs["stop", True, False]
    bad = [k for k in ((False, False), (False, True)) if runs[k] != base
           or runs[("stop", *k)] != stop]
    if bad:
        raise SystemExit(f"FAIL: tokens differ from eager sync in (eager, async) = {bad}")
    return "tokens: eager sync == graphs sync == graphs async (greedy, stop ids, max_tokens): OK"


def decode(args, out_dir: Path) -> list[str]:
    cfg = SHAPES["llama3-8b"]
    llm = LLM(str(shape_dir("llama3-8b")), load_format="dummy", skip_tokenizer_init=True,
              dtype="bfloat16", max_model_len=2048, max_num_seqs=max(args.batch_sizes),
              max_num_batched_tokens=4096, num_kv_blocks=4096, async_scheduling=True)
    print(f"8B-shape engine up ({elapsed():.0f} s)", flush=True)
    engine = llm.engine
    times: dict = {}
    syncs: dict = {}
    notes: list[str] = []

    def start(tag: str, batch: int, steps: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
        for i, p in enumerate(sample_requests(batch, 512, 512, cfg["vocab_size"], seed=batch)):
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params)
        for _ in range(3):  # the prefill and the first decodes
            engine.step(finished_only=True)

    def finish() -> list:
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step(finished_only=True)
        return sorted((o.request_id, o.outputs[0].token_ids) for o in outs)

    n = args.decode_steps

    def time_steps(tag: str, batch: int) -> tuple[float, list]:
        """Seconds per step over n decode steps of `batch` new sequences, then their tokens."""
        start(tag, batch, n + 8)
        seconds, _ = timed(lambda: [engine.step(finished_only=True) for _ in range(n)])
        return seconds / n, [ids for _, ids in finish()]

    for batch in args.batch_sizes:
        tokens = {}
        for rep in range(2):
            for use_async in (False, True):
                set_mode(llm, use_async)
                per_step, toks = time_steps(f"d{batch}{use_async}{rep}", batch)
                times[batch, use_async] = min(times.get((batch, use_async), 1e9), per_step)
                tokens.setdefault(use_async, toks)
        same = tokens[False] == tokens[True]
        notes.append(f"batch {batch}: sync and async greedy tokens {'equal' if same else 'DIFFER'}")
        graphs = engine.runner.graphs
        if graphs is not None:  # the graphs' staging against the eager path (bf16: report)
            set_mode(llm, False)
            start(f"e{batch}", batch, 12)
            graph_run = finish()
            engine.runner.graphs = None
            start(f"e{batch}", batch, 12)
            eager_run = finish()
            engine.runner.graphs = graphs
            agree = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                     for (_, a), (_, b) in zip(graph_run, eager_run)]
            notes.append(f"batch {batch}: graph vs eager, tokens equal before the first "
                         f"difference (of 12, per sequence): {agree}")
        graphs = engine.runner.graphs
        if graphs is not None:  # before this branch: logits indexed with the numpy rows
            run = graphs.run
            graphs.run = lambda step, run=run: run(step)[step.logits_indices]
            for use_async in (False, True):
                set_mode(llm, use_async)
                times[batch, use_async, "numpy index"] = time_steps(f"o{batch}{use_async}",
                                                                    batch)[0]
            del graphs.run
        for use_async in (False, True):  # syncs per step, a short window (warnings are slow)
            set_mode(llm, use_async)
            start(f"s{batch}{use_async}", batch, 16)
            where: Counter = Counter()
            with count_syncs(where):
                for _ in range(8):
                    engine.step(finished_only=True)
            finish()
            syncs[batch, use_async] = {k: v / 8 for k, v in where.items()}
    report(args, times, syncs)
    print("\n".join(notes), f"({elapsed():.0f} s)", flush=True)
    notes = []
    small = [b for b in args.batch_sizes if b <= 8]  # profiles and paths: the small batches
    for batch in small if "profile" in args.stages else ():
        for use_async in (False, True):
            if elapsed() > args.budget_s - 15:
                notes.append(f"profile b{batch} {use_async} skipped: out of time")
                continue
            notes += profile(llm, start, finish, batch, use_async, args.profile_steps, out_dir)
    if "paths" in args.stages:
        if elapsed() < args.budget_s - 12:
            notes += paths(llm, small, args.paths_output_len)
        else:
            notes.append("paths skipped: out of time")
    free(llm, engine)
    return notes


def report(args, times: dict, syncs: dict) -> None:
    print(f"\n| decode, Llama-3-8B shape ({torch.cuda.get_device_name()}) | sync ms/step (tok/s) "
          f"| async ms/step (tok/s) | async/sync |")
    print("|---|---|---|---|")
    for batch in args.batch_sizes:
        s, a = times[batch, False], times[batch, True]
        print(f"| batch {batch} | {1000 * s:.3f} ({1 / s:.1f}) | {1000 * a:.3f} ({1 / a:.1f}) | "
              f"{s / a:.3f}x |")
    for batch in args.batch_sizes:
        if (batch, False, "numpy index") in times:
            s, a = times[batch, False, "numpy index"], times[batch, True, "numpy index"]
            print(f"| batch {batch}, logits[numpy rows] as before | {1000 * s:.3f} ({1 / s:.1f}) "
                  f"| {1000 * a:.3f} ({1 / a:.1f}) | {s / a:.3f}x |")
    for (batch, use_async), where in syncs.items():
        print(f"host syncs per step, batch {batch} {'async' if use_async else 'sync'}: "
              f"{where or 'none'}")


def profile(llm, start, finish, batch: int, use_async: bool, steps: int, out_dir: Path):
    engine = llm.engine
    set_mode(llm, use_async)
    start(f"p{batch}{use_async}", batch, steps + 8)
    launch, process = engine._launch, engine._process

    def timed_launch(*a, **k):
        with torch.profiler.record_function("engine._launch"):
            return launch(*a, **k)

    def timed_process(*a, **k):
        with torch.profiler.record_function("engine._process"):
            return process(*a, **k)

    engine._launch, engine._process = timed_launch, timed_process
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            engine.step(finished_only=True)
        torch.cuda.synchronize()
    del engine._launch, engine._process
    finish()
    mode = "async" if use_async else "sync"
    name = f"b{batch}-{mode}"
    trace = out_dir / f"trace-{name}.json"
    prof.export_chrome_trace(str(trace))
    avg = prof.key_averages()
    tables = (avg.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=48)
              + "\n" + avg.table(sort_by="self_cuda_time_total", row_limit=25,
                                 max_name_column_width=48))
    (out_dir / f"ops-{name}.txt").write_text(tables)
    gaps = gpu_gaps(trace)
    cpu = {e.key: e.cpu_time_total / e.count for e in avg
           if e.key in ("engine._launch", "engine._process", "cudaStreamSynchronize",
                        "cudaEventSynchronize", "cudaGraphLaunch", "cudaMemcpyAsync")}
    short = {k: round(v, 1) for k, v in cpu.items()}
    line = (f"profile {name}: GPU busy {gaps['busy_us'] / steps:.0f} us/step, idle "
            f"{gaps['idle_us'] / steps:.0f} us/step ({gaps['gaps_over_20us']} gaps > 20 us, "
            f"largest {gaps['largest_us']:.0f} us); CPU us per call {short}")
    top = sorted(avg, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
    line += "\n    top self CPU (us/step): " + ", ".join(
        f"{e.key[:32]} {e.self_cpu_time_total / steps:.0f}" for e in top)
    return [line]


def paths(llm: LLM, batch_sizes: list[int], out_len: int) -> list[str]:
    """Per-sequence decode tok/s of the same engine through LLM.generate (the anchor kit's
    measure: (t(out_len) - t(1)) / (out_len - 1)) and through AsyncLLM (`bench latency`'s), each
    mode. AsyncLLM takes the engine over last (its thread then owns it)."""
    from tinypaged.bench.offline import _latency
    from tinypaged.engine.async_llm import AsyncLLM

    cfg = SHAPES["llama3-8b"]
    lines = []
    for batch in batch_sizes:
        prompts = [{"prompt_token_ids": p}
                   for p in sample_requests(batch, 512, 512, cfg["vocab_size"], seed=2 + batch)]
        for use_async in (False, True):
            set_mode(llm, use_async)
            t = {}
            for n in (1, out_len, 1, out_len):  # the second pair counts (prefix cache warm)
                sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                t[n] = timed(llm.generate, prompts, sp, use_tqdm=False)[0]
            lines.append(f"LLM.generate batch {batch} {'async' if use_async else 'sync'}: "
                         f"{(out_len - 1) / (t[out_len] - t[1]):.1f} tok/s per sequence")
    client = AsyncLLM.__new__(AsyncLLM)
    client._init(llm.engine)
    bench_args = argparse.Namespace(batch_sizes=batch_sizes, input_len=512, output_len=out_len,
                                    tensor_parallel_size=1, quantization=None)
    for use_async in (False, True):
        set_mode(llm, use_async)
        result = asyncio.run(_latency(client, cfg, bench_args))
        lines += [f"AsyncLLM (bench latency) batch {b} {'async' if use_async else 'sync'}: "
                  f"{r['tok_s_per_seq']:.1f} tok/s per sequence" for b, r in result.items()]
    asyncio.run(client.shutdown())
    return lines


def gpu_gaps(trace: Path) -> dict:
    """Busy and idle time of the GPU stream(s) over the profiled window, from the trace."""
    events = json.loads(trace.read_text())["traceEvents"]
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                   if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    if not spans:
        return {"busy_us": 0, "idle_us": 0, "gaps_over_20us": 0, "largest_us": 0}
    busy = idle = largest = 0.0
    count = 0
    cur_s, cur_e = spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gap = s - cur_e
            idle += gap
            largest = max(largest, gap)
            count += gap > 20
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    return {"busy_us": busy, "idle_us": idle, "gaps_over_20us": count, "largest_us": largest}


def offline(args) -> tuple[dict, dict]:
    cfg = SHAPES["qwen3-0.6b"]
    llm = LLM(str(shape_dir("qwen3-0.6b")), load_format="dummy", skip_tokenizer_init=True,
              dtype="bfloat16", max_model_len=2048, max_num_batched_tokens=16384,
              max_num_seqs=256, enable_prefix_caching=False, num_kv_blocks=8192,
              async_scheduling=True)
    print(f"Qwen3-0.6B-shape engine up ({elapsed():.0f} s)", flush=True)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warm = sample_requests(8, 100, 1024, cfg["vocab_size"], seed=1)
    llm.generate([{"prompt_token_ids": p} for p in warm], params, use_tqdm=False)
    prompts = [{"prompt_token_ids": p}
               for p in sample_requests(args.num_prompts, 100, 1024, cfg["vocab_size"])]
    result: dict = {}
    for use_async in (False, True, False, True):  # twice each, the best counts
        set_mode(llm, use_async)
        seconds, outs = timed(llm.generate, prompts, params, use_tqdm=False)
        tok_s = sum(len(o.outputs[0].token_ids) for o in outs) / seconds
        result[use_async] = max(result.get(use_async, 0.0), tok_s)
    print(f"offline Qwen3-0.6B shape, {args.num_prompts} prompts x {args.output_len} out: "
          f"sync {result[False]:,.0f} tok/s, async {result[True]:,.0f} tok/s "
          f"({result[True] / result[False]:.3f}x) ({elapsed():.0f} s)", flush=True)
    if elapsed() > args.budget_s - 6:
        return result, {"step counts": "skipped: out of time"}
    # What the steps were, and their host syncs (one more async run, counted).
    kinds: Counter = Counter()
    launch = engine._launch

    def counted(out):
        decode = all(it.num_new_tokens == 1 for it in out.scheduled)
        kinds["decode" if decode else "with prompt tokens"] += 1
        before = sum(where.values())
        step = launch(out)
        kinds[("syncs in launch", "decode" if decode else "prompt")] += (
            sum(where.values()) - before)
        return step

    set_mode(llm, True)
    where: Counter = Counter()
    engine._launch = counted
    with count_syncs(where):
        llm.generate(prompts[: max(8, args.num_prompts // 4)], params, use_tqdm=False)
    del engine._launch
    idle = {}
    for use_async in (False, True):  # GPU busy / idle over 10 steps once all are admitted
        if elapsed() > args.budget_s - 4:
            break
        set_mode(llm, use_async)
        for i, p in enumerate(prompts):
            engine.add_request(f"g{use_async}-{i}", p, params)
        while engine.scheduler.num_waiting or any(
                s.is_prefill for s in engine.scheduler.running.values()):
            engine.step(finished_only=True)
        for _ in range(3):
            engine.step(finished_only=True)
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(10):
                engine.step(finished_only=True)
            torch.cuda.synchronize()
        trace = Path(tempfile.mkdtemp()) / "offline.json"
        prof.export_chrome_trace(str(trace))
        gaps = gpu_gaps(trace)
        idle["async" if use_async else "sync"] = (
            f"busy {gaps['busy_us'] / 10:.0f} us/step, idle {gaps['idle_us'] / 10:.0f} us/step "
            f"at batch {engine.scheduler.num_running}")
        while engine.has_unfinished_requests():
            engine.step(finished_only=True)
    free(llm, engine)
    return result, {"steps": dict(kinds), "sync sites": dict(where), "decode GPU": idle}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--budget-s", type=float, default=55.0)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--stages", nargs="+",
                        default=["check", "decode", "profile", "paths", "offline"],
                        choices=["check", "decode", "profile", "paths", "offline"])
    parser.add_argument("--paths-output-len", type=int, default=128)
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if "check" in args.stages:
        print(check_tokens(), f"({elapsed():.0f} s)", flush=True)
    if {"decode", "profile", "paths"} & set(args.stages):
        notes = decode(args, out_dir)
        print("\n".join(notes), f"\n({elapsed():.0f} s)", flush=True)
    if "offline" in args.stages and elapsed() < args.budget_s - 20:
        print(offline(args)[1])
    elif "offline" in args.stages:
        print("offline stage skipped: out of time")
    print(f"total {elapsed():.0f} s")


if __name__ == "__main__":
    main()
