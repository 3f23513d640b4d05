"""Fused MoE kernel benchmark on one GPU, Qwen3-30B-A3B layer shape: correctness, then speed.

    PYTHONPATH=. python benchmarks/moe.py                      # check, time, table
    PYTHONPATH=. python benchmarks/moe.py --sweep              # also try tile configs per T
    PYTHONPATH=.:/tmp/vsite python benchmarks/moe.py           # vLLM's fused_experts beside ours,
                                                               # when vLLM imports (vllm-anchor)

Shape: hidden 2048, 128 experts, top-8 (softmax, renormalized), moe_intermediate 768, bf16.
For T in (1, 8, 64, 512, 4096) tokens:
1. `fused_experts_triton` against the loop-over-experts reference (fp32 math) in bf16 and fp16:
   max error / max |ref| must be under 1e-2, else exit code 1 before any timing.
2. Timings (triton.testing.do_bench, median, L2 flushed): our fused MoE (sort by expert + the two
   grouped-GEMM launches + the top-k sum), the routing alone, a dense bf16 GEMM of the same
   FLOPs (x [T, 2048] @ W [8 * 3 * 768, 2048]^T, cuBLAS) and vLLM's fused_experts if importable.
   Reported as TFLOP/s and as GB/s of the weights of the experts actually hit (each hit expert's
   9.4 MB read once is the floor at small T), with the bound max(bytes / 4.2 TB/s,
   FLOPs / 790 TFLOP/s) of this GPU class (ENVIRONMENT.md).
3. `--sweep`: a handful of tile configs per T, the fastest printed beside `get_config`'s choice
   in the form of moe.py's _CONFIGS table.
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

from tinypaged.kernels import moe, moe_routing

DEV = "cuda"
HIDDEN, EXPERTS, TOP_K, INTER = 2048, 128, 8, 768
COPY_BW, PEAK_FLOPS = 4.2e12, 790e12
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
        for t in token_counts:
            x, w13, w2, _, weights, ids = case(t, dtype, seed=t)
            got = moe.fused_experts_triton(x, w13, w2, weights, ids).float()
            want = moe.fused_experts_ref(x, w13, w2, weights, ids).float()
            rel = ((got - want).abs().max() / want.abs().max()).item()
            good = rel < 1e-2 and torch.isfinite(got).all().item()
            ok &= good
            print(f"  check {str(dtype):15s} T={t:5d}  max err / max |ref| = {rel:.2e}  "
                  f"{'ok' if good else 'MISMATCH'}")
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


def time_one(t: int, dense_w: torch.Tensor, vllm_fn) -> dict:
    x, w13, w2, logits, weights, ids = case(t, torch.bfloat16, seed=t)
    flops = 2 * t * TOP_K * 3 * INTER * HIDDEN
    hit = ids.unique().numel()
    weight_bytes = hit * 3 * INTER * HIDDEN * 2
    bound_ms = max(weight_bytes / COPY_BW, flops / PEAK_FLOPS) * 1e3
    row = {"T": t, "experts_hit": hit, "bound_us": bound_ms * 1e3}
    timed = {
        "ours": lambda: moe.fused_experts_triton(x, w13, w2, weights, ids),
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
    ours_s = row["ours_us"] / 1e6
    row["ours_TFLOPs"] = flops / ours_s / 1e12
    row["ours_weight_GBs"] = weight_bytes / ours_s / 1e9
    row["ours_pct_of_bound"] = 100 * row["bound_us"] / row["ours_us"]
    row["dense_TFLOPs"] = flops / (row["dense_gemm_us"] / 1e6) / 1e12
    print(f"  T={t:5d} hit {hit:3d} experts: ours {row['ours_us']:8.1f} us "
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 4096])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    print(f"{datetime.date.today()} {torch.cuda.get_device_name()} commit {commit}")
    if not check(args.tokens):
        print("MISMATCH: no timings")
        return 1
    rows = timings(args.tokens, vllm_fused_experts())
    if args.sweep:
        sweep(args.tokens)
    print("\n| T | experts hit | fused MoE us | % of bound | TFLOP/s | weight GB/s | "
          "dense bf16 GEMM us (same FLOPs) | vLLM fused_experts us | routing us |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['T']} | {r['experts_hit']} | {r['ours_us']:.1f} | "
              f"{r['ours_pct_of_bound']:.0f}% | {r['ours_TFLOPs']:.1f} | "
              f"{r['ours_weight_GBs']:.0f} | {r['dense_gemm_us']:.1f} | "
              f"{r.get('vllm_us', float('nan')):.1f} | {r['routing_us']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
