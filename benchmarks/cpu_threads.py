"""tok/s of examples/offline_batch.py's workload on the CPU for several torch thread counts.

    PYTHONPATH=. python benchmarks/cpu_threads.py --threads 2 1 --rounds 3

The 4 prompts of examples/offline_batch.py, 32 sampled tokens each (EOS ignored, so every run
makes 128 tokens), on the default model. One engine; before each timed batch torch's intra-op
threads are set to the next count of --threads, round-robin, so that the counts share the
machine's load over the run (on a shared machine the load moves by the second). Prints each
count's tok/s per round and its median. Torch's default on this machine is the "before" of
issue 36 (its count of cores); the engine's default now is the usable cores minus one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from tinypaged import LLM, SamplingParams

PROMPTS = ["The capital of France is", "The three primary colors are",
           "A good name for a pet cat is", "def fibonacci(n):"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads(), 1])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    llm = LLM(device="cpu")
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=0, ignore_eos=True)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    rates: dict[int, list[float]] = {n: [] for n in args.threads}
    for _ in range(args.rounds):
        for n in args.threads:
            torch.set_num_threads(n)
            start = time.perf_counter()
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            rates[n].append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
            print(f"threads {n}: {rates[n][-1]:.1f} tok/s", flush=True)
    print(f"usable cores {len(os.sched_getaffinity(0))}, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for n, r in rates.items():
        print(f"threads {n}: median {statistics.median(r):.1f} tok/s  "
              f"({', '.join(f'{x:.1f}' for x in r)})")


if __name__ == "__main__":
    main()
