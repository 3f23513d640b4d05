# ruff: noqa: B023  (each lambda is timed at once, in its own iteration)
"""The FP8 decode GEMV (W8A16: kernels/dense_gemv.py reading an e4m3 weight) on the GPU.

1. Checks: against dense_gemv_reference for every scale kind (per tensor, per channel,
   block-wise [128, 128]), M = 1..16 (1, 8, 16 with the SiLU-and-mul input), bf16 and fp16
   activations, a Llama-3-8B layer and an odd
   shape with a bias (N, K not multiples of the tiles); three calls each (a moving result would
   be a split-K race) and the split-K workspace left zeroed. Then an FP8 linear (what the models
   build) captured in a CUDA graph at 1 and 8 rows and replayed on new inputs.
2. Timings, per Llama-3-8B layer and M = 1, 8, 16: the W8A16 GEMV (FP8_GEMV_CONFIGS), the W8A8
   path it replaces at decode (quantize_fp8 + fp8_gemm), and the bf16 decode linear
   (dense_linear); CUDA-graph replays over weight copies larger together than 3x the L2, so
   every call streams its weight from HBM; GB/s counts weight bytes against the copy bandwidth
   measured in the same run. --sweep also times candidate tiles and prints the best per row.

    PYTHONPATH=. python benchmarks/fp8_gemv.py [--sweep] [--json out.json]
    PYTHONPATH=. python benchmarks/dense_gemv.py --e2e --quantization fp8   # decode, on vs off
"""
import argparse
import itertools
import json
import time

import torch
from awq_gemv import L2_BYTES, copy_bandwidth, graph_us
from dense_gemv import graph_replay_errors

from tinypaged.kernels import dense_gemv as D
from tinypaged.kernels import fp8
from tinypaged.kernels._triton import cdiv
from tinypaged.kernels.split_k import SPLIT_K_WORKSPACE
from tinypaged.models.layers import ColumnParallelLinear
from tinypaged.quantization.fp8 import Fp8Config

SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672),
          ("down", 14336, 4096)]  # Llama-3-8B, (layer, K, N)
KINDS = ("tensor", "channel", "block")


def fp8_weight(N, K, kind, dev="cuda"):
    """(e4m3 weight [N, K], fp32 scale, block) as quantization/fp8.py holds them."""
    w = torch.randn(N, K, device=dev) / K**0.5
    if kind == "block":
        s = torch.rand(cdiv(N, 128), cdiv(K, 128), device=dev) * 1e-3 + 1e-4
        full = s.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
        return (w / full).clamp(-448, 448).to(torch.float8_e4m3fn), s, (128, 128)
    s = w.abs().amax(1, keepdim=True) / fp8.FP8_MAX
    if kind == "tensor":
        s = s.max().reshape(1, 1)
    return (w / s).to(torch.float8_e4m3fn), s, None


def workspace_clean():
    clean = all(not (p.any() or c.any()) for p, c in SPLIT_K_WORKSPACE.values())
    for p, c in SPLIT_K_WORKSPACE.values():
        p.zero_()
        c.zero_()
    return clean


def checks():
    bad = 0
    for dtype in (torch.bfloat16, torch.float16):
        for kind in KINDS:
            for K, N, bias in ((4096, 6144, False), (1000, 1000, True)):
                w, s, block = fp8_weight(N, K, kind)
                b = torch.randn(N, device="cuda", dtype=dtype) if bias else None
                worst, failed = 0.0, bad
                for M in range(1, D.GEMV_MAX_M + 1):
                    x = torch.randn(M, K, device="cuda", dtype=dtype)
                    ref = D.dense_gemv_reference(x.float(), w, None if b is None else b.float(),
                                                 s, block)
                    cfg = D.fp8_gemv_config(M, block)
                    errs = [((D.dense_gemv(x, w, b, s, block, **cfg).float() - ref).norm()
                             / ref.norm()).item() for _ in range(3)]
                    ok = max(errs) < 1e-2 and max(errs) - min(errs) < 1e-3 and workspace_clean()
                    if not ok:
                        bad += 1
                        print(f"  FAIL {str(dtype)[6:]} {kind} {K}x{N} M={M}: {errs}")
                    worst = max(worst, *errs)
                print(f"  {'ok  ' if bad == failed else 'FAIL'} {str(dtype)[6:]:8s} {kind:7s} "
                      f"{K}x{N} bias={bias} M 1..16: max rel err {worst:.1e}", flush=True)
                for M in (1, 8, 16):  # the down projection's input formed on load
                    gate_up = torch.randn(M, 2 * K, device="cuda", dtype=dtype)
                    ref = D.dense_gemv_reference(gate_up.float(), w, None, s, block,
                                                 silu_and_mul=True)
                    y = D.dense_gemv(gate_up, w, None, s, block, silu_and_mul=True,
                                     **D.fp8_gemv_config(M, block))
                    err = ((y.float() - ref).norm() / ref.norm()).item()
                    ok = err < 1e-2 and workspace_clean()
                    bad += not ok
                    print(f"  {'ok  ' if ok else 'FAIL'} silu_and_mul input M={M}: {err:.1e}")
    for method in (Fp8Config.online(), Fp8Config(weight_scheme="block", block=(128, 128))):
        layer = ColumnParallelLinear(4096, 6144, bias=False, quant_config=method)
        if method.from_dense:
            layer.weight.data.normal_(std=0.02)
        else:
            w, s, _ = fp8_weight(6144, 4096, "block", "cpu")
            layer.weight.data.copy_(w)
            layer.weight_scale_inv.data.copy_(s)
        method.process_weights_after_loading(layer)
        layer.to("cuda")
        deq = method.dequantized_weight(layer)
        for M, err in graph_replay_errors(layer, lambda x, deq=deq: x.float() @ deq.t()):
            bad += not err < 1e-2
            print(f"  {'ok  ' if err < 1e-2 else 'FAIL'} CUDA graph, FP8 linear "
                  f"{method.weight_scheme} M={M}: {err:.1e}", flush=True)
    return bad


def candidates(M, block):
    """Tiles tried by --sweep (the table's config first)."""
    if M == 1:
        grid = itertools.product((16, 32, 64) if block else (16, 32),
                                 (128,) if block else (256, 512, 1024), (2, 3), (4, 8), (3, 4))
        out = [dict(block_n=n, block_k=k, programs_per_sm=p, num_warps=w, num_stages=st)
               for n, k, p, w, st in grid]
    else:
        grid = itertools.product((32, 64, 128), (128,) if block else (128, 256), (2, 3), (3, 4),
                                 (8, 16))
        out = [dict(block_n=n, block_k=k, programs_per_sm=p, num_stages=st, min_block_m=mb)
               for n, k, p, st, mb in grid if mb >= M]
    return [D.fp8_gemv_config(M, block)] + out


def table(bw, sweep, rows, deadline):
    print(f"\ncopy bandwidth {bw / 1e9:,.0f} GB/s; us per call (graph replays, weights from HBM)")
    print("| layer | KxN | scales | M | bf16 us | W8A8 us | W8A16 GEMV us | vs W8A8 | vs bf16 "
          "| GEMV % copy BW | best swept us | best config |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for layer, K, N in SHAPES:
        copies = max(2, cdiv(3 * L2_BYTES, N * K))
        dense = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        for kind in ("channel", "block"):
            ws = [fp8_weight(N, K, kind) for _ in range(copies)]
            block = ws[0][2]
            for M in (1, 8, 16):
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                bf16 = graph_us([lambda w=w: D.dense_linear(x, w) for w in dense])

                def w8a8(w):
                    q, s = fp8.quantize_fp8(x, 128 if block else None)
                    return fp8.fp8_gemm(q, s, w[0], w[1], x.dtype, block)

                old = graph_us([lambda w=w: w8a8(w) for w in ws])
                ours = graph_us([lambda w=w: D.dense_gemv(x, w[0], None, w[1], block,
                                                          **D.fp8_gemv_config(M, block))
                                 for w in ws])
                best = (ours, "table")
                if sweep and time.time() < deadline:
                    for cfg in candidates(M, block)[1:]:
                        try:
                            t = graph_us([lambda w=w: D.dense_gemv(x, w[0], None, w[1], block,
                                                                   **cfg) for w in ws], 20)
                        except Exception as e:  # noqa: BLE001  (a config that does not compile)
                            print(f"  ({cfg}: {str(e)[:60]})")
                            continue
                        rows.append(dict(layer=layer, K=K, N=N, kind=kind, M=M, us=t, cfg=cfg))
                        best = min(best, (t, cfg), key=lambda r: r[0])
                rows.append(dict(layer=layer, K=K, N=N, kind=kind, M=M, bf16_us=bf16,
                                 w8a8_us=old, gemv_us=ours))
                gbs = N * K / ours / 1e3
                print(f"| {layer} | {K}x{N} | {kind} | {M} | {bf16:.1f} | {old:.1f} | "
                      f"{ours:.1f} | {old / ours:.2f}x | {bf16 / ours:.2f}x | "
                      f"{gbs * 1e9 / bw:.0%} | {best[0]:.1f} | {best[1]} |", flush=True)
            del ws
        del dense


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="also time candidate tiles")
    parser.add_argument("--budget", type=float, default=420.0,
                        help="seconds from the start after which the sweep stops")
    parser.add_argument("--json", help="write every timing here")
    args = parser.parse_args()
    start = time.time()
    torch.manual_seed(0)
    print("checks (relative error vs the fp32 reference):")
    bad = checks()
    rows = []
    table(copy_bandwidth(), args.sweep, rows, start + args.budget)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\n{bad} failed checks; total {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
