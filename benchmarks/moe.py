"""Fused MoE kernel benchmark on one GPU, Qwen3-30B-A3B layer shape: correctness, then speed.

    PYTHONPATH=. python benchmarks/moe.py                      # check, time, table
    PYTHONPATH=. python benchmarks/moe.py --sweep              # also try tile configs per T
    PYTHONPATH=. python benchmarks/moe.py --sweep-gemv         # the same for the decode GEMVs
    PYTHONPATH=. python benchmarks/moe.py --profile 1          # kernels of one call at T=1
    PYTHONPATH=.:/tmp/vsite python benchmarks/moe.py           # vLLM's fused_experts beside ours,
                                                               # when vLLM imports (vllm-anchor)

Shape: hidden 2048, 128 experts, top-8 (softmax, renormalized), moe_intermediate 768, bf16.
For T in (1, 8, 64, 512, 4096) tokens:
1. `fused_experts` as the engine calls it (the GEMVs of moe_gemv.py up to 8 tokens, the grouped
   GEMM above) and the grouped GEMM at every T, against the loop-over-experts reference (fp32
   math) in bf16 (fp16 at T <= 8 only, which keeps the compiles few): max error / max |ref|
   must be under 1e-2, else exit code 1 before any timing.
2. Timings: `fused_experts`, the grouped GEMM path (`fused_experts_triton`: sort by expert + two
   grouped-GEMM launches + the top-k sum), the routing alone, a dense bf16 GEMM of the same
   FLOPs (x [T, 2048] @ W [8 * 3 * 768, 2048]^T, cuBLAS), vLLM's fused_experts if importable
   and the routing and the sort by expert (their kernels and torch references, the kernels
   checked first too);
   eager (triton.testing.do_bench, median, L2 flushed: the host's launch cost shows when it is
   longer than the GPU work) and, for ours, replayed from a CUDA graph (what a captured decode
   step pays). Reported as TFLOP/s and as GB/s of the weights of the experts actually hit (each
   hit expert's 9.4 MB read once is the floor at small T), with the bound max(bytes / 4.2 TB/s,
   FLOPs / 790 TFLOP/s) of this GPU class (ENVIRONMENT.md).
3. `--sweep`: a handful of tile configs per T, the fastest printed beside `get_config`'s choice
   in the form of moe.py's _CONFIGS table; `--sweep-gemv`: the GEMVs' configs up to T=8, each
   launch's fastest four.
4. `--profile T`: torch.profiler's kernel table (GPU and host time) of one eager call of each
   path at T tokens.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from benchmarks.awq_gemv import graph_us
from tinypaged.kernels import moe, moe_align, moe_gemv, moe_routing

DEV = "cuda"
HIDDEN, EXPERTS, TOP_K, INTER = 2048, 128, 8, 768
COPY_BW, PEAK_FLOPS = 4.2e12, 790e12
GEMV_SWEEP = [  # (BLOCK_N, BLOCK_K, num_warps) of both GEMV launches
    (4, 1024, 4), (2, 1024, 2), (4, 2048, 8), (8, 1024, 8), (4, 512, 2), (8, 256, 4),
]
SWEEP = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
    (16, 64, 128, 4, 3), (16, 128, 128, 4, 2), (16, 64, 256, 4, 2), (16, 128, 64, 4, 4),
    (32, 64, 128, 4, 3), (32, 128, 128, 4, 2), (64, 128, 64, 4, 3), (64, 64, 64, 4, 4),
    (64, 128, 64, 8, 4), (128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (128, 128, 32, 8, 4),
]


def ms_of(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def case(num_tokens: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=DEV, generator=gen) * 0.02)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, device=DEV, generator=gen) * 0.02)
    x = torch.randn(num_tokens, HIDDEN, device=DEV, generator=gen)
    logits = torch.randn(num_tokens, EXPERTS, device=DEV, generator=gen)
    weights, ids = moe_routing.select_experts(logits, TOP_K, renormalize=True)
    return x.to(dtype), w13.to(dtype), w2.to(dtype), logits, weights, ids


def check(token_counts) -> bool:
    ok = True
    for dtype in (torch.bfloat16, torch.float16):
        for t in [t for t in token_counts if dtype == torch.bfloat16 or t <= 8]:
            x, w13, w2, logits, weights, ids = case(t, dtype, seed=t)
            ref_weights, ref_ids = moe_routing.select_experts_ref(logits, TOP_K, renormalize=True)
            same = torch.equal(ids, ref_ids) and torch.allclose(weights, ref_weights, atol=1e-6)
            ok &= same
            block_m = moe.get_config(t)["BLOCK_M"]
            aligned = zip(moe_align.moe_align_block_size_triton(ids, block_m, EXPERTS),
                          moe_align.moe_align_block_size_ref(ids, block_m, EXPERTS))
            same_align = all(torch.equal(a, b) for a, b in aligned)
            ok &= same_align
            print(f"  check routing kernel {str(dtype):15s} T={t:5d}  "
                  f"{'ok' if same else 'MISMATCH'}; align kernel "
                  f"{'ok' if same_align else 'MISMATCH'}")
            want = moe.fused_experts_ref(x, w13, w2, weights, ids).float()
            for name, fn in (("fused_experts", moe.fused_experts),
                             ("grouped", moe.fused_experts_triton)):
                got = fn(x, w13, w2, weights, ids).float()
                rel = ((got - want).abs().max() / want.abs().max()).item()
                good = rel < 1e-2 and torch.isfinite(got).all().item()
                ok &= good
                print(f"  check {name:13s} {str(dtype):15s} T={t:5d}  max err / max |ref| = "
                      f"{rel:.2e}  {'ok' if good else 'MISMATCH'}")
    return ok


def vllm_fused_experts():
    try:
        from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts
    except Exception as e:  # noqa: BLE001 - any import failure means: no vLLM column
        print(f"  (vLLM's fused_experts not importable: {type(e).__name__}: {str(e)[:80]})")
        return None
    return fused_experts


def timings(token_counts, vllm_fn) -> list[dict]:
    dense_w = torch.randn(TOP_K * 3 * INTER, HIDDEN, device=DEV, dtype=torch.bfloat16) * 0.02
    return [time_one(t, dense_w, vllm_fn) for t in token_counts]


def routings(t: int, count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` routings of T tokens: a graph replaying calls over them reads other experts'
    weights call after call, so a small T is not served from L2 (60 MB) as one routing would."""
    gen = torch.Generator(device=DEV).manual_seed(1000 + t)
    return [moe_routing.select_experts(torch.randn(t, EXPERTS, device=DEV, generator=gen),
                                       TOP_K, renormalize=True) for _ in range(count)]


def graph_over_routings(fn, x, w13, w2, t: int) -> float:
    return graph_us([lambda w=w, i=i: fn(x, w13, w2, w, i) for w, i in routings(t)], reps=12)


def time_one(t: int, dense_w: torch.Tensor, vllm_fn) -> dict:
    x, w13, w2, logits, weights, ids = case(t, torch.bfloat16, seed=t)
    flops = 2 * t * TOP_K * 3 * INTER * HIDDEN
    hit = sum(i.unique().numel() for _, i in routings(t)) / len(routings(t))
    weight_bytes = hit * 3 * INTER * HIDDEN * 2
    bound_ms = max(weight_bytes / COPY_BW, flops / PEAK_FLOPS) * 1e3
    row = {"T": t, "experts_hit": hit, "bound_us": bound_ms * 1e3}
    timed = {
        "ours": lambda: moe.fused_experts(x, w13, w2, weights, ids),
        "grouped": lambda: moe.fused_experts_triton(x, w13, w2, weights, ids),
        "routing": lambda: moe_routing.select_experts(logits, TOP_K, renormalize=True),
        "dense_gemm": lambda: F.linear(x, dense_w),
    }
    if vllm_fn is not None:
        timed["vllm"] = lambda: vllm_fn(x, w13, w2, weights, ids)
    for name, fn in timed.items():
        try:
            ms = ms_of(fn)
        except Exception as e:  # noqa: BLE001 - a peer that cannot run this shape
            print(f"  T={t} {name}: n/a ({type(e).__name__}: {str(e)[:80]})")
            ms = float("nan")
        row[f"{name}_us"] = ms * 1e3
    row["ours_graph_us"] = graph_over_routings(moe.fused_experts, x, w13, w2, t)
    row["grouped_graph_us"] = graph_over_routings(moe.fused_experts_triton, x, w13, w2, t)
    row["routing_graph_us"] = graph_us([timed["routing"]], reps=10)
    row["routing_torch_graph_us"] = graph_us(
        [lambda: moe_routing.select_experts_ref(logits, TOP_K, renormalize=True)], reps=10)
    block_m = moe.get_config(t)["BLOCK_M"]
    for name, align in (("align", moe_align.moe_align_block_size_triton),
                        ("align_torch", moe_align.moe_align_block_size_ref)):
        row[f"{name}_graph_us"] = graph_us([lambda a=align: a(ids, block_m, EXPERTS)], reps=10)
    ours_s = row["ours_graph_us"] / 1e6
    row["ours_TFLOPs"] = flops / ours_s / 1e12
    row["ours_weight_GBs"] = weight_bytes / ours_s / 1e9
    row["ours_pct_of_bound"] = 100 * row["bound_us"] / row["ours_graph_us"]
    row["dense_TFLOPs"] = flops / (row["dense_gemm_us"] / 1e6) / 1e12
    print(f"  T={t:5d} hit {hit:5.1f} experts: ours {row['ours_graph_us']:8.1f} us graph "
          f"{row['ours_us']:8.1f} us eager, grouped {row['grouped_graph_us']:8.1f} us graph "
          f"({row['ours_TFLOPs']:6.1f} TFLOP/s, {row['ours_weight_GBs']:6.0f} GB/s, "
          f"{row['ours_pct_of_bound']:5.1f}% of bound) | routing {row['routing_us']:6.1f} us"
          f" | dense GEMM {row['dense_gemm_us']:8.1f} us | vLLM "
          f"{row.get('vllm_us', float('nan')):8.1f} us")
    return row


def sweep(token_counts) -> None:
    print("\nsweep (us per fused_experts call; * = get_config's choice)")
    for t in token_counts:
        sweep_one(t)


def sweep_one(t: int) -> None:
    x, w13, w2, _, weights, ids = case(t, torch.bfloat16, seed=t)
    default = moe.get_config(t)
    results = []
    for bm, bn, bk, warps, stages in SWEEP:
        config = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps,
                  "num_stages": stages}
        try:
            us = 1e3 * ms_of(lambda c=config: moe.fused_experts_triton(x, w13, w2, weights,
                                                                        ids, config=c))
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
            print(f"  T={t} {config}: failed ({type(e).__name__})")
            continue
        results.append((us, config))
    results.sort(key=lambda r: r[0])
    default_us = next((us for us, c in results if c == default), float("nan"))
    best_us, best = results[0]
    print(f"  T={t:5d} best {best_us:8.1f} us {tuple(best.values())}; "
          f"default{'*' if best == default else ''} {default_us:8.1f} us "
          f"{tuple(default.values())}")


def sweep_gemv(t: int) -> None:
    x, w13, w2, *_ = case(t, torch.bfloat16, seed=t)
    results = []
    for bn, bk, warps in GEMV_SWEEP:
        config = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps}
        for part in ("gate_up_config", "down_config"):
            def call(x, w13, w2, weights, ids, c=config, p=part):
                moe_gemv.fused_experts_gemv(x, w13, w2, weights, ids, **{p: c})
            results.append((graph_over_routings(call, x, w13, w2, t), part, (bn, bk, warps)))
    default = graph_over_routings(moe_gemv.fused_experts_gemv, x, w13, w2, t)
    for part in ("gate_up_config", "down_config"):
        mine = sorted((us, c) for us, p, c in results if p == part)
        shown = ", ".join(f"{c} {us:.1f}" for us, c in mine[:4])
        print(f"  GEMV T={t:2d} {part:14s} (the other at its default; defaults {default:.1f} us):"
              f" {shown}")


def profile(t: int) -> None:
    x, w13, w2, logits, weights, ids = case(t, torch.bfloat16, seed=t)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    for name, fn in (("fused_experts", moe.fused_experts), ("grouped", moe.fused_experts_triton)):
        for _ in range(3):
            fn(x, w13, w2, weights, ids)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=acts) as prof:
            fn(x, w13, w2, weights, ids)
            torch.cuda.synchronize()
        print(f"\nprofile of one {name} call at T={t}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                        max_name_column_width=45))


def print_table(rows: list[dict]) -> None:
    print("\n(graph: replayed over 4 routings; bound and GB/s from their mean experts hit)")
    print("\n| T | experts hit | fused_experts us (graph) | % of bound | weight GB/s | "
          "grouped GEMM us (graph) | fused_experts us (eager) | grouped us (eager) | "
          "dense bf16 GEMM us (same FLOPs) | vLLM fused_experts us | routing us (graph) | "
          "torch routing us (graph) | align us (graph) | torch align us (graph) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['T']} | {r['experts_hit']:.1f} | {r['ours_graph_us']:.1f} | "
              f"{r['ours_pct_of_bound']:.0f}% | {r['ours_weight_GBs']:.0f} | "
              f"{r['grouped_graph_us']:.1f} | {r['ours_us']:.1f} | {r['grouped_us']:.1f} | "
              f"{r['dense_gemm_us']:.1f} | {r.get('vllm_us', float('nan')):.1f} | "
              f"{r['routing_graph_us']:.1f} | {r['routing_torch_graph_us']:.1f} | "
              f"{r['align_graph_us']:.1f} | {r['align_torch_graph_us']:.1f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 4096])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-gemv", action="store_true",
                        help="try the GEMV configs at the token counts that use them")
    parser.add_argument("--profile", type=int, metavar="T", help="profile one call at T tokens")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    print(f"{datetime.date.today()} {torch.cuda.get_device_name()} commit {commit}")
    if not check(args.tokens):
        print("MISMATCH: no timings")
        return 1
    rows = timings(args.tokens, vllm_fused_experts())
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.profile:
        profile(args.profile)
    if args.sweep:
        sweep(args.tokens)
    if args.sweep_gemv:
        for t in args.tokens:
            if moe_gemv.use_gemv(t, TOP_K, EXPERTS):
                sweep_gemv(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
