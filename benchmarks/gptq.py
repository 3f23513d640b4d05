"""GPTQ linears on the GPU: correctness against the format's torch reference, then decode-sized
timings at the Llama-3-8B shapes: int4 (the AWQ kernels after the load-time repack), int8 (its
own kernels, kernels/gptq_int8.py) and the bf16 linear, graph-replayed with weights from HBM.

    PYTHONPATH=. python benchmarks/gptq.py                  # checks, then M = 1 and 8
    PYTHONPATH=. python benchmarks/gptq.py --sweep          # + int8 tile / split sweeps
    PYTHONPATH=. python benchmarks/gptq.py --crossover      # + int8 tiled GEMM vs dequant+cuBLAS

End to end (dummy weights, the same harness as the AWQ row of RESULTS.md):
    PYTHONPATH=. python -m tinypaged bench latency --model-shape llama3-8b --batch-sizes 1 8 \
        --quantization gptq
"""

from __future__ import annotations

import argparse
import copy
import functools
import itertools

import torch
from awq_gemv import L2_BYTES, SHAPES, graph_us
from torch import nn

from tinypaged.kernels import gptq_int8 as K8
from tinypaged.kernels._triton import cdiv, num_sms
from tinypaged.kernels.gptq_format import gptq_dequantize_reference, pack_gptq
from tinypaged.quantization.gptq import GPTQConfig

VARIANTS = [("int4 g128", 4, 128, False), ("int8 g128", 8, 128, False),
            ("int8 g128 act-order", 8, 128, True)]
DEVICE, DTYPE = "cuda", torch.bfloat16  # the CPU smoke test sets cpu, float32
MORE_VARIANTS = [("int4 g128 act-order", 4, 128, True), ("int4 per-channel", 4, -1, False),
                 ("int8 per-channel", 8, -1, False)]


def gptq_layer(K, N, bits, group_size, act_order, seed=0):
    """(method, layer ready for method.apply, W [K, N] fp32 on cuda from the format's reference)."""
    gen = torch.Generator(DEVICE).manual_seed(seed)
    G = K if group_size == -1 else group_size
    order = torch.randperm(K, generator=gen, device=DEVICE) if act_order else \
        torch.arange(K, device=DEVICE)
    g_idx = torch.empty(K, dtype=torch.int32, device=DEVICE)
    g_idx[order] = (torch.arange(K, device=DEVICE) // G).int()
    top = 2**bits - 1
    packed = pack_gptq(torch.randint(0, top + 1, (K, N), generator=gen, device=DEVICE),
                       torch.randint(0, top + 1, (K // G, N), generator=gen, device=DEVICE),
                       torch.rand(K // G, N, generator=gen, device=DEVICE) * 0.01 + 0.001,
                       g_idx, bits, 1)
    method = GPTQConfig(bits, group_size, act_order, 1)
    layer = nn.Module()
    method.create_weights(layer, K, N, torch.bfloat16)
    layer.to(DEVICE)
    for name, t in packed.items():
        getattr(layer, name).data.copy_(t)
    method.process_weights_after_loading(layer)
    return method, layer, gptq_dequantize_reference(*packed.values(), bits, 1)


def check(method, layer, w, ms=(1, 8, 40, 300)) -> float:
    """Largest max-abs error / max |ref| over M (each kernel path of the layer), repeated so that
    a race between split-K programs would show as a moving result (the fp32 atomics add in any
    order, so calls may differ by a rounding of the output, not more)."""
    worst = 0.0
    for M in ms:
        x = torch.randn(M, w.shape[0], device=DEVICE, dtype=DTYPE)
        ref = x.float() @ w
        top = ref.abs().max().item()
        ys = [method.apply(layer, x, None).float() for _ in range(3)]
        moved = max((y - ys[0]).abs().max().item() for y in ys[1:]) / top
        assert moved < 5e-3, f"M={M}: calls differ by {moved:.3g} of max |ref|"
        err = max((y - ref).abs().max().item() for y in ys) / top
        assert err < 2e-2, f"M={M}: relative error {err:.3g}"
        worst = max(worst, err)
    return worst


def copies_for(nbytes: int) -> int:
    return max(2, cdiv(3 * L2_BYTES, nbytes))


def time_layer(method, layer, dense, bits, ms=(1, 8)) -> dict:
    """Graph-replayed us per call, cycling through enough weight copies that they come from HBM."""
    K, N = dense.shape
    layers = [layer] + [copy.deepcopy(layer) for _ in range(copies_for(K * N * bits // 8) - 1)]
    denses = [dense] + [dense.clone() for _ in range(copies_for(2 * K * N) - 1)]
    out = {}
    for M in ms:
        x = torch.randn(M, K, device=DEVICE, dtype=DTYPE)
        out[M] = (graph_us([lambda lay=lay, x=x: method.apply(lay, x, None) for lay in layers]),
                  graph_us([lambda d=d, x=x: x @ d for d in denses]))
    return out


def int8_weights(K, N, copies, G=128):
    out = []
    for _ in range(copies):
        q = torch.randint(0, 256, (K, N), device=DEVICE, dtype=torch.uint8)
        z = torch.randint(0, 256, (K // G, N), device=DEVICE, dtype=torch.uint8)
        s = (torch.rand(K // G, N, device=DEVICE) * 0.01 + 0.001).half()
        out.append((q, z, s, K8.int8_gemv_scales(s)))
    return out


def sweep() -> None:
    """int8 kernel configs at M = 1 (GEMV) and M = 8 (split-K tiled) on the 8B shapes."""
    sms = num_sms(0)
    print("\n| layer | M | config | us | GB/s |\n|---|---|---|---|---|")
    for K, N, name in [s for s in SHAPES if s[2] in ("qkv", "issue")]:
        weights = int8_weights(K, N, copies_for(K * N))
        for M in (1, 8):
            x = torch.randn(M, K, device=DEVICE, dtype=DTYPE)
            ref = K8.gptq_int8_gemm_reference(x.float(), *weights[0][:3])
            if M == 1:
                grid = [dict(block_n=bn, rows=r, num_warps=nw, num_stages=st,
                             split_k=cdiv(per_sm * sms, cdiv(N, bn)))
                        for bn, r, nw, st, per_sm in itertools.product(
                            (128, 256), (4, 8), (4,), (2, 3), (2, 4))]
                fn = functools.partial(K8._gemv1, perm=None)
            else:
                grid = [dict(block_n=bn, block_k=bk, num_stages=st,
                             split_k=cdiv(per_sm * sms, cdiv(N, bn)))
                        for bn, bk, st, per_sm in itertools.product(
                            (64, 128, 256), (64, 128), (3,), (2, 4))]
                fn = K8._gemm
            best = None
            for config in grid:
                try:
                    y = fn(x, *weights[0][:3], scales_t=weights[0][3], **config).float()
                except Exception as e:  # a config past the SM's registers / shared memory
                    print(f"skip {config}: {type(e).__name__}", flush=True)
                    continue
                if (y - ref).abs().max() > 2e-2 * ref.abs().max():
                    print(f"WRONG RESULT {name} M={M} {config}", flush=True)
                    continue
                t = graph_us([lambda w=w, c=config, fn=fn, x=x: fn(x, *w[:3], scales_t=w[3], **c)
                              for w in weights], reps=20)
                if best is None or t < best[0]:
                    best = (t, config)
            t, config = best
            print(f"| {name} {K}x{N} | {M} | {config} | {t:.1f} | {K * N / t / 1e3:.0f} |",
                  flush=True)


def crossover() -> None:
    """int8 at 16 < M: the tiled GEMM against dequantize + cuBLAS (DENSE_MIN_M)."""
    print("\n| layer | M | bf16 (us) | tiled (us) | dequant + cuBLAS (us) |\n|---|---|---|---|---|")
    for K, N, name in [s for s in SHAPES if s[2] in ("o", "issue")]:
        weights = int8_weights(K, N, copies_for(K * N))
        dense = [torch.randn(K, N, device=DEVICE).to(DTYPE) for _ in range(2)]
        for M in (32, 64, 128, 256):
            x = torch.randn(M, K, device=DEVICE, dtype=DTYPE)
            base = graph_us([lambda d=d, x=x: x @ d for d in dense], reps=10)
            tiled = graph_us([lambda w=w, x=x: K8._gemm(x, *w[:3], w[3])
                              for w in weights],
                             reps=10)
            deq = graph_us([lambda w=w, x=x: x @ K8.gptq_int8_dequantize(*w[:3], x.dtype)
                            for w in weights], reps=10)
            print(f"| {name} {K}x{N} | {M} | {base:.1f} | {tiled:.1f} | {deq:.1f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--crossover", action="store_true")
    parser.add_argument("--all", action="store_true",
                        help="also int4 act-order and per-channel variants")
    args = parser.parse_args()
    rows = []
    for K, N, name in SHAPES:
        for label, bits, group_size, act_order in VARIANTS + (MORE_VARIANTS if args.all else []):
            method, layer, w = gptq_layer(K, N, bits, group_size, act_order)
            err = check(method, layer, w)
            for M, (t, base) in time_layer(method, layer, w.to(DTYPE), bits).items():
                rows.append((f"{name} {K}x{N}", label, M, t, base, err, K * N * bits / 8 / t / 1e3))
                print(rows[-1], flush=True)
            del layer, w
            torch.cuda.empty_cache()
    print("all checks passed (M = 1, 8, 40, 300 against the format's torch reference)")
    print("\n| layer | variant | M | GPTQ (us) | bf16 (us) | speed-up | weight GB/s | rel. err |")
    print("|---|---|---|---|---|---|---|---|")
    for shape, label, M, t, base, err, gbs in rows:
        print(f"| {shape} | {label} | {M} | {t:.1f} | {base:.1f} | {base / t:.2f}x | {gbs:.0f} "
              f"| {err:.1e} |")
    if args.sweep:
        sweep()
    if args.crossover:
        crossover()


if __name__ == "__main__":
    main()
