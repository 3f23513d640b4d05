"""Async scheduling on one GPU: correctness first, then sync vs async timings, in one process
(each engine is built once and switched between the two modes, to spare start-ups).

1. A tiny random Llama in float32 with CUDA graphs: greedy and seeded tokens, stop token ids and
   max_tokens equal in both modes (no prefix caching, so both runs compute the same batches'
   values from scratch).
2. Offline throughput, Qwen3-0.6B shape (bench's workload, fewer prompts): output tok/s.
3. Decode, Llama-3-8B shape, batch 1 and 64: ms per step and tok/s per sequence.

    PYTHONPATH=. python benchmarks/async_check.py [--num-prompts 128] [--output-len 128]
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch

from tinypaged import LLM, SamplingParams
from tinypaged.bench.offline import SHAPES, sample_requests, shape_dir

TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=128,
            intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=4096, max_position_embeddings=512,
            rms_norm_eps=1e-5, tie_word_embeddings=True, torch_dtype="float32")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def set_mode(llm: LLM, use_async: bool) -> None:
    llm.engine.config.async_scheduling = use_async


def check_tokens() -> str:
    path = Path(tempfile.mkdtemp(prefix="tinypaged-async-"))
    (path / "config.json").write_text(json.dumps(TINY))
    llm = LLM(str(path), load_format="dummy", skip_tokenizer_init=True, dtype="float32",
              enable_prefix_caching=False, max_num_seqs=32, async_scheduling=True)
    ids = sample_requests(24, 5, 60, TINY["vocab_size"], seed=3)
    prompts = [{"prompt_token_ids": p} for p in ids]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + i % 20, ignore_eos=True)
              if i % 3 else
              SamplingParams(temperature=0.8, top_k=50, seed=i, max_tokens=16, ignore_eos=True)
              for i in range(len(prompts))]
    runs = {}
    for use_async in (False, True):
        set_mode(llm, use_async)
        runs[use_async] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason)
                           for o in llm.generate(prompts, params, use_tqdm=False)]
    stops = [SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[toks[2]])
             for toks, _ in runs[False]]
    for use_async in (False, True):
        set_mode(llm, use_async)
        runs["stop", use_async] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason)
                                   for o in llm.generate(prompts, stops, use_tqdm=False)]
    same = runs[False] == runs[True] and runs["stop", False] == runs["stop", True]
    del llm
    gc.collect()
    if not same:
        raise SystemExit("FAIL: async scheduling changed the tokens on cuda")
    return "sync == async tokens (greedy, seeded, stop ids, max_tokens): OK"


def throughput(num_prompts: int, output_len: int) -> dict[bool, float]:
    cfg = SHAPES["qwen3-0.6b"]
    llm = LLM(str(shape_dir("qwen3-0.6b")), load_format="dummy", skip_tokenizer_init=True,
              dtype="bfloat16", max_model_len=2048, max_num_batched_tokens=16384,
              enable_prefix_caching=False, gpu_memory_utilization=0.4, async_scheduling=True)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    warm = sample_requests(16, 100, 1024, cfg["vocab_size"], seed=1)
    llm.generate([{"prompt_token_ids": p} for p in warm], params, use_tqdm=False)
    prompts = [{"prompt_token_ids": p}
               for p in sample_requests(num_prompts, 100, 1024, cfg["vocab_size"])]
    result = {}
    for use_async in (False, True, False, True):  # twice each, the best counts
        set_mode(llm, use_async)
        sync()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        sync()
        tok_s = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
        result[use_async] = max(result.get(use_async, 0.0), tok_s)
    del llm, outs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def decode(batch_sizes: list[int], steps: int) -> dict:
    cfg = SHAPES["llama3-8b"]
    llm = LLM(str(shape_dir("llama3-8b")), load_format="dummy", skip_tokenizer_init=True,
              dtype="bfloat16", max_model_len=1024, max_num_seqs=max(batch_sizes),
              gpu_memory_utilization=0.5, async_scheduling=True)  # fits beside the above
    engine = llm.engine
    result = {}
    for batch in batch_sizes:
        for use_async in (False, True):
            set_mode(llm, use_async)
            params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
            prompts = sample_requests(batch, 512, 512, cfg["vocab_size"], seed=batch)
            for i, p in enumerate(prompts):
                engine.add_request(f"{batch}-{use_async}-{i}", {"prompt_token_ids": p}, params)
            for _ in range(3):  # the prefill and the first decodes
                engine.step(finished_only=True)
            sync()
            start = time.perf_counter()
            for _ in range(steps - 4):
                engine.step(finished_only=True)
            sync()
            per_step = (time.perf_counter() - start) / (steps - 4)
            while engine.has_unfinished_requests():
                engine.step(finished_only=True)
            result[batch, use_async] = per_step
    del llm, engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    args = parser.parse_args()
    print(check_tokens(), flush=True)
    tput = throughput(args.num_prompts, args.output_len)
    lat = decode(args.batch_sizes, args.decode_steps)
    print(f"\n| workload ({torch.cuda.get_device_name()}) | sync | async | async/sync |")
    print("|---|---|---|---|")
    print(f"| offline Qwen3-0.6B shape, {args.num_prompts} prompts x {args.output_len} out, "
          f"tok/s | {tput[False]:,.0f} | {tput[True]:,.0f} | {tput[True] / tput[False]:.3f}x |")
    for batch in args.batch_sizes:
        s, a = lat[batch, False], lat[batch, True]
        print(f"| decode Llama-3-8B shape, batch {batch}, ms/step (tok/s per seq) | "
              f"{1000 * s:.2f} ({1 / s:,.1f}) | {1000 * a:.2f} ({1 / a:,.1f}) | {s / a:.3f}x |")


if __name__ == "__main__":
    main()
