"""KV-cache blocks of 16 vs 64 tokens on one GPU: the attention kernels on the offline workload's
batches, then the offline workload end to end.

    PYTHONPATH=. python benchmarks/block_size_ab.py [--model-shape llama3-8b] [--num-prompts 256]
        [--repeats 1] [--kernels-only]

With 64-token blocks each 64-key tile of the Hopper prefill kernel lies in one block, so K/V
come by TMA (attention_hopper.py); with 16 its rows are gathered from four blocks. Decode reads
the same bytes either way. What a larger block costs elsewhere: a sequence wastes half a block
on average (32 tokens instead of 8) and prefix caching shares whole blocks only.

1. Kernels, through `paged_attention` as the engine calls it, the shape's heads, bf16: a decode
   step of 256 sequences with the workload's decode-phase contexts (prompt 100-1024 plus 0-255
   generated tokens), and the workload's first step (16,384 prompt tokens, the last prompt
   chunked) and a mixed step (the same prompts plus 200 decodes). The outputs of the two block
   sizes are compared (the same math: they should agree to bf16 rounding), then timed with
   do_bench.
2. End to end (unless --kernels-only): two engines, block_size 16 and 64, with the same number
   of KV tokens (no preemption in either), each warmed up; the greedy tokens of 4 prompts are
   compared, then the workload runs on each engine in turn, `--repeats` times (run r shifts every
   token id by r, so no run hits the prefix cache of an earlier one).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from kernels import PagedBatch
from triton.testing import do_bench

from tinypaged import LLM, SamplingParams
from tinypaged.bench.offline import COPY_BW, SHAPES, sample_requests, shape_dir, warmup_requests
from tinypaged.config import EngineConfig
from tinypaged.kernels.attention import paged_attention

BLOCK_SIZES = (16, 64)
BUDGET = 16384  # max_num_batched_tokens of the anchor workload


def kernel_batches(cfg: dict) -> dict[str, tuple[list[int], list[int]]]:
    """name -> (q_lens, seq_lens) of three steps of the workload."""
    lens = [len(p) for p in sample_requests(256, 100, 1024, cfg["vocab_size"])]
    decode_ctx = [n + (i * 37) % 256 for i, n in enumerate(lens)]  # 0-255 tokens generated

    def prompts_within(budget: int) -> list[int]:  # whole prompts, the last one chunked
        chunks: list[int] = []
        while budget > 0:
            chunks.append(min(lens[len(chunks)], budget))
            budget -= chunks[-1]
        return chunks

    prefill = prompts_within(BUDGET)
    decodes = decode_ctx[:200]
    mixed = prompts_within(BUDGET - len(decodes))
    return {
        "decode B256": ([1] * 256, decode_ctx),
        "first step, 16k prompt tokens": (prefill, prefill),
        "mixed, 200 decodes + 16k prompt": ([1] * len(decodes) + mixed, decodes + mixed),
    }


def time_kernels(cfg: dict, report: dict) -> None:
    nq, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    print("| step | block 16 us | block 64 us | 64 / 16 | achieved (16 / 64) | max |diff| |")
    print("|---|---|---|---|---|---|")
    for name, (q_lens, seq_lens) in kernel_batches(cfg).items():
        outs, us = [], []
        for bs in BLOCK_SIZES:
            batch = PagedBatch(q_lens, seq_lens, nq, nkv, hd, torch.bfloat16, block_size=bs)
            _same_values(batch, seq_lens, bs)
            outs.append(batch.call(paged_attention).float())
            us.append(1e3 * do_bench(lambda b=batch: b.call(paged_attention)))
        diff = (outs[0] - outs[1]).abs().max().item()
        if max(q_lens) == 1:  # bandwidth: every K/V row once
            kv_bytes = 2 * sum(seq_lens) * nkv * hd * 2
            achieved = " / ".join(f"{kv_bytes / u / 1e3:,.0f}" for u in us)
            achieved += f" GB/s ({100 * kv_bytes / us[1] * 1e6 / COPY_BW:.0f}% of copy)"
        else:  # compute: the causal pairs
            pairs = sum(q * (s - q) + q * (q + 1) / 2 for q, s in zip(q_lens, seq_lens))
            flops = 4 * nq * hd * pairs
            achieved = " / ".join(f"{flops / u / 1e6:,.0f}" for u in us) + " TFLOP/s"
        print(f"| {name} | {us[0]:.1f} | {us[1]:.1f} | {us[1] / us[0]:.3f} | {achieved} | "
              f"{diff:.2e} |")
        report[name] = {"us": us, "max_abs_diff": diff}
    _time_decode_splits(cfg, kernel_batches(cfg)["decode B256"][1], report)


def _time_decode_splits(cfg: dict, seq_lens: list[int], report: dict) -> None:
    """The decode step at fixed split counts: at batch 256 the default is one split, so each
    program streams a whole context of 100-1280 tokens and the longest ones finish last."""
    nq, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    kv_bytes = 2 * sum(seq_lens) * nkv * hd * 2
    cells = []
    for bs in BLOCK_SIZES:
        batch = PagedBatch([1] * len(seq_lens), seq_lens, nq, nkv, hd, torch.bfloat16,
                           block_size=bs)
        for splits in (1, 2, 4, 8):
            us = 1e3 * do_bench(lambda b=batch, n=splits: b.call(paged_attention, num_splits=n))
            cells.append(f"block {bs} splits {splits}: {us:.1f} us "
                         f"({100 * kv_bytes / us * 1e6 / COPY_BW:.0f}%)")
            report[f"decode B256 block {bs} splits {splits}"] = us
    print("decode B256, % of copy bandwidth: " + "; ".join(cells))


def _same_values(batch: PagedBatch, seq_lens: list[int], block_size: int) -> None:
    """Fill the cache so that token p of sequence b holds the same K/V whatever the block size:
    a value drawn per (b, p) from one generator, written through the block table."""
    dev = batch.k_cache.device
    gen = torch.Generator(device=dev).manual_seed(1)
    nkv, hd = batch.k_cache.shape[2], batch.k_cache.shape[3]
    seq = torch.repeat_interleave(torch.arange(len(seq_lens), device=dev), batch.seq_lens)
    pos = torch.cat([torch.arange(s, device=dev) for s in seq_lens])
    slots = batch.block_tables[seq, pos // block_size].long() * block_size + pos % block_size
    for cache in (batch.k_cache, batch.v_cache):
        values = torch.randn(len(slots), nkv, hd, device=dev, generator=gen)
        cache.view(-1, nkv, hd)[slots] = values.to(cache.dtype)
    batch.q = torch.randn(batch.q.shape, device=dev, generator=gen).to(batch.q.dtype)


def end_to_end(args, cfg: dict, report: dict) -> None:
    kv_tokens = args.num_prompts * (1024 + 256) + 256 * 64  # every sequence, no preemption
    llms = {bs: LLM(str(shape_dir(args.model_shape)), load_format="dummy",
                    skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048, seed=0,
                    max_num_batched_tokens=BUDGET, max_num_seqs=256, block_size=bs,
                    num_kv_blocks=kv_tokens // bs)
            for bs in BLOCK_SIZES}
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    prompts = sample_requests(args.num_prompts, 100, 1024, cfg["vocab_size"])
    check = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    tokens = {}
    for bs, llm in llms.items():
        llm.generate([{"prompt_token_ids": p} for p in warmup_requests(100, 1024,
                     cfg["vocab_size"])], params, use_tqdm=False)
        outs = llm.generate([{"prompt_token_ids": [t + 7 for t in p]} for p in prompts[:4]],
                            check, use_tqdm=False)
        tokens[bs] = [o.outputs[0].token_ids for o in outs]
    same = sum(a == b for a, b in zip(tokens[16], tokens[64]))
    print(f"greedy tokens, 4 prompts x 32: {same}/4 sequences identical for blocks 16 and 64")
    report["e2e"] = {"identical_sequences": same, "runs": {bs: [] for bs in BLOCK_SIZES}}
    for r in range(args.repeats):
        for bs, llm in llms.items():
            reqs = [{"prompt_token_ids": [t + 1 + r for t in p]} for p in prompts]
            torch.cuda.synchronize()
            start = time.perf_counter()
            outs = llm.generate(reqs, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            tok_s = sum(len(o.outputs[0].token_ids) for o in outs) / elapsed
            report["e2e"]["runs"][bs].append(tok_s)
            print(f"run {r}, block_size {bs}: {tok_s:,.0f} output tok/s ({elapsed:.2f} s)",
                  flush=True)
    runs = report["e2e"]["runs"]
    mean = {bs: sum(v) / len(v) for bs, v in runs.items()}
    print(f"mean: block 16 {mean[16]:,.0f}, block 64 {mean[64]:,.0f} output tok/s: "
          f"64 / 16 = {mean[64] / mean[16]:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--kernels-only", action="store_true")
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args()
    cfg = SHAPES[args.model_shape]
    report: dict = {"shape": args.model_shape, "num_prompts": args.num_prompts}
    default = EngineConfig(device="cuda").block_size
    print(f"{torch.cuda.get_device_name()}, {args.model_shape} shape "
          f"({cfg['num_attention_heads']}/{cfg['num_key_value_heads']} heads, d{cfg['head_dim']}); "
          f"the engine's default block_size here: {default}")
    report["default_block_size"] = default
    time_kernels(cfg, report)
    if not args.kernels_only:
        end_to_end(args, cfg, report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
