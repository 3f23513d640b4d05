"""Where the GPU time of one offline run goes: GEMMs, attention, norms, rotary, activations,
sampling and GPU idle (host gaps), split into pure-decode steps and steps with prefill tokens.
Several shapes run one after the other in one process.

    PYTHONPATH=. python benchmarks/offline_profile.py --model-shape llama3-8b [qwen3-0.6b]
        [--num-prompts 256] [--block-size 16] [--json out.json]

The workload of `tinypaged bench throughput` and the vLLM anchor kit (prompts of 100-1024 random
tokens from Random(0), 256 greedy output tokens, EOS ignored, 16,384 batched tokens, 256
sequences, max_model_len 2048; a KV cache that holds every sequence), after a warm-up on 8
prompts of seed 1. The run is done twice:

1. under torch.profiler (CPU + CUDA) on the same prompts with every token id shifted by one (the
   same lengths, no prefix-cache hit): each GPU kernel is tied, through its launch's correlation
   id, to the engine scope that launched it (a `record_function` around the runner's `execute`,
   named by the step kind, around the LM head of eager steps and around the sampler) and put in a
   category by its name. Kernels replayed from a decode CUDA graph belong to the graph's launch.
2. without the profiler, timed: output tok/s as the benchmark reports it. GPU idle is this run's
   wall time minus the profiled run's busy time (the union of kernel and copy intervals), since
   the profiler slows the host, not the kernels. Of it, "idle inside steps" (profiled run) is
   the gaps between the kernels a step launched; the timed run's CUDA events
   (offline_steps.StepTimeline) give the idle between steps and the host's time per step.

Prints one table (ms per category, mixed vs decode steps, share of the timed wall) and what the
GEMMs and attention reach against the roofline (790 TFLOP/s, 4.2 TB/s), plus the top kernels.
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from benchmarks.offline_steps import StepTimeline
from benchmarks.offline_steps import print_summary as print_timeline
from tinypaged import LLM, SamplingParams
from tinypaged.bench.offline import (
    COPY_BW,
    PEAK_FLOPS,
    SHAPES,
    _attn_params,
    _mlp_params,
    sample_requests,
    shape_dir,
    warmup_requests,
)
from tinypaged.config import EngineConfig

CATEGORIES = [  # (category, pattern on the kernel name), first match wins
    ("attention prefill", r"_hopper_attention|_varlen_attention"),
    ("attention decode", r"_decode_split|_decode_merge"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|gemv|splitk|cublas"),
    ("rms norm", r"rms_norm"),
    ("rotary + kv store", r"rotary|store_kv"),
    ("silu and mul", r"act_and_mul"),
]


def category(name: str, scope: str) -> str:
    if scope in ("tp:sample", "tp:keep_sampled"):
        return "sampling"
    low = name.lower()
    for cat, pattern in CATEGORIES:
        if re.search(pattern, low):
            return "lm head gemm" if cat == "gemm" and scope == "tp:lm_head" else cat
    return "copies" if "memcpy" in low or "memset" in low else "other"


def scoped(name: str, fn):
    def call(*args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)
    return call


def instrument(llm: LLM, steps: list[dict]):
    """Wrap the runner's execute, the LM head and the sampler in named ranges; record every
    step's shape in `steps`. Returns a function that undoes it."""
    engine, runner = llm.engine, llm.engine.runner
    saved = (runner.execute, runner.keep_sampled, runner.model.compute_logits, engine.sampler)

    def execute(step):
        kind = "decode" if step.max_query_len == 1 else "mixed"
        q_lens = np.diff(step.query_start_loc)
        steps.append({"kind": kind, "q_lens": q_lens, "seq_lens": step.seq_lens.copy(),
                      "sampled": len(step.logits_indices)})
        with torch.profiler.record_function(f"tp:{kind}"):
            return saved[0](step)

    runner.execute = execute
    runner.keep_sampled = scoped("tp:keep_sampled", saved[1])
    runner.model.compute_logits = scoped("tp:lm_head", saved[2])
    engine.sampler = scoped("tp:sample", saved[3])

    def undo():
        runner.execute, runner.keep_sampled, runner.model.compute_logits, engine.sampler = saved
    return undo


def attribute(trace: dict) -> tuple[dict, dict, float, float]:
    """(ms per (step kind, category), ms per (kind, kernel name) , busy ms, span ms) of a
    chrome trace: each GPU event is found its launch and the innermost `tp:` range around it."""
    events = trace["traceEvents"]
    ranges = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                    if e.get("cat") == "user_annotation" and e["name"].startswith("tp:"))
    starts = [r[0] for r in ranges]
    launch_ts = {e["args"]["correlation"]: e["ts"] for e in events
                 if e.get("cat") in ("cuda_runtime", "cuda_driver")
                 and "correlation" in e.get("args", {})}

    def scope_of(ts: float) -> str:
        i = bisect.bisect_right(starts, ts) - 1
        for j in range(i, max(i - 4, -1), -1):  # ranges nest at most two deep
            if ranges[j][0] <= ts <= ranges[j][1]:
                return ranges[j][2]
        return "none"

    by_cat: dict = defaultdict(float)
    by_kernel: dict = defaultdict(lambda: [0, 0.0])
    intervals = []
    kinds = {"tp:decode": "decode", "tp:mixed": "mixed", "tp:lm_head": "mixed"}
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        ts = launch_ts.get(e.get("args", {}).get("correlation"))
        scope = "none" if ts is None else scope_of(ts)
        if scope == "tp:lm_head":  # nested in tp:mixed (eager steps only)
            kind = "mixed"
        else:
            kind = kinds.get(scope, "outside steps")
        cat = category(e["name"] if e["cat"] == "kernel" else e["cat"], scope)
        by_cat[kind, cat] += e["dur"] / 1e3
        row = by_kernel[kind, e["name"][:60]]
        row[0] += 1
        row[1] += e["dur"] / 1e3
        intervals.append((e["ts"], e["ts"] + e["dur"]))
    busy = _union(intervals)
    span = (max(b for _, b in intervals) - min(a for a, _ in intervals)) / 1e3 if intervals else 0.0
    by_cat.update(_step_bubbles(events, launch_ts))
    return by_cat, by_kernel, busy / 1e3, span


def _union(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals."""
    busy, end = 0.0, -1.0
    for a, b in sorted(intervals):
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


def _step_bubbles(events: list[dict], launch_ts: dict) -> dict:
    """ms of GPU idle inside steps, per step kind: for each launched step (a tp:mixed or
    tp:decode range), the span of the GPU work it launched minus the union of that work (the
    gaps between the kernels of a CUDA graph replay, or between eager launches)."""
    steps = sorted((e["ts"], e["ts"] + e["dur"], e["name"][3:]) for e in events
                   if e.get("cat") == "user_annotation" and e["name"] in ("tp:mixed", "tp:decode"))
    starts = [r[0] for r in steps]
    per_step: dict = defaultdict(list)
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        ts = launch_ts.get(e.get("args", {}).get("correlation"))
        i = -1 if ts is None else bisect.bisect_right(starts, ts) - 1
        if i >= 0 and ts <= steps[i][1]:
            per_step[i].append((e["ts"], e["ts"] + e["dur"]))
    out: dict = defaultdict(float)
    for i, iv in per_step.items():
        span = max(b for _, b in iv) - min(a for a, _ in iv)
        out[steps[i][2], "idle inside steps"] += (span - _union(iv)) / 1e3
    return out


def rooflines(cfg: dict, steps: list[dict]) -> dict:
    """Ideal ms of the GEMMs and attention of the recorded steps: compute-bound mixed steps at
    PEAK_FLOPS, bandwidth-bound decode steps at COPY_BW."""
    layers, h, vocab = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    nq, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    params = layers * (_attn_params(cfg) + _mlp_params(cfg, 1)[0])
    out = defaultdict(float)
    for s in steps:
        q, seq = s["q_lens"].astype(np.float64), s["seq_lens"].astype(np.float64)
        if s["kind"] == "mixed":
            out["mixed gemm"] += 2 * params * q.sum() / PEAK_FLOPS * 1e3
            out["mixed lm head"] += 2 * vocab * h * s["sampled"] / PEAK_FLOPS * 1e3
            pairs = (q * (seq - q) + q * (q + 1) / 2).sum()
            out["mixed attention"] += 4 * layers * nq * hd * pairs / PEAK_FLOPS * 1e3
        else:
            out["decode gemm (+ lm head)"] += 2 * (params + vocab * h) / COPY_BW * 1e3
            kv_bytes = seq.sum() * 2 * nkv * hd * 2 * layers
            out["decode attention"] += kv_bytes / COPY_BW * 1e3
    return dict(out)


def profile_shape(shape: str, args, stamp) -> dict:
    """Warm up, profile the workload (ids shifted), then time it; returns what print_report
    reads."""
    cfg = SHAPES[shape]
    extra = {} if args.block_size is None else {"block_size": args.block_size}
    # A fixed KV size (every sequence fits: no preemption, as at the anchor's 0.85 memory
    # share) so that a second shape's engine in this process does not depend on what the first
    # one left allocated.
    kv_tokens = args.num_prompts * (1024 + args.output_len) + 256 * 64
    block = args.block_size or EngineConfig(device="cuda").block_size
    llm = LLM(str(shape_dir(shape)), load_format="dummy", skip_tokenizer_init=True,
              dtype="bfloat16", max_model_len=2048, seed=0, max_num_batched_tokens=16384,
              max_num_seqs=256, num_kv_blocks=-(-kv_tokens // block), **extra)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    prompts = sample_requests(args.num_prompts, 100, 1024, cfg["vocab_size"])
    gen = lambda ps: llm.generate([{"prompt_token_ids": p} for p in ps], params,  # noqa: E731
                                  use_tqdm=False)
    stamp(f"{shape}: engine up")
    gen(warmup_requests(100, 1024, cfg["vocab_size"]))
    stamp("warmed up")

    steps: list[dict] = []
    undo = instrument(llm, steps)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        start = time.perf_counter()
        gen([[t + 1 for t in p] for p in prompts])
        torch.cuda.synchronize()
        profiled_s = time.perf_counter() - start
    undo()
    path = Path(tempfile.mkdtemp()) / "trace.json"
    prof.export_chrome_trace(str(path))
    del prof
    by_cat, by_kernel, busy_ms, span_ms = attribute(json.loads(path.read_text()))
    path.unlink()
    stamp(f"profiled run {profiled_s:.1f} s, trace read")

    torch.cuda.synchronize()
    timeline = StepTimeline(llm)
    timeline.begin()
    outs = gen(prompts)
    timeline.finish()
    timeline.undo()
    wall_ms = timeline.wall_ms
    result = {
        "shape": shape, "num_prompts": args.num_prompts, "output_len": args.output_len,
        "block_size": llm.engine.runner.block_size, "wall_ms": wall_ms,
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "profiled_ms": 1e3 * profiled_s, "busy_ms": busy_ms, "span_ms": span_ms,
        "by_category": dict(by_cat), "by_kernel": dict(by_kernel),
        "ideal_ms": rooflines(cfg, steps), "steps": steps, "timeline": timeline.summary(),
    }
    llm.shutdown()
    return result


def print_report(r: dict, top: int) -> dict:
    """Print the tables of one profile_shape result; returns its JSON-ready summary."""
    by_cat, by_kernel, steps, wall_ms = r["by_category"], r["by_kernel"], r["steps"], r["wall_ms"]
    n_mixed = sum(s["kind"] == "mixed" for s in steps)
    prefill_tokens = sum(int(s["q_lens"][s["q_lens"] > 1].sum()) for s in steps)
    print(f"{r['shape']} shape, {r['num_prompts']} prompts x {r['output_len']} out, block_size "
          f"{r['block_size']}: {r['output_tokens'] / wall_ms * 1e3:,.0f} output tok/s "
          f"({wall_ms:.0f} ms); {n_mixed} steps with prefill tokens ({prefill_tokens} prompt "
          f"tokens), {len(steps) - n_mixed} pure-decode steps")
    kinds = ("mixed", "decode", "outside steps")
    total = defaultdict(float)
    for (_, c), ms in by_cat.items():
        total[c] += ms
    print("| category | mixed steps ms | decode steps ms | outside steps ms | % of wall |")
    print("|---|---|---|---|---|")
    for c in sorted(total, key=lambda c: -total[c]):
        ms = [by_cat.get((k, c), 0.0) for k in kinds]
        print(f"| {c} | {ms[0]:.1f} | {ms[1]:.1f} | {ms[2]:.1f} | {100 * sum(ms) / wall_ms:.1f} |")
    busy_ms = r["busy_ms"]
    print(f"| GPU busy (union) | | | | {100 * busy_ms / wall_ms:.1f} ({busy_ms:.0f} ms) |")
    print(f"| GPU idle = timed wall - busy | | | | {100 * (wall_ms - busy_ms) / wall_ms:.1f} "
          f"({wall_ms - busy_ms:.0f} ms; profiled run: {r['span_ms'] - busy_ms:.0f} ms idle "
          f"of {r['profiled_ms']:.0f}) |")
    measured = {
        "mixed gemm": by_cat.get(("mixed", "gemm"), 0.0),
        "mixed lm head": by_cat.get(("mixed", "lm head gemm"), 0.0),
        "mixed attention": by_cat.get(("mixed", "attention prefill"), 0.0),
        "decode gemm (+ lm head)": by_cat.get(("decode", "gemm"), 0.0),
        "decode attention": by_cat.get(("decode", "attention decode"), 0.0),
    }
    ideal = r["ideal_ms"]
    print("| against the roofline | measured ms | ideal ms | fraction |")
    print("|---|---|---|---|")
    for name, ms in measured.items():
        frac = ideal.get(name, 0.0) / ms if ms else 0.0
        print(f"| {name} | {ms:.1f} | {ideal.get(name, 0.0):.1f} | {frac:.2f} |")
    for kind in ("mixed", "decode"):
        rows = sorted(((v[1], v[0], n) for (k, n), v in by_kernel.items() if k == kind),
                      reverse=True)[:top]
        print(f"top kernels, {kind} steps (ms / calls): " + "; ".join(
            f"{n} {ms:.1f} / {calls}" for ms, calls, n in rows))
    print("The timed run step by step (CUDA events between steps; offline_steps.py):")
    print_timeline(r["timeline"])
    # The profiler slows the host, so an eager step's gaps between kernels in the profiled run
    # can be the profiler's own; the timed run's GPU time per step kind minus the profiled
    # kernel time is the gap the timed run really had.
    phases = r["timeline"]["phases"]
    for kind, names in (("mixed", ("first step", "mixed")),
                        ("decode", ("decode, full batch", "decode, tail", "decode, early"))):
        timed = sum(phases[n]["gpu_ms"] for n in names if n in phases)
        kernels = sum(ms for (k, c), ms in by_cat.items() if k == kind and c != "idle inside steps")
        print(f"timed run, {kind} steps: GPU {timed:.0f} ms = kernels {kernels:.0f} ms (profiled "
              f"run) + {timed - kernels:.0f} ms between them")
    return {
        **{k: r[k] for k in ("shape", "num_prompts", "output_len", "block_size", "wall_ms",
                             "output_tokens", "profiled_ms", "busy_ms", "span_ms")},
        "mixed_steps": n_mixed, "decode_steps": len(steps) - n_mixed,
        "by_category": {f"{k}|{c}": v for (k, c), v in by_cat.items()},
        "by_kernel": {f"{k}|{n}": v for (k, n), v in by_kernel.items()},
        "ideal_ms": ideal, "measured_ms": measured, "timeline": r["timeline"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-shape", nargs="+", default=["llama3-8b"], choices=sorted(SHAPES))
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=None, help="default: the engine's")
    parser.add_argument("--top", type=int, default=8, help="kernels listed per step kind")
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args()
    t0 = time.perf_counter()

    def stamp(what: str) -> None:  # where the time of a short GPU slot goes
        print(f"[{time.perf_counter() - t0:5.1f} s] {what}", flush=True)

    print(torch.cuda.get_device_name())
    summaries = []
    for shape in args.model_shape:
        summaries.append(print_report(profile_shape(shape, args, stamp), args.top))
        if args.json:  # after each shape, so a cut-short run keeps what it measured
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(summaries, indent=1))


if __name__ == "__main__":
    main()
