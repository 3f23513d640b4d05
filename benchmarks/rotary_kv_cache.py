"""Rotary + KV store fused vs the separate ops, on one GPU: correctness, then speed.

    PYTHONPATH=. python benchmarks/rotary_kv_cache.py [--tokens 1 8 64 256 4096]

Shapes: Llama-3-8B (32 / 8 heads, head_dim 128, neox, llama3-scaled table) and Qwen3-8B (the
same heads plus the per-head q/k RMSNorm), bf16, block size 16.
1. `rotary_store_kv_triton` against its reference (bf16 and fp16, neox and gptj pairs, partial
   rotary, a quarter of the rows padding with slot -1): max error / max |ref| under 2e-2 (bf16; a
   rounding point can land one ulp apart) / 5e-3 (fp16), else exit code 1 before any timing.
2. Microseconds per layer call, fused vs separate (rms_norm q, rms_norm k (Qwen3),
   rotary_embedding, store_kv), twice: eager (triton.testing.do_bench, host launch cost
   included) and replayed from a CUDA graph of 20 calls (what a captured decode step pays;
   benchmarks/awq_gemv.py's graph_us).
"""

from __future__ import annotations

import argparse
import sys

import torch
from triton.testing import do_bench

from benchmarks.awq_gemv import graph_us
from tinypaged.kernels import kv_cache, norm, rotary, rotary_kv_cache
from tinypaged.models.rope import RopeSpec

DEV = "cuda"
HQ, HK, D, BLOCK_SIZE = 32, 8, 128, 16
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def make_step(num_tokens: int, dtype: torch.dtype, head_dim: int = D, seed: int = 0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    qkv = torch.randn(num_tokens, (HQ + 2 * HK) * head_dim, device=DEV, generator=gen).to(dtype)
    q, k, v = (t.view(num_tokens, -1, head_dim)
               for t in qkv.split([HQ * head_dim, HK * head_dim, HK * head_dim], dim=-1))
    num_blocks = num_tokens // BLOCK_SIZE + 8
    caches = [torch.zeros(num_blocks, BLOCK_SIZE, HK, head_dim, device=DEV, dtype=dtype)
              for _ in range(2)]
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=DEV, generator=gen)[:num_tokens]
    positions = torch.randint(0, 4096, (num_tokens,), device=DEV, generator=gen)
    weights = [torch.rand(head_dim, device=DEV, generator=gen).to(dtype) + 0.5 for _ in range(2)]
    return positions, q, k, v, caches, slots, weights


def check() -> bool:
    ok = True
    for dtype in (torch.bfloat16, torch.float16):
        for interleaved, rotary_dim, with_norm in ((False, 128, True), (False, 128, False),
                                                   (True, 64, False), (False, 64, True)):
            positions, q, k, v, (kc, vc), slots, weights = make_step(96, dtype)
            slots[::4] = -1
            table = RopeSpec(500000.0, rotary_dim, 8192, scaling=LLAMA3).cos_sin_cache().to(DEV)
            norms = weights if with_norm else (None, None)
            q_ref, kc_ref, vc_ref = q.clone(), kc.clone(), vc.clone()
            rotary_kv_cache.rotary_store_kv_triton(positions, q, k, v, kc, vc, slots, table,
                                                   rotary_dim, interleaved, *norms)
            rotary_kv_cache.rotary_store_kv_ref(positions, q_ref, k, v, kc_ref, vc_ref, slots,
                                                table, rotary_dim, interleaved, *norms)
            errs = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                    for a, b in ((q, q_ref), (kc, kc_ref), (vc, vc_ref))]
            good = max(errs) < (2e-2 if dtype == torch.bfloat16 else 5e-3)  # 1-2 ulp
            ok &= good
            print(f"  check {str(dtype):15s} {'gptj' if interleaved else 'neox'} "
                  f"rotary {rotary_dim:3d} norm {with_norm!s:5s}  max err q/k/v "
                  f"{errs[0]:.1e}/{errs[1]:.1e}/{errs[2]:.1e}  {'ok' if good else 'MISMATCH'}")
    return ok


def time_one(t: int, with_norm: bool, table: torch.Tensor) -> tuple[list[float], list[float]]:
    """([fused, separate] us from a graph, [fused, separate] us eager) at T = t."""
    positions, q, k, v, (kc, vc), slots, (wq, wk) = make_step(t, torch.bfloat16)
    norms = (wq, wk) if with_norm else (None, None)

    def fused():
        rotary_kv_cache.rotary_store_kv(positions, q, k, v, kc, vc, slots, table, D, False,
                                        *norms)

    def separate():
        qq, kk = q, k
        if with_norm:
            qq, kk = norm.rms_norm(q, wq, 1e-6), norm.rms_norm(k, wk, 1e-6)
        rotary.rotary_embedding(positions, qq, kk, table, D)
        kv_cache.store_kv(kk, v, kc, vc, slots)

    graph = [graph_us([f], reps=20) for f in (fused, separate)]
    eager = [1e3 * do_bench(f, warmup=10, rep=30, return_mode="median") for f in (fused, separate)]
    return graph, eager


def time_shape(name: str, with_norm: bool, token_counts) -> list[str]:
    table = RopeSpec(500000.0, D, 8192, scaling=None if with_norm else LLAMA3).cos_sin_cache()
    table = table.to(DEV)
    rows = []
    for t in token_counts:
        graph, eager = time_one(t, with_norm, table)
        moved = t * (2 * (HQ + 2 * HK) * D * 2)  # q, k, v read; q, k, v written (bf16)
        rows.append(f"| {name} | {t} | {graph[0]:.1f} | {graph[1]:.1f} | "
                    f"{graph[1] / graph[0]:.2f}x | {eager[0]:.1f} | {eager[1]:.1f} | "
                    f"{moved / graph[0] / 1e3:.0f} |")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 4096])
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}")
    if not check():
        print("MISMATCH: no timings")
        return 1
    rows = time_shape("Llama-3-8B", False, args.tokens) + time_shape("Qwen3-8B (q/k norm)", True,
                                                                     args.tokens)
    print("\n| shape | T | fused us (graph) | separate us (graph) | speedup | fused us (eager) | "
          "separate us (eager) | fused GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
