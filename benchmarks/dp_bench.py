"""Data parallelism on one GPU (dp/): N engine processes sharing it against one, and the
cache-aware router against round-robin, through the engine client the server uses (DPAsyncLLM,
no HTTP: the GPU machine has no uvicorn). Random weights in a named shape, token ids in and out.

    # DP=2 sharing the GPU against one engine: all requests at once, then Poisson at 64 req/s
    PYTHONPATH=. python benchmarks/dp_bench.py --dp 1 --gpu-memory-utilization 0.45
    PYTHONPATH=. python benchmarks/dp_bench.py --dp 2 --gpu-memory-utilization 0.45
    PYTHONPATH=. python benchmarks/dp_bench.py --dp 1 --gpu-memory-utilization 0.45 --rate 64
    PYTHONPATH=. python benchmarks/dp_bench.py --dp 2 --gpu-memory-utilization 0.45 --rate 64
    # shared long prefixes: 32 system prompts of 2,048 tokens, 1,024 requests
    PYTHONPATH=. python benchmarks/dp_bench.py --dp 2 --workload prefix --routing cache_aware
    PYTHONPATH=. python benchmarks/dp_bench.py --dp 2 --workload prefix --routing round_robin

Workloads (`random.Random(0)`): `random` = --num-prompts prompts of 100..1,024 random ids,
--output-len tokens each; `prefix` = --num-prompts requests, each one of --num-prefixes system
prompts of --prefix-len ids followed by 32 ids of its own, --output-len tokens each. Greedy, EOS
ignored. A warm-up of 8 requests on prompts of their own precedes the timed run. Prints one JSON
line: output tok/s, request/s, TTFT mean / p50 / p99, prompt tokens served by the prefix cache,
and the requests each engine got.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

from tinypaged.bench.model_shapes import SHAPES, shape_dir
from tinypaged.dp.client import DPAsyncLLM
from tinypaged.sampling.params import SamplingParams


def workload(args, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    if args.workload == "random":
        return [[rng.randrange(1000, vocab - 1000) for _ in range(rng.randint(100, 1024))]
                for _ in range(args.num_prompts)]
    systems = [[rng.randrange(1000, vocab - 1000) for _ in range(args.prefix_len)]
               for _ in range(args.num_prefixes)]
    return [rng.choice(systems) + [rng.randrange(1000, vocab - 1000) for _ in range(32)]
            for _ in range(args.num_prompts)]


async def run(engine: DPAsyncLLM, prompts: list[list[int]], params: SamplingParams,
              rate: float, tag: str) -> dict:
    rng = random.Random(1)
    ttft: list[float] = []
    tokens, cached = 0, 0

    async def one(i: int, prompt: list[int], delay: float):
        nonlocal tokens, cached
        await asyncio.sleep(delay)
        start = time.perf_counter()
        first = None
        async for out in engine.generate({"prompt_token_ids": prompt}, params, f"{tag}{i}"):
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter() - start
        ttft.append(first)
        tokens += len(out.outputs[0].token_ids)
        cached += out.num_cached_tokens

    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t)
        if rate != float("inf"):
            t += rng.expovariate(rate)
    start = time.perf_counter()
    await asyncio.gather(*(one(i, p, d) for i, (p, d) in enumerate(zip(prompts, delays))))
    elapsed = time.perf_counter() - start
    ttft.sort()
    return {"elapsed_s": elapsed, "output_tok_s": tokens / elapsed,
            "requests_s": len(prompts) / elapsed, "ttft_mean_s": statistics.mean(ttft),
            "ttft_p50_s": ttft[len(ttft) // 2], "ttft_p99_s": ttft[int(0.99 * (len(ttft) - 1))],
            "cached_prompt_tokens": cached}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-shape", default="qwen3-0.6b",
                   help=f"{', '.join(SHAPES)}, or a model folder (config.json)")
    p.add_argument("--dp", type=int, default=2, help="engines sharing the GPU")
    p.add_argument("--routing", default="cache_aware",
                   choices=["cache_aware", "least_loaded", "round_robin"])
    p.add_argument("--workload", default="random", choices=["random", "prefix"])
    p.add_argument("--num-prompts", type=int, default=None, help="default 512, prefix: 1024")
    p.add_argument("--num-prefixes", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=None, help="default 128, prefix: 32")
    p.add_argument("--rate", type=float, default=float("inf"), help="req/s; inf = all at once")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--device", default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    args = p.parse_args()
    prefix = args.workload == "prefix"
    args.num_prompts = args.num_prompts or (1024 if prefix else 512)
    args.output_len = args.output_len or (32 if prefix else 128)
    if args.model_shape in SHAPES:
        cfg, path = SHAPES[args.model_shape], str(shape_dir(args.model_shape))
    else:
        path = args.model_shape
        cfg = json.loads(open(f"{path}/config.json").read())
    engine = DPAsyncLLM(path, data_parallel_size=args.dp,
                        data_parallel_routing=args.routing, load_format="dummy",
                        skip_tokenizer_init=True, dtype="bfloat16", device=args.device,
                        max_model_len=args.max_model_len or (args.prefix_len + 1024
                                                             + args.output_len),
                        max_num_seqs=args.max_num_seqs,
                        gpu_memory_utilization=args.gpu_memory_utilization)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    prompts = workload(args, cfg["vocab_size"])
    warm_rng = random.Random(2)
    warm = [[warm_rng.randrange(1000, cfg["vocab_size"] - 1000) for _ in range(200)]
            for _ in range(8)]

    async def go():
        await run(engine, warm, params, float("inf"), "warm")
        routed = list(engine.router.routed)
        result = await run(engine, prompts, params, args.rate, "r")
        result["requests_per_engine"] = [a - b for a, b in zip(engine.router.routed, routed)]
        await engine.shutdown()
        return result

    result = {"dp": args.dp, "routing": args.routing, "workload": args.workload,
              "rate": args.rate, "requests": len(prompts), **asyncio.run(go())}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
