"""Where a tensor-parallel step spends its time, seen from rank 0: the torch profiler over a few
prefill and decode steps of the Llama-3-8B shape (bf16, dummy weights), printed as tables.

Phases (each after warm-up, on a fresh batch):
    prefill   --batch prompts of --prompt-len tokens: the first --steps steps (chunked prefill)
    decode    the same batch once every prompt is in: --steps decode steps (CUDA graphs)
    batch-1   one sequence decoding: --steps steps
For each phase: wall time per step without the profiler; with it, the GPU's busy share of the
profiled span (the rest are gaps where the GPU waits for the CPU), the kernels grouped by kind
(GEMM, attention, all-reduce, all-gather, norm/rotary/activation, copies) per step, and the top
kernels. An NCCL kernel's time on rank 0 includes waiting for the slowest rank, so all-reduce
time is latency + skew + transfer. A chrome trace per phase is written to --trace-dir.

    PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        python benchmarks/tp_profile.py --tp 2 --trace-dir $OUT
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from tinypaged import LLM, SamplingParams  # noqa: E402
from tinypaged.bench.offline import SHAPES, shape_dir  # noqa: E402

KINDS = [  # (kind, substrings of kernel names), first match wins
    ("all-reduce", ("allreduce", "all_reduce")),
    ("all-gather", ("allgather", "all_gather")),
    ("nccl other", ("nccl",)),
    ("attention", ("attention", "attn", "flash", "decode_split", "decode_merge")),
    ("GEMM", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "matmul")),
    ("norm/rotary/silu/kv", ("norm", "rotary", "silu", "store_kv")),
    ("copy/elementwise", ("memcpy", "memset", "copy", "fill", "elementwise", "index", "gather",
                          "scatter", "cat", "reduce")),
]


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def busy_share(events) -> tuple[float, float]:
    """(GPU busy ms, profiled span ms) from the kernels' [start, end) intervals."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    if not spans:
        return 0.0, 0.0
    busy, (cur_start, cur_end) = 0.0, spans[0]
    for start, end in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    return busy / 1e3, (spans[-1][1] - spans[0][0]) / 1e3


def report(name: str, prof, steps: int, wall_ms: float, trace_dir: Path | None) -> None:
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy, span = busy_share(kernels)
    print(f"\n## {name}: {wall_ms:.2f} ms per step without the profiler; GPU busy "
          f"{busy / steps:.2f} ms per step = {100 * busy / max(span, 1e-9):.0f}% of the "
          f"profiled span ({span / steps:.2f} ms per step)")
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in kernels:
        us = e.time_range.end - e.time_range.start
        for table, key in ((by_kind, kind_of(e.name)), (by_name, e.name)):
            table[key][0] += us
            table[key][1] += 1
    print("| kind | ms per step | share of busy | kernels per step |")
    print("|---|---|---|---|")
    for kind, (us, n) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
        print(f"| {kind} | {us / 1e3 / steps:.3f} | {100 * us / 1e3 / max(busy, 1e-9):.1f}% | "
              f"{n / steps:.0f} |")
    print("| top kernels | ms per step | calls per step | mean us |")
    print("|---|---|---|---|")
    for kname, (us, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:12]:
        print(f"| {kname[:90]} | {us / 1e3 / steps:.3f} | {n / steps:.0f} | {us / n:.1f} |")
    if trace_dir is not None:
        prof.export_chrome_trace(str(trace_dir / f"tp_profile_{name}.json"))


def profiled_steps(llm: LLM, steps: int, name: str, trace_dir: Path | None) -> None:
    """Time `steps` steps, then profile `steps` more, and print the tables."""
    engine = llm.engine
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    report(name, prof, steps, wall_ms, trace_dir)


def submit(llm: LLM, prompts: list[list[int]], max_tokens: int, tag: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        llm.engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params)


def prefilling(llm: LLM) -> bool:
    return any(s.is_prefill for r in llm.engine.requests.values() for s in r.seqs)


def drain(llm: LLM) -> None:
    for request_id in list(llm.engine.requests):
        llm.engine.abort_request(request_id)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--model-shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--trace-dir", type=Path, default=None)
    args = parser.parse_args()
    if args.trace_dir is not None:
        args.trace_dir.mkdir(parents=True, exist_ok=True)
    vocab = SHAPES[args.model_shape]["vocab_size"]
    rng = random.Random(0)

    def prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(1000, vocab - 1000) for _ in range(args.prompt_len)]
                for _ in range(n)]

    llm = LLM(str(shape_dir(args.model_shape)), load_format="dummy", skip_tokenizer_init=True,
              dtype="bfloat16", tensor_parallel_size=args.tp, max_model_len=2048,
              max_num_seqs=args.batch, enforce_eager=args.enforce_eager)
    try:
        print(f"{args.model_shape}, TP={args.tp}, batch {args.batch} x {args.prompt_len} prompt "
              f"tokens, {args.steps} steps per phase, CUDA graphs {not args.enforce_eager}")
        submit(llm, prompts(8), 16, "warm-up")  # compile, capture and settle first
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        submit(llm, prompts(args.batch), 2048 - args.prompt_len, "batch")
        profiled_steps(llm, args.steps, "prefill", args.trace_dir)
        while prefilling(llm):
            llm.engine.step()
        profiled_steps(llm, args.steps, "decode", args.trace_dir)
        drain(llm)
        submit(llm, prompts(1), 2048 - args.prompt_len, "one")
        while prefilling(llm):
            llm.engine.step()
        profiled_steps(llm, args.steps, "batch-1", args.trace_dir)
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
