"""Where does a step's time go? Wall time per engine phase over the offline workload, then the
CUDA kernel time of a few eager decode steps from torch.profiler.

    PYTHONPATH=. python benchmarks/profile_step.py --model-shape qwen3-0.6b [--num-prompts 256]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from tinypaged import LLM, SamplingParams
from tinypaged.bench.offline import SHAPES, sample_requests, shape_dir


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-shape", default="qwen3-0.6b")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--prefill-profile", action="store_true",
                        help="only profile the kernels of one full prefill step")
    parser.add_argument("--mixed-profile", action="store_true",
                        help="time the first steps of the workload and profile one of them")
    args = parser.parse_args()
    cfg = SHAPES[args.model_shape]
    llm = LLM(str(shape_dir(args.model_shape)), load_format="dummy", skip_tokenizer_init=True,
              dtype="bfloat16", max_model_len=2048,
              max_num_batched_tokens=args.max_num_batched_tokens)
    engine = llm.engine
    prompts = sample_requests(args.num_prompts, 100, 1024, cfg["vocab_size"])
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)

    if args.mixed_profile:  # the first steps of the real workload: prefill chunks + decodes
        warm = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        llm.generate([{"prompt_token_ids": [t + 1 for t in p]} for p in prompts[:40]], warm,
                     use_tqdm=False)
        for i, p in enumerate(prompts):
            engine.add_request(f"m{i}", {"prompt_token_ids": p}, params)
        for i in range(12):
            torch.cuda.synchronize()
            start = time.perf_counter()
            if i == 4:
                acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                with torch.profiler.profile(activities=acts) as prof:
                    engine.step(finished_only=True)
                    torch.cuda.synchronize()
            else:
                engine.step(finished_only=True)
                torch.cuda.synchronize()
            s = engine.scheduler
            print(f"step {i}: {1000 * (time.perf_counter() - start):.1f} ms, "
                  f"running {s.num_running}, waiting {s.num_waiting}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12,
                                        max_name_column_width=50))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12,
                                        max_name_column_width=50))
        return

    if args.prefill_profile:
        batch = [{"prompt_token_ids": p[:560]} for p in prompts if len(p) >= 560]
        batch = batch[: args.max_num_batched_tokens // 560]
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        llm.generate([{"prompt_token_ids": [t + 1 for t in b["prompt_token_ids"]]} for b in batch],
                     one, use_tqdm=False)  # warm-up on other tokens: no prefix-cache hits
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            llm.generate(batch, one, use_tqdm=False)
            torch.cuda.synchronize()
        print(f"one prefill step of {560 * len(batch)} tokens: {time.perf_counter() - start:.3f} s")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=16,
                                        max_name_column_width=60))
        return

    phases: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)

    def timed(name, fn):
        def wrapper(*a, **kw):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = fn(*a, **kw)
            torch.cuda.synchronize()
            phases[name] += time.perf_counter() - t
            counts[name] += 1
            return out
        return wrapper

    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    engine.scheduler.update = timed("scheduler.update", engine.scheduler.update)
    engine.sampler.__class__.__call__ = timed("sample", engine.sampler.__class__.__call__)
    runner = engine.runner
    runner.build_step = timed("build_step (host arrays)", runner.build_step)
    execute = runner.execute

    def execute_split(step):
        kind = "decode (graph)" if step.max_query_len == 1 else "mixed/prefill (eager)"
        return timed(kind, execute)(step)

    runner.execute = execute_split
    reqs = [{"prompt_token_ids": p} for p in prompts]
    start = time.perf_counter()
    llm.generate(reqs, params, use_tqdm=False)
    total = time.perf_counter() - start
    print(f"total {total:.2f} s (synchronizing after every phase)")
    print("| phase | calls | total s | ms per call |")
    print("|---|---|---|---|")
    for name, secs in sorted(phases.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {counts[name]} | {secs:.2f} | {1000 * secs / counts[name]:.2f} |")
    print(f"| other (python) | | {total - sum(phases.values()):.2f} | |")

    # Kernel breakdown of eager decode steps at batch 256, context ~ 600.
    runner.execute = execute
    graphs, runner.graphs = runner.graphs, None
    batch = [{"prompt_token_ids": p[:600]} for p in prompts if len(p) >= 600][:128]
    few = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm.generate(batch, few, use_tqdm=False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        llm.generate(batch, few, use_tqdm=False)
    runner.graphs = graphs
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                    max_name_column_width=60))


if __name__ == "__main__":
    main()
