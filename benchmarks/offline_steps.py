"""Step by step, where an offline run's wall time goes: the GPU's work of each step, the GPU
idle before it (waiting for the host to queue it), and what the host did meanwhile.

    PYTHONPATH=. python benchmarks/offline_steps.py --model-shape llama3-8b [--num-prompts 256]

`StepTimeline(llm)` wraps the engine's scheduler, the runner's build_step / execute /
keep_sampled, the sampler and the executor's collect, without changing what they do:

- on the GPU, three CUDA events per step, queued in stream order: A before the step's inputs
  are copied, B after the forward (logits), C after sampling and the sampled ids' copy. So
  A_i -> C_i is step i's GPU time and C_{i-1} -> A_i the GPU idle before it (nothing else is
  queued in between: a non-zero gap is the GPU waiting for the host to launch step i);
- on the host, perf_counter around schedule, build_step, the launch (execute: the model's
  kernels queued, or a graph replayed), sampling, and collect (the host waiting for a step's
  tokens: time the GPU was ahead).

Steps are put in phases: the first step, steps with prompt tokens ("mixed"), pure-decode steps
at the run's largest decode batch ("decode, full batch"), and smaller decode batches ("decode,
tail": the batch draining at the end; "decode, early" before the last prompt is in). The events
cost a few microseconds of host time per step; the printed wall is that of the instrumented run.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np
import torch

from tinypaged import LLM, SamplingParams

HOST_PARTS = ("schedule", "build", "launch", "sample", "collect", "step")


class StepTimeline:
    """Records one run's steps; `summary()` after the run (it synchronizes)."""

    def __init__(self, llm: LLM) -> None:
        engine = llm.engine
        runner, ex = engine.runner, engine.executor
        self.steps: list[dict] = []
        wrapped = [(engine.scheduler, "schedule"), (runner, "build_step"), (runner, "execute"),
                   (runner, "keep_sampled"), (engine, "sampler"), (ex, "collect"),
                   (engine, "step")]
        self._saved = [(obj, name, getattr(obj, name)) for obj, name in wrapped]
        orig = {name: fn for _, name, fn in self._saved}
        self.host: dict[str, float] = defaultdict(float)  # current step's host seconds
        self.start = self.end = None

        def timed(part: str, fn):
            def call(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.host[part] += time.perf_counter() - t0
            return call

        def execute(step):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            t0 = time.perf_counter()
            logits = orig["execute"](step)
            self.host["launch"] += time.perf_counter() - t0
            b.record()
            q_lens = np.diff(step.query_start_loc)
            self.steps.append({"kind": "decode" if step.max_query_len == 1 else "mixed",
                               "seqs": len(q_lens), "tokens": int(q_lens.sum()),
                               "A": a, "B": b, "C": None, "host": None})
            return logits

        def keep_sampled(sampled):
            out = orig["keep_sampled"](sampled)
            c = torch.cuda.Event(enable_timing=True)
            c.record()
            if self.steps and self.steps[-1]["C"] is None:
                self.steps[-1]["C"] = c
            return out

        def step(*args, **kwargs):
            # Host time of one engine.step() call: it launches step i and processes step i-1.
            self.host.clear()
            t0 = time.perf_counter()
            outs = orig["step"](*args, **kwargs)
            self.host["step"] = time.perf_counter() - t0
            if self.steps and self.steps[-1]["host"] is None:
                self.steps[-1]["host"] = dict(self.host)
            return outs

        engine.scheduler.schedule = timed("schedule", orig["schedule"])
        runner.build_step = timed("build", orig["build_step"])
        runner.execute = execute
        runner.keep_sampled = keep_sampled
        engine.sampler = timed("sample", orig["sampler"])
        ex.collect = timed("collect", orig["collect"])
        engine.step = step

    def begin(self) -> None:
        self.start = torch.cuda.Event(enable_timing=True)
        self.start.record()
        self.t0 = time.perf_counter()

    def finish(self) -> None:
        self.end = torch.cuda.Event(enable_timing=True)
        self.end.record()
        torch.cuda.synchronize()
        self.wall_ms = 1e3 * (time.perf_counter() - self.t0)

    def undo(self) -> None:
        for obj, name, fn in self._saved:
            setattr(obj, name, fn)

    def summary(self) -> dict:
        """Per phase: steps, GPU ms (A -> C), idle ms before the steps, mean host ms per part."""
        steps = [s for s in self.steps if s["C"] is not None]
        last_mixed = max((i for i, s in enumerate(steps) if s["kind"] == "mixed"), default=-1)
        full = max((s["seqs"] for s in steps if s["kind"] == "decode"), default=0)
        phases: dict[str, dict] = {}
        prev = self.start
        for i, s in enumerate(steps):
            if i == 0:
                phase = "first step"
            elif s["kind"] == "mixed":
                phase = "mixed"
            elif s["seqs"] == full:
                phase = "decode, full batch"
            else:
                phase = "decode, tail" if i > last_mixed else "decode, early"
            p = phases.setdefault(phase, {"steps": 0, "gpu_ms": 0.0, "fwd_ms": 0.0,
                                          "idle_ms": 0.0, "seqs": 0, "tokens": 0,
                                          "host_ms": defaultdict(float)})
            p["steps"] += 1
            p["seqs"] += s["seqs"]
            p["tokens"] += s["tokens"]
            p["idle_ms"] += prev.elapsed_time(s["A"])
            p["fwd_ms"] += s["A"].elapsed_time(s["B"])
            p["gpu_ms"] += s["A"].elapsed_time(s["C"])
            for part, sec in (s["host"] or {}).items():
                p["host_ms"][part] += 1e3 * sec
            prev = s["C"]
        tail_ms = prev.elapsed_time(self.end) if steps else 0.0
        gpu_wall_ms = self.start.elapsed_time(self.end)
        return {"wall_ms": self.wall_ms, "gpu_wall_ms": gpu_wall_ms, "after_last_ms": tail_ms,
                "phases": {k: {**v, "host_ms": dict(v["host_ms"])} for k, v in phases.items()}}


def print_summary(r: dict) -> None:
    print(f"| phase | steps | seqs/step | tokens/step | GPU ms (fwd) | GPU ms/step | idle ms "
          f"| host ms/step: {' / '.join(HOST_PARTS)} |")
    print("|---|---|---|---|---|---|---|---|")
    for name, p in r["phases"].items():
        n = p["steps"]
        host = " / ".join(f"{p['host_ms'].get(k, 0.0) / n:.2f}" for k in HOST_PARTS)
        print(f"| {name} | {n} | {p['seqs'] / n:.0f} | {p['tokens'] / n:.0f} | "
              f"{p['gpu_ms']:.1f} ({p['fwd_ms']:.1f}) | {p['gpu_ms'] / n:.2f} | "
              f"{p['idle_ms']:.1f} | {host} |")
    idle = sum(p["idle_ms"] for p in r["phases"].values())
    gpu = sum(p["gpu_ms"] for p in r["phases"].values())
    print(f"host wall {r['wall_ms']:.0f} ms; GPU stream span {r['gpu_wall_ms']:.0f} ms = steps "
          f"{gpu:.0f} + idle before steps {idle:.0f} (the first step's includes add_request) + "
          f"after the last step {r['after_last_ms']:.1f}")


def main() -> None:
    from tinypaged.bench.offline import SHAPES, sample_requests, shape_dir, warmup_requests

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    args = parser.parse_args()
    cfg = SHAPES[args.model_shape]
    llm = LLM(str(shape_dir(args.model_shape)), load_format="dummy", skip_tokenizer_init=True,
              dtype="bfloat16", max_model_len=2048, seed=0, max_num_batched_tokens=16384,
              max_num_seqs=256, gpu_memory_utilization=0.85)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in warmup_requests(100, 1024, cfg["vocab_size"])],
                 params, use_tqdm=False)
    prompts = sample_requests(args.num_prompts, 100, 1024, cfg["vocab_size"])
    timeline = StepTimeline(llm)
    timeline.begin()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    timeline.finish()
    timeline.undo()
    r = timeline.summary()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{args.model_shape}: {tokens / r['wall_ms'] * 1e3:,.0f} output tok/s")
    print_summary(r)
    llm.shutdown()


if __name__ == "__main__":
    main()
