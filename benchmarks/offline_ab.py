"""A/B of engine changes on the offline workload, in one process: the same engine runs the whole
workload once per variant, in turn (A B B A for two variants and two runs), so that both
variants see the same GPU, clocks and host.

    PYTHONPATH=. python benchmarks/offline_ab.py [--model-shape llama3-8b] [--runs 2]

The workload and settings are the vLLM anchor kit's (256 prompts of 100-1024 random tokens, 256
greedy output tokens, EOS ignored, 16,384 batched tokens, 256 sequences, max_model_len 2048,
gpu_memory_utilization 0.85, warm-up on 8 prompts of seed 1), with prefix caching off: every run
computes the same prompts in full (with it on, runs after the first would hit their blocks in
the cache). A variant is a context manager
that puts the engine in that state: "branch" is the code as it is; each other variant
monkeypatches back what main did before this branch's changes (VARIANTS). The decode CUDA
graphs are captured again at a switch that changes their code (a graph keeps the kernels it was
captured with).
Different GEMM kernels round differently, so greedy tokens may part after a near-tie. Each run
goes through offline_steps.StepTimeline; the table gives output tok/s per run and, per variant,
the GPU ms of the phases (mixed steps, full-batch decode steps) and the idle between steps.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import time
from collections.abc import Callable, Iterator
from unittest import mock

import torch

from benchmarks.offline_steps import StepTimeline
from tinypaged import LLM, SamplingParams
from tinypaged.bench.offline import SHAPES, sample_requests, shape_dir, warmup_requests
from tinypaged.models import layers


def recapture(llm: LLM) -> None:
    """Capture the decode graphs again with the kernels the code now calls."""
    from tinypaged.worker.cuda_graphs import DecodeGraphs

    runner = llm.engine.runner
    if runner.graphs is None:  # eager (CPU, enforce_eager): nothing captured
        return
    runner.graphs = None
    gc.collect()
    torch.cuda.synchronize()
    with runner.kernels:
        runner.graphs = DecodeGraphs(runner)


@contextlib.contextmanager
def branch(llm: LLM) -> Iterator[None]:
    yield


@contextlib.contextmanager
def main_logits(llm: LLM) -> Iterator[None]:
    """The LM head upcasting its logits to float32, as on main."""
    forward = layers.ParallelLMHead.forward
    with mock.patch.object(layers.ParallelLMHead, "forward",
                           lambda self, hidden: forward(self, hidden).float()):
        yield


@contextlib.contextmanager
def main(llm: LLM) -> Iterator[None]:
    """This branch's changes reverted."""
    with main_logits(llm):
        yield


VARIANTS: dict[str, Callable[[LLM], contextlib.AbstractContextManager]] = {
    "main": main, "branch": branch, "main-logits": main_logits,
}
# Variants whose code runs inside the decode graphs.
IN_GRAPHS = {"main", "main-logits"}


def schedule(variants: list[str], runs: int) -> list[str]:
    """The order of the runs: A B B A A B ... for two variants (each sees early and late GPU
    states alike), round-robin for more."""
    if len(variants) != 2:
        return variants * runs
    return [variants[(i + 1) // 2 % 2] for i in range(2 * runs)]


def run_ab() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--variants", nargs="+", default=["main", "branch"],
                        choices=list(VARIANTS))
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args()
    t0 = time.perf_counter()
    cfg = SHAPES[args.model_shape]
    llm = LLM(str(shape_dir(args.model_shape)), load_format="dummy", skip_tokenizer_init=True,
              dtype="bfloat16", max_model_len=2048, seed=0, max_num_batched_tokens=16384,
              max_num_seqs=256, gpu_memory_utilization=0.85, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)

    def gen(prompts):
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    gen(warmup_requests(100, 1024, cfg["vocab_size"]))
    prompts = sample_requests(args.num_prompts, 100, 1024, cfg["vocab_size"])
    print(f"[{time.perf_counter() - t0:5.1f} s] {args.model_shape} engine up and warmed up",
          flush=True)
    results: dict[str, list[dict]] = {name: [] for name in args.variants}
    tokens: dict[str, list[list[int]]] = {}
    with contextlib.ExitStack() as state:
        current = "branch"
        for i, name in enumerate(schedule(args.variants, args.runs)):
            if name != current:  # leave the old state, enter the new one, capture again
                state.close()
                state.enter_context(VARIANTS[name](llm))
                if {name, current} & IN_GRAPHS:
                    recapture(llm)
                current = name
            timeline = StepTimeline(llm)
            timeline.begin()
            outs = gen(prompts)
            timeline.finish()
            timeline.undo()
            r = timeline.summary()
            r["output_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / r["wall_ms"] * 1e3
            results[name].append(r)
            tokens.setdefault(name, [o.outputs[0].token_ids for o in outs])
            print(f"[{time.perf_counter() - t0:5.1f} s] run {i + 1} {name}: "
                  f"{r['output_tok_s']:,.0f} output tok/s ({r['wall_ms']:.0f} ms)", flush=True)
    base = args.variants[0]
    same = {n: sum(a == b for a, b in zip(tokens[base], tokens[n])) for n in args.variants}
    print(f"| variant | output tok/s per run | mean | vs {base} | mixed GPU ms | decode full "
          f"GPU ms/step | idle between steps ms | sequences with {base}'s tokens |")
    print("|---|---|---|---|---|---|---|---|")
    mean = {n: sum(r["output_tok_s"] for r in rs) / len(rs) for n, rs in results.items()}
    for name, rs in results.items():
        ph = rs[-1]["phases"]
        mixed = sum(p["gpu_ms"] for k, p in ph.items() if k in ("first step", "mixed"))
        full = ph.get("decode, full batch", {"gpu_ms": 0.0, "steps": 1})
        idle = sum(p["idle_ms"] for p in ph.values())
        runs = " / ".join(f"{r['output_tok_s']:,.0f}" for r in rs)
        print(f"| {name} | {runs} | "
              f"{mean[name]:,.0f} | {mean[name] / mean[base]:.3f}x | {mixed:.0f} | "
              f"{full['gpu_ms'] / full['steps']:.2f} | {idle:.0f} | {same[name]}/{len(prompts)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)
    llm.shutdown()


if __name__ == "__main__":
    run_ab()
