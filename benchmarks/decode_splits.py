"""Split-KV decode at large batches of uneven contexts: kernel, then the offline workload.

    PYTHONPATH=. python benchmarks/decode_splits.py [--model-shape qwen3-0.6b] [--splits 1 2 4]
        [--num-prompts 256] [--kernels-only]

1. The decode kernel (through `paged_attention`) on the contexts of the offline workload's
   decode phase (prompt 100-1024 plus 0-255 generated tokens), batch 256 and 96, the shape's
   heads, at each split count: us and % of copy bandwidth for the K/V bytes.
2. The offline workload on one engine per split count (the count forced while the engine
   captures its decode graphs, where the split count is fixed; none forced = the engine's
   default, attention_decode.decode_num_splits), one run each, prompts shifted per engine.
   (Round 3 of 2026-12-01 ran a floor of 4 splits as the default: see RESULTS.md.)
"""

from __future__ import annotations

import argparse
import time

import torch
from kernels import PagedBatch
from triton.testing import do_bench

from tinypaged import LLM, SamplingParams
from tinypaged.bench.offline import COPY_BW, SHAPES, sample_requests, shape_dir, warmup_requests
from tinypaged.kernels import attention
from tinypaged.kernels.attention import paged_attention


def time_kernel(cfg: dict, splits: list[int]) -> None:
    nq, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    lens = [len(p) for p in sample_requests(256, 100, 1024, cfg["vocab_size"])]
    ctx = [n + (i * 37) % 256 for i, n in enumerate(lens)]
    for batch_size in (256, 96):
        seq_lens = ctx[:batch_size]
        batch = PagedBatch([1] * batch_size, seq_lens, nq, nkv, hd, torch.bfloat16)
        kv_bytes = 2 * sum(seq_lens) * nkv * hd * 2
        ref = batch.call(paged_attention, num_splits=1).float()
        cells = []
        for n in splits:
            diff = (batch.call(paged_attention, num_splits=n).float() - ref).abs().max().item()
            us = 1e3 * do_bench(lambda b=batch, n=n: b.call(paged_attention, num_splits=n))
            cells.append(f"{n}: {us:.1f} us {100 * kv_bytes / us * 1e6 / COPY_BW:.0f}% "
                         f"(diff {diff:.1e})")
        print(f"decode B{batch_size}, splits: " + "; ".join(cells), flush=True)


def end_to_end(args, cfg: dict) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    prompts = sample_requests(args.num_prompts, 100, 1024, cfg["vocab_size"])
    default = attention.decode_num_splits
    for i, n in enumerate([None, *args.splits]):
        if n is not None:
            attention.decode_num_splits = lambda *a, n=n: n
        try:
            llm = LLM(str(shape_dir(args.model_shape)), load_format="dummy",
                      skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048, seed=0,
                      max_num_batched_tokens=16384, max_num_seqs=256,
                      num_kv_blocks=args.num_prompts * 1280 // 16 + 1024)
        finally:
            attention.decode_num_splits = default
        llm.generate([{"prompt_token_ids": p} for p in warmup_requests(100, 1024,
                     cfg["vocab_size"])], params, use_tqdm=False)
        reqs = [{"prompt_token_ids": [t + i for t in p]} for p in prompts]
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(reqs, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tok_s = sum(len(o.outputs[0].token_ids) for o in outs) / elapsed
        name = "engine default" if n is None else f"{n} splits"
        print(f"{args.model_shape}, {args.num_prompts} prompts, decode graphs with {name}: "
              f"{tok_s:,.0f} output tok/s ({elapsed:.2f} s)", flush=True)
        llm.shutdown()
        del llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--kernels-only", action="store_true")
    parser.add_argument("--e2e-only", action="store_true")
    args = parser.parse_args()
    cfg = SHAPES[args.model_shape]
    print(f"{torch.cuda.get_device_name()}, {args.model_shape} shape", flush=True)
    if not args.e2e_only:
        time_kernel(cfg, args.splits)
    if not args.kernels_only:
        end_to_end(args, cfg)


if __name__ == "__main__":
    main()
