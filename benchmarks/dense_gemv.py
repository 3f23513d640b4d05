"""The dense decode GEMV (kernels/dense_gemv.py) against F.linear (cuBLAS) on the GPU: checks,
then timings, then (--sweep) tile configurations.

Times are CUDA-graph replays over weight copies larger together than 3x the L2 (awq_gemv.py's
graph_us), so every call streams its weight from HBM as in a decode step; GB/s counts the
weight bytes only, against the device copy bandwidth measured in the same run.

    PYTHONPATH=. python benchmarks/dense_gemv.py                # checks + table, M 1 2 4 8 16
    PYTHONPATH=. python benchmarks/dense_gemv.py --sweep        # + tile sweeps at M = 1 and 8
    PYTHONPATH=. python benchmarks/dense_gemv.py --sweep --budget 50 --json out.json
    PYTHONPATH=. python benchmarks/dense_gemv.py --e2e          # bench latency, GEMV on vs off
"""
import argparse
import gc
import json
import os
import time

import torch
import torch.nn.functional as F
from awq_gemv import L2_BYTES, copy_bandwidth, graph_us

from tinypaged.kernels import awq_gemv, dense_gemv
from tinypaged.kernels._triton import cdiv
from tinypaged.models.layers import ColumnParallelLinear

# (model, layer, K, N): the dense linears of a decode step (TP 1)
SHAPES = [
    ("llama3-8b", "qkv", 4096, 6144), ("llama3-8b", "o", 4096, 4096),
    ("llama3-8b", "gate_up", 4096, 28672), ("llama3-8b", "down", 14336, 4096),
    ("llama3-8b", "lm_head", 4096, 128256),
    ("qwen3-0.6b", "qkv", 1024, 4096), ("qwen3-0.6b", "o", 2048, 1024),
    ("qwen3-0.6b", "gate_up", 1024, 6144), ("qwen3-0.6b", "down", 3072, 1024),
    ("qwen3-0.6b", "lm_head", 1024, 151936),
]
MS = (1, 2, 4, 8, 16)
# (block_n, block_k, num_warps, num_stages, extra): the sweep's tiles; programs_per_sm 2..8
# is swept for each (a run-time argument, no recompile)
SWEEP_M1 = [(16, 256, 4, 3, {}), (8, 256, 4, 3, {}), (32, 256, 4, 3, {}), (16, 512, 4, 3, {}),
            (16, 128, 4, 4, {}), (32, 512, 8, 3, {}), (16, 256, 4, 2, {}),
            (64, 256, 4, 3, dict(tensor_cores=True, min_block_m=8))]
SWEEP_M8 = [(64, 256, 4, 3, {}), (64, 256, 4, 3, dict(min_block_m=8)),
            (128, 256, 4, 3, dict(min_block_m=8)), (128, 128, 4, 4, dict(min_block_m=8)),
            (32, 256, 4, 3, dict(min_block_m=8)), (64, 512, 4, 3, dict(min_block_m=8)),
            (128, 256, 8, 3, dict(min_block_m=8))]
PPSM = (2, 3, 4, 8)


def weights(K, N, dtype=torch.bfloat16):
    copies = max(2, cdiv(3 * L2_BYTES, 2 * K * N))
    return [(torch.randn(N, K, device="cuda") / K**0.5).to(dtype) for _ in range(copies)]


def rel_err(y, ref):
    return ((y.float() - ref).norm() / ref.norm()).item()


def check(x, w, b=None, **config):
    """Error against fp32 F.linear (three calls: a moving error would be a split-K race; the
    workspace left zeroed); also cuBLAS's own error in x's dtype, for scale."""
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    errs = [rel_err(dense_gemv.dense_gemv(x, w, b, **config), ref) for _ in range(3)]
    for partial, count in awq_gemv._SPLIT_K_WORKSPACE.values():
        assert not partial.any() and not count.any(), "split-K workspace not re-zeroed"
    cublas = rel_err(F.linear(x, w, b), ref)
    assert max(errs) < max(4 * cublas, 2e-3) and max(errs) - min(errs) < 1e-3, (config, errs,
                                                                                cublas)
    return max(errs), cublas


def checks():
    print("checks (relative error vs fp32 F.linear; cuBLAS in the same dtype for scale):")
    for dtype in (torch.bfloat16, torch.float16):
        for K, N, bias in ((4096, 6144, False), (14336, 4096, False), (1000, 1000, True),
                           (2048, 1024, True)):
            w = weights(K, N, dtype)[0]
            b = torch.randn(N, device="cuda", dtype=dtype) if bias else None
            worst = (0.0, 0.0)
            for M in range(1, dense_gemv.GEMV_MAX_M + 1):
                x = torch.randn(M, K, device="cuda", dtype=dtype)
                worst = max(worst, check(x, w, b))
            x = torch.randn(8, K + 3, device="cuda", dtype=dtype)[:, :K]  # strided rows
            worst = max(worst, check(x, w, b))
            print(f"  ok {str(dtype)[6:]} {K}x{N} bias={bias} M 1..16: gemv {worst[0]:.1e}, "
                  f"cuBLAS {worst[1]:.1e}", flush=True)


def graph_check():
    """A bf16 ColumnParallelLinear (what the models build) captured in a CUDA graph at M = 1 and
    8, replayed on new inputs: dense_linear's GEMV must neither allocate nor sync in capture."""
    layer = ColumnParallelLinear(4096, 6144, bias=True).to("cuda", torch.bfloat16)
    for p in layer.parameters():
        p.data.normal_(std=0.02)
    for M in (1, 8):
        x = torch.randn(M, 4096, device="cuda", dtype=torch.bfloat16)
        layer(x)  # eager first: compiles, allocates the split-K workspace
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = layer(x)
        for _ in range(2):
            x.normal_()
            graph.replay()
            ref = F.linear(x.float(), layer.weight.float(), layer.bias.float())
            assert rel_err(y, ref) < 1e-2, (M, rel_err(y, ref))
        print(f"  ok CUDA graph of ColumnParallelLinear M={M}: {rel_err(y, ref):.1e} "
              f"(GEMV config {dense_gemv.gemv_config(M, 6144, 4096)})", flush=True)


def gemv_call(x, w, config):
    return lambda: dense_gemv.dense_gemv(x, w, **config)


def table(bw, rows):
    print(f"\ncopy bandwidth {bw / 1e9:,.0f} GB/s; us per call (graph replays, weights from HBM)")
    print("| model | layer | KxN | M | cuBLAS us | GEMV us | speed-up | GEMV GB/s | % copy BW "
          "| cuBLAS % |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model, layer, K, N in SHAPES:
        ws = weights(K, N)
        reps = 50 if K * N < (64 << 20) else 10
        for M in MS:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            base = graph_us([lambda w=w, x=x: F.linear(x, w) for w in ws], reps)
            config = dense_gemv.gemv_config(M, N, K) or {}
            ours = graph_us([gemv_call(x, w, config) for w in ws], reps)
            gbs = 2 * K * N / ours / 1e3
            rows.append(dict(model=model, layer=layer, K=K, N=N, M=M, cublas_us=base,
                             gemv_us=ours, config=config))
            print(f"| {model} | {layer} | {K}x{N} | {M} | {base:.1f} | {ours:.1f} | "
                  f"{base / ours:.2f}x | {gbs:,.0f} | {gbs * 1e9 / bw:.0%} | "
                  f"{2 * K * N / base / 1e3 * 1e9 / bw:.0%} |", flush=True)
        del ws


def sweep(deadline, rows):
    print("\nsweep: best tile per shape (block_n, block_k, warps, stages, extra, programs/SM)")
    # Llama-3-8B's layers first (M = 1, then 8), then Qwen3-0.6B's
    order = [(M, configs, shape) for models in (SHAPES[:5], SHAPES[5:])
             for M, configs in ((1, SWEEP_M1), (8, SWEEP_M8)) for shape in models]
    for M, configs, (model, layer, K, N) in order:
        if time.time() > deadline:
            print("  (budget spent: sweep stopped)")
            return
        ws = weights(K, N)
        reps = 50 if K * N < (64 << 20) else 10
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        base = graph_us([lambda w=w, x=x: F.linear(x, w) for w in ws], reps)
        results = []
        for block_n, block_k, warps, stages, extra in configs:
            for ppsm in PPSM:
                if time.time() > deadline:
                    break
                config = dict(block_n=block_n, block_k=block_k, num_warps=warps,
                              num_stages=stages, programs_per_sm=ppsm, **extra)
                try:
                    check(x, ws[0], **config)
                except Exception as e:  # a config that fails to compile or check
                    print(f"  FAIL {model} {layer} M={M} {config}: {str(e)[:160]}")
                    break
                t = graph_us([gemv_call(x, w, config) for w in ws], reps)
                results.append((t, config))
                rows.append(dict(model=model, layer=layer, K=K, N=N, M=M, cublas_us=base,
                                 gemv_us=t, config=config, sweep=True))
        results.sort(key=lambda r: r[0])
        top = "; ".join(f"{t:.1f} {tuple(c.values())}" for t, c in results[:3])
        print(f"  {model} {layer} M={M}: cuBLAS {base:.1f} | best {top}", flush=True)
        del ws


def e2e(args, start):
    """`tinypaged bench latency` with the GEMV on and off (TINYPAGED_DENSE_GEMV), alternating in
    one process (the second engine reuses the first's compiled kernels) until the budget is
    spent, at least once each; tok/s per sequence, best of the runs of each."""
    from tinypaged import bench

    best: dict[tuple[str, int], float] = {}
    runs = 0
    while True:  # pairs (on, off); another pair while under half the budget
        on = "1" if runs % 2 == 0 else "0"
        os.environ["TINYPAGED_DENSE_GEMV"] = on
        print(f"\n-- GEMV {'on' if on == '1' else 'off'} ({time.time() - start:.0f} s)", flush=True)
        result = bench.main(["latency", "--model-shape", args.model_shape, "--output-len",
                             str(args.output_len), "--batch-sizes", *map(str, args.batch_sizes),
                             "--max-num-seqs", str(max(args.batch_sizes)),
                             "--gpu-memory-utilization", "0.4"])
        gc.collect()
        torch.cuda.empty_cache()
        for batch, r in result.items():
            key = (on, int(batch))
            best[key] = max(best.get(key, 0.0), r["tok_s_per_seq"])
        runs += 1
        if runs % 2 == 0 and time.time() - start > args.budget / 2:
            break
    print(f"\n{args.model_shape}, 512 in / {args.output_len} out, {runs} engine runs "
          f"(best tok/s per sequence):")
    print("| batch | GEMV on | GEMV off (cuBLAS) | on / off |\n|---|---|---|---|")
    for batch in args.batch_sizes:
        a, b = best.get(("1", batch), 0.0), best.get(("0", batch), 0.0)
        print(f"| {batch} | {a:.1f} | {b:.1f} | {a / b if b else 0:.3f}x |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--budget", type=float, default=40.0,
                        help="seconds from the start; the sweep (or --e2e's repeats) stop past it")
    parser.add_argument("--json", help="write every timing here")
    parser.add_argument("--e2e", action="store_true",
                        help="only the end-to-end A/B: bench latency with the GEMV on and off")
    parser.add_argument("--model-shape", default="llama3-8b")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    start = time.time()
    if args.e2e:
        e2e(args, start)
        return
    torch.manual_seed(0)
    checks()
    graph_check()
    rows = []
    bw = copy_bandwidth()
    table(bw, rows)
    if args.sweep:
        sweep(start + args.budget, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_bandwidth=bw, rows=rows), f, indent=1)
    print(f"\ntotal {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
