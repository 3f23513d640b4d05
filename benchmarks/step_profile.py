"""Where an engine step's time goes, in three modes:

    PYTHONPATH=. python benchmarks/step_profile.py offline [--model-shape llama3-8b qwen3-0.6b]
        [--num-prompts 256] [--tp 1] [--json out.json]
    PYTHONPATH=. python benchmarks/step_profile.py decode [--model-shape llama3-8b]
        [--batches 1 8] [--layers 32] [--prompt-len 512] [--graphs] [--quantization fp8]
    PYTHONPATH=. python benchmarks/step_profile.py host [--batch-sizes 64 256] [--profile]  # CPU

offline  `tinypaged bench throughput`'s workload (prompts of 100-1024 random tokens, 256 greedy
         output tokens, 16,384 batched tokens, a KV cache that holds every sequence), after a
         warm-up, twice: under torch.profiler with every token id shifted by one (the same
         lengths, no prefix-cache hit), then timed. Each GPU kernel is tied, through its launch's
         correlation id, to the step that launched it ("mixed": steps with prompt tokens, eager
         or piecewise graphs; "decode": pure-decode CUDA-graph steps) and put in a kind by its
         name. Prints ms per kind against the timed wall, GPU busy (the union of the kernels'
         intervals) and idle (timed wall - busy: the GPU waiting for the host), the GEMMs and
         attention against the roofline, and the top kernels. With --tp N, rank 0's view (its
         all-reduce kernels include waiting for the slowest rank).
decode   GPU us per kernel and decode step at each batch size (three eager steps under the
         profiler) beside the wall time of a CUDA-graph step: the difference is host work and
         launch gaps. --graphs profiles the CUDA-graph replays instead (the kernels the engine
         runs; under PDL a kernel's time includes waiting on its predecessor's tail). --layers
         below the shape's count makes it cheaper (per-layer kernels then scale by layers; the
         LM head, the sampler and the host do not).
host     the engine's own Python per decode step, on the CPU: a tiny random Llama on the torch
         references, its forward and logits timed apart and subtracted (this thread's CPU time,
         which a busy machine disturbs less than wall time); --profile: a cProfile of it.
"""

from __future__ import annotations

import argparse
import bisect
import cProfile
import json
import pstats
import re
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

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
from tinypaged.bench.tiny_models import tiny_llama_config_dir

KINDS = [  # (kind, pattern on the lower-cased kernel name), first match wins
    ("attention prefill", r"_gluon_attention|_hopper_attention|_varlen_attention"),
    ("attention decode", r"_decode_split|_decode_merge"),
    ("all-reduce", r"all_?reduce|allgather|all_gather|nccl"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|gemv|splitk|cublas|_mma|moe|fp8_rows"),
    ("rms norm", r"rms_norm"),
    ("rotary + kv store", r"rotary|store_kv"),
    ("silu and mul", r"act_and_mul|silu_and_mul"),
    ("quantize fp8", r"quantize"),
    ("copies", r"memcpy|memset"),
]


def kind_of(name: str, scope: str = "") -> str:
    if scope == "tp:sample":
        return "sampling"
    low = name.lower()
    kind = next((k for k, pattern in KINDS if re.search(pattern, low)), "other")
    return "lm head gemm" if kind == "gemm" and scope == "tp:lm_head" else kind


# ----------------------------------------------------------------------------------- offline


def instrument(llm: LLM, steps: list[dict]):
    """Name the runner's execute (by step kind), the LM head and the sampler as profiler ranges
    and record each step's query and sequence lengths in `steps`; returns the undo."""
    engine, runner = llm.engine, llm.engine.runner
    saved = (runner.execute, runner.model.compute_logits, engine.sampler)

    def scoped(name: str, fn):
        def call(*args, **kwargs):
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)
        return call

    def execute(step):
        kind = "decode" if step.max_query_len == 1 else "mixed"
        steps.append({"kind": kind, "q_lens": np.diff(step.query_start_loc),
                      "seq_lens": step.seq_lens.copy()})
        with torch.profiler.record_function(f"tp:{kind}"):
            return saved[0](step)

    runner.execute = execute
    runner.model.compute_logits = scoped("tp:lm_head", saved[1])
    engine.sampler = scoped("tp:sample", saved[2])

    def undo() -> None:
        runner.execute, runner.model.compute_logits, engine.sampler = saved
    return undo


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, -1.0
    for a, b in sorted(intervals):
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy / 1e3


def attribute(trace: dict) -> tuple[dict, dict, float]:
    """(ms per (step kind, kernel kind), [calls, ms] per (step kind, kernel name), busy ms) of a
    chrome trace: each GPU event goes to the innermost `tp:` range around its launch. A graph
    replay's kernels share the graph launch's correlation id, so they land in its step."""
    events = trace["traceEvents"]
    ranges = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                    if e.get("cat") == "user_annotation" and e["name"].startswith("tp:"))
    starts = [r[0] for r in ranges]
    launch_ts = {e["args"]["correlation"]: e["ts"] for e in events
                 if e.get("cat") in ("cuda_runtime", "cuda_driver")
                 and "correlation" in e.get("args", {})}

    def scope_of(ts: float | None) -> str:
        i = -1 if ts is None else bisect.bisect_right(starts, ts) - 1
        for j in range(i, max(i - 4, -1), -1):  # the ranges nest at most two deep
            if ranges[j][0] <= ts <= ranges[j][1]:
                return ranges[j][2]
        return "none"

    by_kind: dict = defaultdict(float)
    by_kernel: dict = defaultdict(lambda: [0, 0.0])
    step_kind = {"tp:decode": "decode", "tp:mixed": "mixed", "tp:lm_head": "mixed"}
    intervals = []
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        scope = scope_of(launch_ts.get(e.get("args", {}).get("correlation")))
        step = step_kind.get(scope, "outside steps")  # the LM head runs inside eager steps only
        by_kind[step, kind_of(e["name"] if e["cat"] == "kernel" else e["cat"], scope)] += (
            e["dur"] / 1e3)
        row = by_kernel[step, e["name"][:60]]
        row[0] += 1
        row[1] += e["dur"] / 1e3
        intervals.append((e["ts"], e["ts"] + e["dur"]))
    return by_kind, by_kernel, _union_ms(intervals)


def rooflines(cfg: dict, steps: list[dict], tp: int, quantization: str | None = None) -> dict:
    """Ideal ms of the recorded steps' GEMMs and attention on one of `tp` GPUs: steps with
    prompt tokens at PEAK_FLOPS; pure-decode steps' attention at COPY_BW, their GEMMs at the
    slower of COPY_BW and PEAK_FLOPS (a batch of 256 rows is past the H200's ridge). FP8
    weights: the GEMMs at twice PEAK_FLOPS (Hopper's FP8 tensor-core rate) and one byte a
    weight (the LM head stays bf16)."""
    fp8 = quantization == "fp8"
    gemm_peak, weight_bytes = PEAK_FLOPS * (2 if fp8 else 1), 1 if fp8 else 2
    layers, h, vocab = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    nq, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    out: dict = defaultdict(float)
    for s in steps:
        q, seq = s["q_lens"].astype(np.float64), s["seq_lens"].astype(np.float64)
        if s["kind"] == "mixed":
            params = layers * (_attn_params(cfg) + _mlp_params(cfg, 1)[0])
            out["mixed gemm"] += 2 * params * q.sum() / gemm_peak * 1e3 / tp
            pairs = (q * (seq - q) + q * (q + 1) / 2).sum()
            out["mixed attention"] += 4 * layers * nq * hd * pairs / PEAK_FLOPS * 1e3 / tp
        else:
            params = layers * (_attn_params(cfg) + _mlp_params(cfg, len(seq))[1])
            weights = weight_bytes * params + 2 * vocab * h
            flops = 2 * len(seq) * (params / gemm_peak + vocab * h / PEAK_FLOPS)  # seconds
            out["decode gemm (+ lm head)"] += max(weights / COPY_BW, flops) * 1e3 / tp
            kv_bytes = seq.sum() * 2 * nkv * hd * 2 * layers
            out["decode attention"] += kv_bytes / COPY_BW * 1e3 / tp
    return dict(out)


def profile_offline(shape: str, args) -> dict:
    cfg = SHAPES[shape]
    kv_tokens = args.num_prompts * (1024 + args.output_len) + 256 * 64  # every sequence fits
    llm = LLM(str(shape_dir(shape)), load_format="dummy", skip_tokenizer_init=True,
              dtype="bfloat16", max_model_len=2048, seed=0, max_num_batched_tokens=16384,
              max_num_seqs=256, num_kv_blocks=-(-kv_tokens // 16), block_size=16,
              tensor_parallel_size=args.tp, quantization=args.quantization)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    def generate(prompts):
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    generate(warmup_requests(100, 1024, cfg["vocab_size"]))
    prompts = sample_requests(args.num_prompts, 100, 1024, cfg["vocab_size"])
    steps: list[dict] = []
    undo = instrument(llm, steps)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        generate([[t + 1 for t in p] for p in prompts])
        torch.cuda.synchronize()
    undo()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        by_kind, by_kernel, busy_ms = attribute(json.loads(Path(f"{tmp}/trace.json").read_text()))
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = generate(prompts)
    wall_ms = 1e3 * (time.perf_counter() - start)
    llm.shutdown()
    return {"shape": shape, "tp": args.tp, "quantization": args.quantization,
            "wall_ms": wall_ms, "busy_ms": busy_ms,
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "steps": {k: sum(s["kind"] == k for s in steps) for k in ("mixed", "decode")},
            "by_kind": {f"{s}|{k}": ms for (s, k), ms in by_kind.items()},
            "by_kernel": {f"{s}|{n}": v for (s, n), v in by_kernel.items()},
            "ideal_ms": rooflines(cfg, steps, args.tp, args.quantization)}


def print_offline(r: dict, top: int) -> None:
    wall, busy = r["wall_ms"], r["busy_ms"]
    quant = f", {r['quantization']}" if r.get("quantization") else ""
    print(f"\n{r['shape']} shape{quant}, TP={r['tp']}: "
          f"{r['output_tokens'] / wall * 1e3:,.0f} output tok/s ({wall:.0f} ms); "
          f"{r['steps']['mixed']} steps with prompt tokens, "
          f"{r['steps']['decode']} pure-decode steps")
    step_kinds = ("mixed", "decode", "outside steps")
    table: dict = defaultdict(lambda: dict.fromkeys(step_kinds, 0.0))
    for key, ms in r["by_kind"].items():
        step, kind = key.split("|")
        table[kind][step] += ms
    print("| kind | mixed steps ms | decode steps ms | outside steps ms | % of timed wall |")
    print("|---|---|---|---|---|")
    for kind, ms in sorted(table.items(), key=lambda kv: -sum(kv[1].values())):
        cells = " | ".join(f"{ms[s]:.1f}" for s in step_kinds)
        print(f"| {kind} | {cells} | {100 * sum(ms.values()) / wall:.1f} |")
    print(f"| GPU busy (union of intervals, profiled run) | | | | {100 * busy / wall:.1f} |")
    print(f"| GPU idle = timed wall - busy | | | | {100 * (wall - busy) / wall:.1f} |")
    measured = {"mixed gemm": table["gemm"]["mixed"],
                "mixed attention": table["attention prefill"]["mixed"],
                "decode gemm (+ lm head)": table["gemm"]["decode"],
                "decode attention": table["attention decode"]["decode"]}
    print("| against the roofline | measured ms | ideal ms | fraction |")
    print("|---|---|---|---|")
    for name, ms in measured.items():
        ideal = r["ideal_ms"].get(name, 0.0)
        print(f"| {name} | {ms:.1f} | {ideal:.1f} | {ideal / ms if ms else 0.0:.2f} |")
    for step in ("mixed", "decode"):
        rows = sorted(((v[1], v[0], key.split("|", 1)[1]) for key, v in r["by_kernel"].items()
                       if key.startswith(step + "|")), reverse=True)[:top]
        print(f"top kernels, {step} steps (ms / calls): "
              + "; ".join(f"{name} {ms:.1f} / {calls}" for ms, calls, name in rows))


# ------------------------------------------------------------------------------------ decode


def decode_kernels(llm: LLM, batch: int, prompt_len: int, vocab: int,
                   graphs: bool = False) -> tuple[dict, float]:
    """({kernel name: [calls, GPU us] per decode step}, wall us of a CUDA-graph decode step).
    The kernels are the eager steps', or with graphs the CUDA-graph replays' (what the engine
    runs: the one-row paths, the kernels chained by PDL)."""
    engine, profiled, timed = llm.engine, 3, 5
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for i, prompt in enumerate(sample_requests(batch, prompt_len, prompt_len, vocab, seed=batch)):
        engine.add_request(f"b{batch}-{i}", {"prompt_token_ids": prompt}, params)
    for _ in range(3):  # the prefill, two decode steps
        engine.step(finished_only=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(timed):
        engine.step(finished_only=True)
    torch.cuda.synchronize()
    step_us = 1e6 * (time.perf_counter() - start) / timed
    saved = engine.runner.graphs
    if not graphs:
        engine.runner.graphs = None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(profiled):
            engine.step(finished_only=True)
        torch.cuda.synchronize()
    engine.runner.graphs = saved
    while engine.has_unfinished_requests():
        engine.step(finished_only=True)
    table = {e.key: [e.count / profiled, e.device_time_total / profiled]
             for e in prof.key_averages() if e.device_time_total > 0}
    return table, step_us


def run_decode(args) -> None:
    cfg, path = SHAPES[args.model_shape[0]], shape_dir(args.model_shape[0])
    if args.layers:
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": args.layers}))
    llm = LLM(str(path), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=2048, num_kv_blocks=1024, max_num_seqs=max(args.batches),
              quantization=args.quantization)
    results = {b: decode_kernels(llm, b, args.prompt_len, cfg["vocab_size"], args.graphs)
               for b in args.batches}
    names = sorted({n for table, _ in results.values() for n in table},
                   key=lambda n: -max(t.get(n, [0, 0])[1] for t, _ in results.values()))
    print(f"{torch.cuda.get_device_name()}, {args.model_shape[0]} shape with "
          f"{args.layers or cfg['num_hidden_layers']} layers, prompt {args.prompt_len}: GPU us "
          f"per decode step")
    print("| kernel | kind | " + " | ".join(f"b{b} calls | b{b} us" for b in args.batches) + " |")
    print("|---|---|" + "---|" * (2 * len(args.batches)))
    for name in names:
        cells = " | ".join(f"{results[b][0].get(name, [0, 0])[0]:.0f} | "
                           f"{results[b][0].get(name, [0, 0])[1]:.1f}" for b in args.batches)
        print(f"| {name[:70]} | {kind_of(name)} | {cells} |")
    sums = " | ".join(f" | {sum(v[1] for v in results[b][0].values()):.1f}" for b in args.batches)
    print(f"| sum of kernels | | {sums} |")
    walls = " | ".join(f" | {results[b][1]:.1f}" for b in args.batches)
    print(f"| wall of a CUDA-graph step | | {walls} |")
    llm.shutdown()


# -------------------------------------------------------------------------------------- host


def run_host(args) -> None:
    torch.set_num_threads(1)
    path = tiny_llama_config_dir("tinypaged-host-")
    llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, dtype="float32",
              device="cpu", max_num_seqs=max(args.batch_sizes), num_kv_blocks=4096,
              kernels="torch", **({} if args.async_scheduling is None
                                  else {"async_scheduling": args.async_scheduling}))
    engine, model, model_s = llm.engine, llm.engine.runner.model, [0.0]

    def timed(fn):
        def call(*a, **kw):
            start = time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                model_s[0] += time.thread_time() - start
        return call

    model.forward, model.compute_logits = timed(model.forward), timed(model.compute_logits)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
    for batch in args.batch_sizes:
        for i in range(batch):
            engine.add_request(f"{batch}-{i}", {"prompt_token_ids": [3 + i % 100] * 32}, params)
        for _ in range(4):  # the prefill, the first decodes
            engine.step(finished_only=True)
        profiler = cProfile.Profile(time.thread_time)
        profiled = args.profile and batch == max(args.batch_sizes)
        start, model_s[0] = time.thread_time(), 0.0
        if profiled:
            profiler.enable()
        for _ in range(args.steps):
            engine.step(finished_only=True)
        if profiled:
            profiler.disable()
        per_step = (time.thread_time() - start) / args.steps
        host = per_step - model_s[0] / args.steps
        while engine.has_unfinished_requests():
            engine.step(finished_only=True)
        print(f"batch {batch}: {1e3 * host:.2f} ms of host per decode step ({1e3 * per_step:.2f} "
              f"ms with the model)")
        if profiled:
            pstats.Stats(profiler).sort_stats(args.sort).print_stats(
                r"tinypaged/(?!kernels|models)", 30)
    llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["offline", "decode", "host"])
    parser.add_argument("--model-shape", nargs="+", default=["llama3-8b"], choices=sorted(SHAPES),
                        help="offline: one or more, run in turn; decode: the first")
    parser.add_argument("--num-prompts", type=int, default=256, help="offline")
    parser.add_argument("--output-len", type=int, default=256, help="offline")
    parser.add_argument("--tp", type=int, default=1, help="offline: tensor-parallel size")
    parser.add_argument("--quantization", choices=["fp8"],
                        help="offline and decode: bf16 weights quantized at load")
    parser.add_argument("--top", type=int, default=8, help="offline: kernels listed per step kind")
    parser.add_argument("--json", help="offline: also write the numbers here")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="decode")
    parser.add_argument("--layers", type=int, help="decode: fewer layers than the shape's")
    parser.add_argument("--prompt-len", type=int, default=512, help="decode")
    parser.add_argument("--graphs", action="store_true",
                        help="decode: profile the CUDA-graph replays, not eager steps")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256], help="host")
    parser.add_argument("--steps", type=int, default=40, help="host: decode steps timed")
    parser.add_argument("--profile", action="store_true", help="host: cProfile the largest batch")
    parser.add_argument("--sort", default="tottime", help="host: cProfile order")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        help="host: force async scheduling on or off (default: the engine's)")
    args = parser.parse_args()
    if args.mode == "host":
        return run_host(args)
    print(torch.cuda.get_device_name())
    if args.mode == "decode":
        return run_decode(args)
    results = []
    for shape in args.model_shape:
        results.append(profile_offline(shape, args))
        print_offline(results[-1], args.top)
        if args.json:  # after each shape, so that a run cut short keeps what it measured
            Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
