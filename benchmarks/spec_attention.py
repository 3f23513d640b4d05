"""A speculative verification step's attention, the three ways TINYPAGED_SPEC_DECODE_ATTENTION
picks inside the verification CUDA graphs, on one GPU:

    multi_query  the split-KV decode kernel with all q = k + 1 tokens of a sequence in one program
                 per (KV head, sequence, split): each sequence's K/V read once
    decodes      B * q one-token split-KV decodes (attention_metadata.as_decodes, built inside
                 the timed call as the graphs build it): each sequence's K/V read q times
    varlen       the varlen kernel: one program per (query block, KV head), no splits

    PYTHONPATH=. python benchmarks/spec_attention.py [--k 4] [--batches 1 8 32]
    PYTHONPATH=. python benchmarks/spec_attention.py --cpu    # interpreter, tiny shapes: checks

Llama-3-8B's attention (32 query / 8 KV heads, d128, bf16, blocks of 16), every sequence with
the same context; the split count as the graphs pick it (max_seq_len = --max-model-len, as the
capture passes it). Each mode is first compared with the torch reference (max |error|; exit 1
past the tolerance), then timed as it runs in a step: a CUDA graph of 50 calls cycling through
copies of the batch that together exceed L2 (each layer of a model reads its own cache),
replayed (benchmarks/awq_gemv.graph_us). GB/s counts every context's K/V once. Prints one JSON
line per (batch, context, mode), then a table of microseconds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

# (query heads, KV heads, head dim, block size): Llama-3-8B's attention; --cpu: a tiny one
SHAPE = (32, 8, 128, 16)
CPU_SHAPE = (8, 2, 64, 16)
MODES = ("multi_query", "decodes", "varlen")
L2_BYTES = 256 << 20  # the copies of a batch cycle through this much K/V (<= 50 copies)


def make_batch(batch: int, ctx: int, q: int, shape, dtype, device, seed: int) -> dict:
    """`batch` sequences of `ctx` tokens (the last q of them new), K/V in permuted blocks."""
    num_q_heads, num_kv_heads, head_dim, block_size = shape
    g = torch.Generator(device=device).manual_seed(seed)
    blocks = math.ceil(ctx / block_size)
    cache_shape = (batch * blocks, block_size, num_kv_heads, head_dim)
    return {
        "q": torch.randn(batch * q, num_q_heads, head_dim, generator=g, device=device).to(dtype),
        "k_cache": torch.randn(cache_shape, generator=g, device=device).to(dtype),
        "v_cache": torch.randn(cache_shape, generator=g, device=device).to(dtype),
        "block_tables": torch.randperm(batch * blocks, generator=g, device=device)
        .to(torch.int32).view(batch, blocks),
        "seq_lens": torch.full((batch,), ctx, dtype=torch.int32, device=device),
        "query_start_loc": torch.arange(batch + 1, dtype=torch.int32, device=device) * q,
        "slot_mapping": torch.full((batch * q,), -1, dtype=torch.int64, device=device),
        "out": torch.empty(batch * q, num_q_heads, head_dim, dtype=dtype, device=device),
        "scale": head_dim**-0.5,
    }


def attend(mode: str, x: dict, q: int, max_model_len: int):
    """The verification graph's attention call for `mode` (cuda_graphs.DecodeGraphs._metadata)."""
    from tinypaged.kernels.attention import paged_attention
    from tinypaged.models.attention_metadata import AttentionMetadata, as_decodes

    def call() -> torch.Tensor:
        md = AttentionMetadata(x["slot_mapping"], x["query_start_loc"], x["seq_lens"],
                               x["block_tables"], max_query_len=q, max_seq_len=max_model_len,
                               uniform_decode=mode == "multi_query")
        if mode == "decodes":
            md = as_decodes(md, q)
        return paged_attention(x["q"], x["k_cache"], x["v_cache"], md.block_tables, md.seq_lens,
                               md.query_start_loc, x["scale"], max_query_len=md.max_query_len,
                               max_seq_len=md.max_seq_len, out=x["out"],
                               uniform_decode=md.uniform_decode)

    return call


def check(x: dict, q: int, max_model_len: int, tol: float) -> dict[str, float]:
    """max |mode - reference| per mode."""
    from tinypaged.kernels.attention import paged_attention_ref

    ref = paged_attention_ref(x["q"], x["k_cache"], x["v_cache"], x["block_tables"],
                              x["seq_lens"], x["query_start_loc"], x["scale"]).float()
    errors = {}
    for mode in MODES:
        out = attend(mode, x, q, max_model_len)().float()
        errors[mode] = float((out - ref).abs().max())
        print(json.dumps({"check": mode, "batch": x["seq_lens"].shape[0],
                          "ctx": int(x["seq_lens"][0]), "max_abs_err": errors[mode],
                          "ok": errors[mode] <= tol}), flush=True)
    return errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens (q = k + 1)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the graphs' max_seq_len (default: the longest context)")
    parser.add_argument("--cpu", action="store_true",
                        help="the Triton interpreter on tiny shapes: the checks only")
    args = parser.parse_args()
    q = args.k + 1
    if args.cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # read at each call: CPU tensors take Triton
        device, dtype, shape, tol = "cpu", torch.float32, CPU_SHAPE, 1e-4
        batches, contexts = [1, 3], [q, 40]
    else:
        device, dtype, shape, tol = "cuda", torch.bfloat16, SHAPE, 2e-2
        batches, contexts = args.batches, args.contexts
    max_model_len = args.max_model_len or max(contexts)
    failed = False
    times: dict[tuple[int, int], dict[str, float]] = {}
    for batch in batches:
        for ctx in contexts:
            x = make_batch(batch, ctx, q, shape, dtype, device, seed=0)
            errors = check(x, q, max_model_len, tol)
            failed |= any(e > tol for e in errors.values())
            if args.cpu:
                continue
            times[batch, ctx] = time_modes(batch, ctx, q, shape, dtype, max_model_len, x)
    if times:
        print(f"\nus per call, k={args.k}, 32/8 heads d128 bf16 (graph replays)")
        print(f"{'batch':>5} {'ctx':>6} " + " ".join(f"{m:>12}" for m in MODES))
        for (batch, ctx), row in times.items():
            print(f"{batch:>5} {ctx:>6} " + " ".join(f"{row[m]:>12.1f}" for m in MODES))
    return 1 if failed else 0


def time_modes(batch: int, ctx: int, q: int, shape, dtype, max_model_len: int,
               first: dict) -> dict[str, float]:
    from awq_gemv import graph_us

    kv_bytes = 2 * first["k_cache"][0, 0].numel() * first["k_cache"].element_size() * batch * ctx
    copies = [first] + [make_batch(batch, ctx, q, shape, dtype, "cuda", seed=i)
                        for i in range(1, min(50, math.ceil(L2_BYTES / kv_bytes)))]
    row = {}
    for mode in MODES:
        us = graph_us([attend(mode, x, q, max_model_len) for x in copies])
        row[mode] = us
        print(json.dumps({"batch": batch, "ctx": ctx, "k": q - 1, "mode": mode,
                          "us": round(us, 2), "kv_GB_s": round(kv_bytes / us / 1e3, 1),
                          "copies": len(copies)}), flush=True)
    return row


if __name__ == "__main__":
    sys.exit(main())
