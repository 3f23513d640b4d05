"""Milliseconds per engine step with none, half or all of a batch under a JSON schema: the host
cost of structured output, row by row (issue 35).

    PYTHONPATH=. python benchmarks/structured_steps.py --device cpu       # a tiny model, the CPU
    PYTHONPATH=. python benchmarks/structured_steps.py --model DIR --load-format dummy   # a GPU

Without --model the model is a 2-layer Llama of hidden size 64 with the default model's tokenizer
(49,152 tokens) and random weights: its forward is cheap, so a step is host-bound as the
SmolLM2-135M shape's step is on a GPU, and what a constrained row adds shows. Each run decodes
`--num-requests` random prompts for `--max-tokens` greedy tokens (ignore_eos; the constrained
requests follow an array of >= 1,000 schema objects, so every run takes the same steps), with
async scheduling on (as on a GPU: constrained steps sample late) and prefix caching off. Prints
ms per step (each column its best of `--repeats`) and each run's extra per constrained row over
plain: wall, the engine thread's CPU time (host) and its wall time less the simulated GPU work
below (host wall: what the step waits for, the grammar worker's thread included; on a GPU the
step's wall). `--profile RUN` prints a cProfile of that run's steps (cumulative, top 30).
TINYPAGED_GRAMMAR_THREAD=0 runs the grammar work on the engine thread, for an A/B.

On the CPU even this model's forward (the torch reference attention, the 49,152-wide head)
outweighs the host's work; `--skip-forward` keeps the runner's input preparation but returns
fixed random logits instead of running the model (each step copies them into one buffer: the
sampler masks its logits in place), so the steps measure the host path that a GPU step overlaps
with its forward.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from benchmarks.structured_throughput import workload  # the same prompts and schema
from tinypaged import LLM
from tinypaged.models.default_model import ensure_default_model
from tinypaged.sampling import sampler as sampler_module

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "vocab_size": 49152, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32",
}


def tiny_model_dir() -> str:
    path = Path(tempfile.mkdtemp(prefix="tiny_smol_"))
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    source = ensure_default_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(source / name, path / name)
    return str(path)


# Seconds in the fixed logits' copies and the sampler's tensor ops: [thread CPU, wall].
COMPUTE = [0.0, 0.0]


def skip_forward(llm: LLM, max_rows: int) -> None:
    """The model's forward replaced by a copy of fixed logits; the thread CPU time of that copy
    and of the sampler's tensor ops (a GPU's work, queued there, not the host's) goes to COMPUTE,
    their wall time too."""
    runner = llm.engine.runner
    vocab = llm.engine.vocab_size
    fixed = torch.randn(max_rows, vocab, generator=torch.Generator().manual_seed(0))
    fixed = fixed.to(runner.device)
    # One buffer refilled each step: a fresh tensor each step would be freed (unmapped) on the
    # engine thread, a CPU allocator's cost that the GPU's caching allocator does not have.
    out = torch.empty_like(fixed)

    def execute(step):
        t0, w0 = time.thread_time(), time.perf_counter()
        logits = out[: len(step.logits_indices)]
        logits.copy_(fixed[: len(logits)])
        COMPUTE[0] += time.thread_time() - t0
        COMPUTE[1] += time.perf_counter() - w0
        return logits

    runner.execute = execute
    probs = sampler_module.processed_probs

    def processed_probs(*args, **kwargs):
        t0, w0 = time.thread_time(), time.perf_counter()
        out = probs(*args, **kwargs)
        COMPUTE[0] += time.thread_time() - t0
        COMPUTE[1] += time.perf_counter() - w0
        return out

    sampler_module.processed_probs = processed_probs


def timed_run(llm: LLM, prompts, params, profile: cProfile.Profile | None = None,
              sync_debug: bool = False) -> dict:
    """One generate call: its seconds, engine steps, process CPU seconds, host seconds (the
    engine thread's CPU time less COMPUTE's), host wall seconds (the call's wall time less
    COMPUTE's: the engine thread's critical path, waits for other threads included), seconds
    waiting for sampled tokens (the executor's collect) and, with sync_debug on a GPU, the
    synchronizing calls torch warned about."""
    engine, steps, wait = llm.engine, [0], [0.0]
    step, collect = engine.step, engine.executor.collect

    def counting_step(*args, **kwargs):
        steps[0] += 1
        return step(*args, **kwargs)

    def timed_collect(tokens):
        t0 = time.perf_counter()
        try:
            return collect(tokens)
        finally:
            wait[0] += time.perf_counter() - t0

    engine.step, engine.executor.collect = counting_step, timed_collect
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if sync_debug:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            if profile is not None:
                profile.enable()
            t0, c0, compute0 = time.perf_counter(), time.process_time(), list(COMPUTE)
            thread0 = time.thread_time()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)
            elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
            host = time.thread_time() - thread0 - (COMPUTE[0] - compute0[0])
            host_wall = elapsed - (COMPUTE[1] - compute0[1])
            if profile is not None:
                profile.disable()
        finally:
            if sync_debug:
                torch.cuda.set_sync_debug_mode("default")
            del engine.step, engine.executor.collect
    if any(len(o.outputs[0].token_ids) != params[0].max_tokens for o in outs):
        raise SystemExit("a request ended early: the runs would not be comparable")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    return {"seconds": elapsed, "steps": steps[0], "cpu": cpu, "host": host,
            "host_wall": host_wall, "wait": wait[0], "syncs": syncs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the tiny 2-layer Llama above")
    ap.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    ap.add_argument("--device", default=None)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--runs", default="plain,half,all")
    ap.add_argument("--skip-forward", action="store_true", help="fixed logits, no model")
    ap.add_argument("--sync-debug", action="store_true",
                    help="a GPU: count torch's synchronizing-call warnings in the last repeat")
    ap.add_argument("--profile", default=None, help="one of the runs: cProfile its last repeat")
    ap.add_argument("--switch-interval-ms", type=float, default=None,
                    help="sys.setswitchinterval: how long the grammar worker may wait for the GIL "
                         "while the engine thread runs Python (Python's default: 5 ms)")
    args = ap.parse_args()
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)

    model = args.model or tiny_model_dir()
    llm = LLM(model, device=args.device, load_format=args.load_format,
              enable_prefix_caching=False, async_scheduling=True, cpu_threads=1,
              max_model_len=args.max_prompt + args.max_tokens + 8)
    vocab = llm.engine.vocab_size
    if args.skip_forward:
        skip_forward(llm, args.num_requests)
    prompts, plain, constrained = workload(args, vocab)
    every = {"plain": 0, "half": 2, "all": 1}  # every k-th request constrained (0 = none)
    runs = {name: [constrained if every[name] and i % every[name] == 0 else plain
                   for i in range(len(prompts))] for name in args.runs.split(",")}
    timed_run(llm, prompts[:4], [constrained] * 4)  # warm-up: compile the schema
    # Each column is its best over the repeats (the least disturbed by other processes: on a
    # shared machine the noise only adds), the runs interleaved so that drifts hit all alike.
    best: dict[str, dict] = {}
    profile = cProfile.Profile() if args.profile else None
    for r in range(args.repeats):
        for name, params in runs.items():
            last = r == args.repeats - 1
            profiled = last and name == args.profile
            got = timed_run(llm, prompts, params, profile if profiled else None,
                            args.sync_debug and last)
            if profiled and name in best:  # cProfile's overhead: not a timing
                best[name]["syncs"] = got["syncs"]
            elif name not in best:
                best[name] = got
            else:
                best[name] = {k: min(v, got[k]) if k not in ("steps", "syncs") else got[k]
                              for k, v in best[name].items()}
    print(f"device {llm.engine.device}, model {args.model or 'tiny 2-layer llama'}, "
          f"{args.num_requests} requests x {args.max_tokens} tokens, best of {args.repeats}")
    print("host ms: the engine thread's CPU time; host wall ms: the step's wall time (both less "
          "the fixed logits' copies and the sampler's tensor ops with --skip-forward); extra: over "
          "plain, per constrained row; wait ms: in the executor's collect (sampled tokens)")
    print("| run | constrained rows | steps | ms per step | extra us | host ms per step "
          "| extra host us | host wall ms per step | extra host wall us | wait ms per step "
          "| CPU ms (all threads) | syncs warned |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    plain = best.get("plain")
    result = {}
    for name, got in best.items():
        n = sum(p is constrained for p in runs[name])
        per = {k: 1e3 * got[k] / got["steps"]
               for k in ("seconds", "host", "host_wall", "wait", "cpu")}

        def extra(k: str, per: dict = per, n: int = n) -> str:
            if plain is None or n == 0:
                return ""
            return f"{(per[k] - 1e3 * plain[k] / plain['steps']) * 1e3 / n:.1f}"

        print(f"| {name} | {n} | {got['steps']} | {per['seconds']:.2f} | {extra('seconds')} "
              f"| {per['host']:.2f} | {extra('host')} | {per['host_wall']:.2f} "
              f"| {extra('host_wall')} | {per['wait']:.2f} | {per['cpu']:.2f} "
              f"| {got['syncs'] if args.sync_debug else ''} |")
        result[name] = per
    print(json.dumps({"device": str(llm.engine.device), "per_step_ms": result,
                      "grammar": type(llm.engine._get_grammar_compiler()).__name__}))
    if profile is not None:
        pstats.Stats(profile).sort_stats("cumulative").print_stats(30)
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
