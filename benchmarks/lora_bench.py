"""Multi-LoRA on the GPU: 4 random rank-16 adapters on all seven projections of the Llama-3-8B
shape (random weights, bf16), requests spread over them round-robin; the same runs without LoRA
give the overhead. The workload is the vLLM anchor's (/work/shared/vllm-anchor/vllm_bench.py):

    throughput   256 prompts of 100..1024 random ids, 256 output tokens each, greedy, EOS ignored
    latency      batch 1 and 8, 512-token prompts: decode tok/s per sequence from
                 (t(256 out) - t(1 out)) / 255 (batch 1 runs adapter 0, batch 8 all four)

    PYTHONPATH=. python benchmarks/lora_bench.py [--adapters DIR] [--no-base | --base-only]
                                                 [--check | --check-only | --idle]

`--check` first runs a GPU correctness check of the kernels (Triton vs reference on random
segments, bf16) and of one engine step with CUDA graphs on vs off (its tokens' digest is the
same with TINYPAGED_LORA_OVERLAP=0 and =1); `--check-only` stops after the checks.
`--idle` alone compares base-only decode (no request has an adapter) on an engine with
enable_lora and one without (lora/idle.py: such steps run no LoRA kernel unless
TINYPAGED_LORA_SKIP_IDLE=0): start-up seconds (the capture included), decode tok/s per sequence
at batch 1 and 8, and a digest of the greedy tokens, which must be the same for both. The
adapters are written to DIR (default /tmp/tinypaged-lora-bench) once;
benchmarks/lora_vllm_bench.py reads the same folders. Prints one JSON line per measurement;
writes lora_bench.json under $OUT when set.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import time
from pathlib import Path

import torch

from tinypaged import envs
from tinypaged.bench.compile_watch import CompileWatch
from tinypaged.bench.lora_adapters import write_random_adapter
from tinypaged.bench.model_shapes import SHAPES, shape_dir

SHAPE = "llama3-8b"
NUM_ADAPTERS, RANK = 4, 16


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    """The anchor's workload: n prompts of 100..1024 ids in [1000, vocab - 1000)."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab - 1000) for _ in range(rng.randint(100, 1024))]
            for _ in range(n)]


def adapter_dirs(root: Path) -> list[Path]:
    cfg = SHAPES[SHAPE]
    dirs = []
    for i in range(NUM_ADAPTERS):
        d = root / f"adapter{i}"
        if not (d / "adapter_model.safetensors").is_file():
            write_random_adapter(d, cfg, RANK, seed=i)
        dirs.append(d)
    return dirs


def make_llm(lora: bool):
    from tinypaged import LLM

    extra = dict(enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=RANK) if lora else {}
    return LLM(str(shape_dir(SHAPE)), load_format="dummy", dtype="bfloat16",
               gpu_memory_utilization=0.85, max_model_len=2048, skip_tokenizer_init=True,
               seed=0, **extra)


def lora_requests(dirs: list[Path], n: int):
    from tinypaged import LoRARequest

    return [LoRARequest(f"adapter{i % len(dirs)}", i % len(dirs) + 1, str(dirs[i % len(dirs)]))
            for i in range(n)]


def run(llm, dirs: list[Path] | None) -> list[dict]:
    from tinypaged import SamplingParams

    vocab = SHAPES[SHAPE]["vocab_size"]
    tag = {"engine": "tinypaged", "model": SHAPE,
           "lora": f"{NUM_ADAPTERS}x{RANK}" if dirs else None}
    results = []

    def gen(ps, params, spread=True):
        loras = lora_requests(dirs, len(ps)) if dirs and spread else (
            lora_requests(dirs, 1) * len(ps) if dirs else None)
        return llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False,
                            lora_request=loras)

    sp = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    gen(prompts(8, vocab, seed=1), sp)  # warm-up: compile, capture, load the adapters
    ps = prompts(int(os.environ.get("BENCH_N", 256)), vocab, seed=0)
    with CompileWatch() as watch:  # a kernel compiled in here is a stall inside the figure
        t0 = time.perf_counter()
        outs = gen(ps, sp)
        dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    results.append({**tag, "out_tok": n, "seconds": round(dt, 3), "out_tok_s": round(n / dt, 1),
                    **watch.summary()})
    print(json.dumps(results[-1]), flush=True)

    def timed(ps: list, out_len: int, spread: bool) -> float:
        params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
        t0 = time.perf_counter()
        gen(ps, params, spread)
        return time.perf_counter() - t0

    for batch in (1, 8):
        ps = [(p * 2)[:512] for p in prompts(batch, vocab, seed=2 + batch)]
        for _ in range(2):  # the first pair warms up; the second, with the same prefix cache
            with CompileWatch() as watch:
                times = {n: timed(ps, n, spread=batch > 1) for n in (1, 256)}
        results.append({**tag, "mode": "latency", "batch": batch,
                        "decode_tok_s_per_seq": round(255 / (times[256] - times[1]), 1),
                        **watch.summary()})
        print(json.dumps(results[-1]), flush=True)
    return results


def idle_decode(llm, result: dict) -> None:
    """Base-only decode tok/s per sequence at batch 1 and 8, from (t(128 out) - t(1 out)) / 127,
    into `result`, with the digest of every greedy token generated."""
    from tinypaged import SamplingParams

    vocab, tokens = SHAPES[SHAPE]["vocab_size"], []

    def timed(ps: list, out_len: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        tokens.extend(list(o.outputs[0].token_ids) for o in outs)
        return time.perf_counter() - t0

    for batch in (1, 8):
        ps = [p[:256] for p in prompts(batch, vocab, seed=2 + batch)]
        timed(ps, 8)  # warm-up (and the prefix cache, as in the timed pair)
        with CompileWatch() as watch:
            t1, t128 = timed(ps, 1), timed(ps, 128)
        result[f"decode_tok_s_per_seq_b{batch}"] = round(127 / (t128 - t1), 1)
        result[f"compiles_b{batch}"] = watch.summary()["compiles"]
    result["tokens_sha256"] = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


def run_idle() -> list[dict]:
    """--idle (see the module docstring): a small engine (8 sequences, 256 batched tokens: 4
    decode buckets, 16 piecewise ones) so that both start-ups and runs fit in about a minute."""
    from tinypaged import LLM

    results = []
    for lora in (True, False):
        extra = dict(enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=RANK) if lora else {}
        t0 = time.perf_counter()
        llm = LLM(str(shape_dir(SHAPE)), load_format="dummy", dtype="bfloat16",
                  gpu_memory_utilization=0.85, max_model_len=1024, max_num_seqs=8,
                  max_num_batched_tokens=256, skip_tokenizer_init=True, seed=0, **extra)
        result = {"check": "base-only decode", "model": SHAPE, "enable_lora": lora,
                  "lora_skip_idle": envs.TINYPAGED_LORA_SKIP_IDLE,
                  "startup_s": round(time.perf_counter() - t0, 1)}
        idle_decode(llm, result)
        print(json.dumps(result), flush=True)
        results.append(result)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    same = results[0]["tokens_sha256"] == results[1]["tokens_sha256"]
    print(json.dumps({"check": "base-only tokens, enable_lora on = off", "same": same}), flush=True)
    return results


def check_kernels() -> None:
    """Triton vs the torch references on the GPU, bf16, Llama-3-8B qkv sizes."""
    from tinypaged.kernels.lora_expand import lora_expand_ref, lora_expand_triton
    from tinypaged.kernels.lora_shrink import (
        lora_segments,
        lora_shrink_ref,
        lora_shrink_triton,
        shrink_splits,
    )

    dev, dt = "cuda", torch.bfloat16
    for num_tokens in (1, 8, 300):
        slots = torch.randint(-1, 4, (num_tokens,), dtype=torch.int32)
        meta = [t.to(dev) for t in lora_segments(slots, 4)]
        x = torch.randn(num_tokens, 4096, device=dev, dtype=dt)
        a = torch.randn(4, 48, 4096, device=dev, dtype=dt) / 64
        splits = shrink_splits(num_tokens, 4096)
        h1 = lora_shrink_triton(x, a, *meta, torch.zeros(splits, num_tokens, 48, device=dev))
        h2 = lora_shrink_ref(x, a, *meta, torch.zeros(splits, num_tokens, 48, device=dev))
        torch.testing.assert_close(h1.sum(0), h2.sum(0), atol=2e-2, rtol=2e-2)
        b = torch.randn(4, 6144, 16, device=dev, dtype=dt) / 4
        y = torch.randn(num_tokens, 6144, device=dev, dtype=dt)
        offsets = (0, 4096, 5120, 6144)
        y1 = lora_expand_triton(y.clone(), h2, b, *meta, offsets)
        y2 = lora_expand_ref(y.clone(), h2, b, *meta, offsets)
        torch.testing.assert_close(y1, y2, atol=3e-2, rtol=2e-2)
    print(json.dumps({"check": "lora kernels", "ok": True}), flush=True)


def check_graphs(dirs: list[Path]) -> None:
    """Greedy tokens of 8 requests over 4 adapters + base: CUDA graphs on vs enforce_eager."""
    from tinypaged import LLM, SamplingParams

    outs = {}
    for eager in (False, True):
        llm = LLM(str(shape_dir(SHAPE)), load_format="dummy", dtype="bfloat16",
                  gpu_memory_utilization=0.85, max_model_len=2048, skip_tokenizer_init=True,
                  enable_lora=True, max_loras=NUM_ADAPTERS, enforce_eager=eager, seed=0)
        ps = prompts(10, SHAPES[SHAPE]["vocab_size"], seed=7)
        loras = lora_requests(dirs, 8) + [None, None]
        sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        got = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False,
                           lora_request=loras)
        outs[eager] = [o.outputs[0].token_ids for o in got]
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    same = sum(a == b for a, b in zip(outs[False], outs[True]))
    # the same digest under TINYPAGED_LORA_OVERLAP=0 and =1: the overlap changes no token
    digest = hashlib.sha256(json.dumps([list(t) for t in outs[False]]).encode()).hexdigest()
    print(json.dumps({"check": "graphs vs eager with LoRA", "same_requests": same,
                      "of": len(outs[False]), "tokens_sha256": digest[:16],
                      "lora_overlap": envs.TINYPAGED_LORA_OVERLAP}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adapters", default="/tmp/tinypaged-lora-bench")
    p.add_argument("--no-base", action="store_true", help="skip the runs without LoRA")
    p.add_argument("--base-only", action="store_true", help="only the runs without LoRA")
    p.add_argument("--check", action="store_true", help="GPU correctness checks first")
    p.add_argument("--check-only", action="store_true", help="the checks, no timed runs")
    p.add_argument("--idle", action="store_true",
                   help="only base-only decode with enable_lora on vs off (no adapter written)")
    args = p.parse_args()
    if args.idle:
        results = run_idle()
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "lora_idle.json").write_text(json.dumps(results, indent=1))
        return
    dirs = adapter_dirs(Path(args.adapters))
    results = []
    if args.check or args.check_only:
        check_kernels()
        check_graphs(dirs)
        if args.check_only:
            return
    for lora in (False,) if args.base_only else (True,) if args.no_base else (True, False):
        llm = make_llm(lora)
        results += run(llm, dirs if lora else None)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "lora_bench.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
