"""Where a decode step's GPU time goes at batch 1 vs batch 8: per-kernel microseconds.

    PYTHONPATH=. python benchmarks/decode_profile.py [--model-shape llama3-8b] [--layers 32]
                                                     [--batches 1 8] [--prompt-len 512]

Each batch size: `batch` requests of `prompt-len` random tokens (dummy weights, bf16), one
prefill step, two warm-up decode steps, five decode steps timed as the engine runs them (CUDA
graphs, wall time of `engine.step`), then three decode steps run eagerly under torch.profiler.
Prints one row per kernel name (calls and GPU us per step at each batch size), the kernels' sum
and the graph step's wall time: their difference is what the step spends outside the GPU's
kernels (host work not overlapped, launch gaps). `--layers` below the shape's own count makes
the run cheaper; per-layer kernels then scale by shape layers / layers, the LM head, the
sampler and the host work do not.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from tinypaged import LLM, SamplingParams
from tinypaged.bench.offline import SHAPES, sample_requests, shape_dir

PROFILED_STEPS, TIMED_STEPS = 3, 5


def kernel_times(llm: LLM, batch: int, prompt_len: int,
                 vocab: int) -> tuple[dict[str, list[float]], float]:
    """(kernel name -> [calls per step, GPU us per step] over the profiled eager decode steps,
    wall us of one decode step with CUDA graphs)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for i, prompt in enumerate(sample_requests(batch, prompt_len, prompt_len, vocab, seed=batch)):
        engine.add_request(f"b{batch}-{i}", {"prompt_token_ids": prompt}, params)
    for _ in range(3):  # the prefill, two decode steps
        engine.step(finished_only=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(TIMED_STEPS):
        engine.step(finished_only=True)
    torch.cuda.synchronize()
    step_us = 1e6 * (time.perf_counter() - start) / TIMED_STEPS
    graphs, engine.runner.graphs = engine.runner.graphs, None  # eager: the profiler sees kernels
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(PROFILED_STEPS):
            engine.step(finished_only=True)
        torch.cuda.synchronize()
    engine.runner.graphs = graphs
    while engine.scheduler.has_unfinished():
        engine.step(finished_only=True)
    table: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for event in prof.key_averages():
        if event.device_time_total > 0:
            table[event.key] = [event.count / PROFILED_STEPS,
                                event.device_time_total / PROFILED_STEPS]
    return table, step_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, help="fewer layers than the shape (cheaper)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=512)
    args = parser.parse_args()
    cfg = SHAPES[args.model_shape]
    path = shape_dir(args.model_shape)
    if args.layers:
        config = json.loads((Path(path) / "config.json").read_text())
        config["num_hidden_layers"] = args.layers
        (Path(path) / "config.json").write_text(json.dumps(config))
    layers = args.layers or cfg["num_hidden_layers"]
    llm = LLM(str(path), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=2048, num_kv_blocks=1024, max_num_seqs=max(args.batches))
    results = {b: kernel_times(llm, b, args.prompt_len, cfg["vocab_size"]) for b in args.batches}
    tables = {b: table for b, (table, _) in results.items()}
    names = sorted({n for t in tables.values() for n in t},
                   key=lambda n: -max(t.get(n, [0, 0])[1] for t in tables.values()))
    print(f"{torch.cuda.get_device_name()}, {args.model_shape} shape with {layers} layers, "
          f"prompt {args.prompt_len}, GPU us per decode step (mean of {PROFILED_STEPS})")
    head = " | ".join(f"b{b} calls | b{b} us" for b in args.batches)
    print(f"| kernel | {head} |")
    print("|---|" + "---|" * (2 * len(args.batches)))
    for name in names:
        cells = " | ".join(f"{tables[b].get(name, [0, 0])[0]:.0f} | "
                           f"{tables[b].get(name, [0, 0])[1]:.1f}" for b in args.batches)
        print(f"| {name[:70]} | {cells} |")
    totals = "".join(f" | | {sum(v[1] for v in tables[b].values()):.1f}" for b in args.batches)
    print(f"| total (sum of kernels){totals} |")
    walls = "".join(f" | | {results[b][1]:.1f}" for b in args.batches)
    print(f"| decode step wall time with CUDA graphs (mean of {TIMED_STEPS}){walls} |")


if __name__ == "__main__":
    main()
