"""Host time per engine step: a tiny random Llama on the CPU (torch reference kernels). The model's
forward and logits are timed apart and subtracted, so what is left is the engine's own Python
per step (scheduling, batch building, sampling glue, updates, outputs): the part that stands
between two GPU steps. Times are this thread's CPU time (torch runs on one thread here), which a
busy shared machine disturbs far less than wall time. Decode steps at batch 64 and 256, then
(--profile) one cProfile of the largest batch's steps without the model's functions.

    PYTHONPATH=. python benchmarks/host_profile.py [--batch-sizes 64 256] [--steps 40] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import tempfile
import time
from pathlib import Path

import torch

from tinypaged import LLM, SamplingParams

TINY_LLAMA = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64,
    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=512, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--profile", action="store_true", help="cProfile the largest batch")
    parser.add_argument("--sort", default="tottime", help="cProfile order: tottime | cumtime")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = Path(tempfile.mkdtemp(prefix="tinypaged-host-"))
    (path / "config.json").write_text(json.dumps({**TINY_LLAMA, "torch_dtype": "float32"}))
    extra = {} if args.async_scheduling is None else {"async_scheduling": args.async_scheduling}
    llm = LLM(str(path), load_format="dummy", skip_tokenizer_init=True, dtype="float32",
              max_num_seqs=max(args.batch_sizes), num_kv_blocks=4096, kernels="torch", **extra)
    engine = llm.engine
    model_s = [0.0]
    model = engine.runner.model
    for name in ("forward", "compute_logits"):
        setattr(model, name, _timed(getattr(model, name), model_s))
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
    for batch in args.batch_sizes:
        for i in range(batch):
            engine.add_request(f"{batch}-{i}", {"prompt_token_ids": [3 + i % 100] * 32}, params)
        for _ in range(4):  # prefill, first decodes
            engine.step(finished_only=True)
        profiled = args.profile and batch == max(args.batch_sizes)
        profiler = cProfile.Profile(time.thread_time) if profiled else None
        start, model_s[0] = time.thread_time(), 0.0
        if profiler:
            profiler.enable()
        for _ in range(args.steps):
            engine.step(finished_only=True)
        if profiler:
            profiler.disable()
        per_step = (time.thread_time() - start) / args.steps
        host = per_step - model_s[0] / args.steps
        while engine.has_unfinished_requests():
            engine.step(finished_only=True)
        print(f"batch {batch}: {1000 * host:.2f} ms host per decode step "
              f"({1000 * per_step:.2f} ms with the model)")
        if profiler:
            stats = pstats.Stats(profiler).sort_stats(args.sort)
            stats.print_stats(r"tinypaged/(?!kernels|models)", 30)
    llm.shutdown()


def _timed(fn, total: list[float]):
    def call(*args, **kwargs):
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            total[0] += time.thread_time() - start

    return call


if __name__ == "__main__":
    main()
