"""The custom all-reduce end to end: greedy tokens and decode step time at TP=N, against the same
engine with every all-reduce through NCCL (`disable_custom_all_reduce=True`).

For each engine (custom first, then NCCL; CUDA graphs on):
- greedy tokens (and top-5 logprobs) of a few prompts: the custom sums are NCCL's for 2 ranks
  (one fp32 add, rounded once), so tokens and logprobs should be equal, not just close;
- decode ms per step at batch 1 and at --batch, from two generate calls that differ only in
  the number of output tokens (the difference is pure decode, prefill cancels out);
- how long shutdown() took.
--model: "tiny" (the tests' tiny random llama) or a bench shape such as "llama3-8b" (dummy
weights from a fixed seed: the same in both engines).

    PYTHONPATH=. python benchmarks/all_reduce_e2e.py --tp 2 --model llama3-8b
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import tempfile
import time
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402

from tinypaged import LLM, SamplingParams  # noqa: E402


def greedy(steps: int, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=logprobs)


def decode_ms(llm: LLM, batch: int, prompt_len: int, steps: int, vocab: int) -> float:
    """ms per decode step of `batch` sequences (prefill and the first token cancel out)."""
    rng = random.Random(batch)
    prompts = [{"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(prompt_len)]}
               for _ in range(batch)]
    llm.generate(prompts, greedy(2), use_tqdm=False)  # warm
    times = []
    for n in (1, steps + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, greedy(n), use_tqdm=False)
        times.append(time.perf_counter() - start)
    return (times[1] - times[0]) * 1e3 / steps


def run(path: str, disable: bool, args, engine: dict) -> dict:
    llm = LLM(path, tensor_parallel_size=args.tp, disable_custom_all_reduce=disable, **engine)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(10, args.vocab - 10) for _ in range(n)]}
               for n in (5, 40, 100, 200)]
    outs = llm.generate(prompts, greedy(args.tokens, logprobs=5), use_tqdm=False)
    result = {"tokens": [o.outputs[0].token_ids for o in outs],
              "logprobs": [o.outputs[0].logprobs for o in outs],
              "b1": decode_ms(llm, 1, 128, args.steps, args.vocab),
              "bN": decode_ms(llm, args.batch, 128, args.steps, args.vocab)}
    start = time.perf_counter()
    llm.shutdown()
    result["shutdown"] = time.perf_counter() - start
    print(f"{'NCCL only' if disable else 'custom'}: decode ms/step batch 1 {result['b1']:.2f}, "
          f"batch {args.batch} {result['bN']:.2f}; shutdown {result['shutdown']:.2f} s",
          flush=True)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--model", default="tiny", help="'tiny' or a bench shape (llama3-8b)")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens compared")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed")
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    engine = dict(dtype="bfloat16", skip_tokenizer_init=True, max_num_seqs=args.batch,
                  max_model_len=256 if args.model == "tiny" else 1024)
    if args.model == "tiny":
        from helpers.models import save_tiny

        path = Path(tempfile.mkdtemp())
        save_tiny("llama", path)
        args.vocab = 256
        engine["num_kv_blocks"] = 4096
    else:
        from tinypaged.bench.offline import SHAPES, shape_dir

        path = shape_dir(args.model)
        args.vocab = SHAPES[args.model]["vocab_size"]
        engine.update(load_format="dummy", gpu_memory_utilization=0.85)
    custom = run(str(path), False, args, engine)
    nccl = run(str(path), True, args, engine)
    same_tokens = sum(a == b for a, b in zip(nccl["tokens"], custom["tokens"]))
    same_logprobs = sum(a == b for a, b in zip(nccl["logprobs"], custom["logprobs"]))
    n = len(nccl["tokens"])
    print(f"{args.model}, TP={args.tp}, bf16, CUDA graphs: custom vs NCCL-only greedy tokens equal "
          f"on {same_tokens}/{n} prompts, logprobs equal on {same_logprobs}/{n}")
    print(f"| all-reduce | decode ms/step batch 1 | batch {args.batch} | shutdown s |")
    print("|---|---|---|---|")
    for name, r in (("NCCL only", nccl), ("custom (<= 16 MiB)", custom)):
        print(f"| {name} | {r['b1']:.2f} | {r['bN']:.2f} | {r['shutdown']:.2f} |")


if __name__ == "__main__":
    main()
