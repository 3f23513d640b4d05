"""The dense decode GEMV (kernels/dense_gemv.py) against F.linear (cuBLAS) on the GPU: checks,
then timings of the candidate tile configurations that pass.

Times are CUDA-graph replays over weight copies larger together than 3x the L2 (awq_gemv.py's
graph_us), so every call streams its weight from HBM as in a decode step; GB/s counts the
weight bytes only, against the device copy bandwidth measured in the same run.

    PYTHONPATH=. python benchmarks/dense_gemv.py                # checks + table, M 1 2 4 8 16
    PYTHONPATH=. python benchmarks/dense_gemv.py --budget 50 --json out.json
    PYTHONPATH=. python benchmarks/dense_gemv.py --e2e          # bench latency, GEMV on vs off
    PYTHONPATH=. python benchmarks/dense_gemv.py --e2e --quantization fp8   # FP8: W8A16 vs W8A8
    PYTHONPATH=. python benchmarks/dense_gemv.py --sweep-rows 5 8 16 40 --budget 240

--sweep-rows times, per layer of --model-shape and each M, the one-row GEMV, cuBLAS at M rows,
the path DENSE_GEMV_PATHS gives M, and every tensor-core tile of SWEEP_TILES (checked first;
none past --budget), and prints each layer's best tile. DENSE_GEMV_PATHS' 2..8-row tiles came
from such a sweep at 5 rows (a batch-1 verification at k = 4); the kernel takes up to
DOT_MAX_M rows (a batch-8 verification has 40).
"""
import argparse
import gc
import json
import os
import time

import torch
import torch.nn.functional as F
from awq_gemv import L2_BYTES, copy_bandwidth, graph_us

from tinypaged.kernels import dense_gemv
from tinypaged.kernels._triton import cdiv
from tinypaged.kernels.split_k import SPLIT_K_WORKSPACE
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
# configurations tried per shape: at M = 1 the CUDA-core path (and tensor cores for one row), at
# 2..16 the tensor-core path; each is checked first and timed only if it passes. The pipelining
# and split variants also tell which part fails when one does (round 1: M = 1 off by 0.42).
CANDIDATES = {
    1: [dict(), dict(num_stages=2), dict(num_stages=1), dict(split_k=1),
        dict(num_stages=1, split_k=1), dict(block_n=32, block_k=512, num_warps=8),
        dict(tensor_cores=True, block_n=64), dict(tensor_cores=True, block_n=64, min_block_m=8),
        dict(tensor_cores=True, block_n=64, num_stages=1)],
    8: [dict(), dict(num_stages=1), dict(split_k=1), dict(min_block_m=8),
        dict(block_n=128, min_block_m=8), dict(block_n=32, min_block_m=8),
        dict(block_k=128, num_stages=4, min_block_m=8)],
}
PPSM = (2, 6)  # programs per SM tried besides the default 3, at M = 1 and 8
# --sweep-rows: tensor-core tiles (x^T padded to at least 8 columns), split K to 1..4 programs
# per SM, the weight by pointer loads or TMA; and wide 8-warp tiles
SWEEP_TILES = [dict(block_n=bn, block_k=128, num_stages=4, min_block_m=8, programs_per_sm=pps,
                    w_tma=tma) for bn in (64, 128) for pps in (1, 2, 3, 4) for tma in (False, True)]
SWEEP_TILES += [dict(block_n=128, block_k=256, num_stages=4, num_warps=8, min_block_m=8,
                     programs_per_sm=pps, w_tma=tma) for pps in (2, 4) for tma in (False, True)]


def weights(K, N, dtype=torch.bfloat16):
    copies = max(2, cdiv(3 * L2_BYTES, 2 * K * N))
    return [(torch.randn(N, K, device="cuda") / K**0.5).to(dtype) for _ in range(copies)]


def rel_err(y, ref):
    return ((y.float() - ref).norm() / ref.norm()).item()


def check(x, w, b=None, **config):
    """Error against fp32 F.linear (three calls: a moving error would be a split-K race; the
    workspace must be left zeroed) and cuBLAS's own error in x's dtype, for scale; raises
    AssertionError when the GEMV is off."""
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    errs = [rel_err(dense_gemv.dense_gemv(x, w, b, **config), ref) for _ in range(3)]
    cublas = rel_err(F.linear(x, w, b), ref)
    dirty = False
    for partial, count in SPLIT_K_WORKSPACE.values():
        dirty |= bool(partial.any() or count.any())
        partial.zero_()
        count.zero_()
    assert not dirty, "split-K workspace not re-zeroed"
    assert max(errs) < max(4 * cublas, 2e-3) and max(errs) - min(errs) < 1e-3, (
        f"errors {[f'{e:.2e}' for e in errs]} (cuBLAS {cublas:.1e})")
    return max(errs), cublas


def diagnose():
    """Every candidate at M = 1 and 8 (and 3 and 16 with the 8-row ones) in bf16 on two shapes
    (qkv; an odd one with bias): which pass. Returns {1: [...], 8: [...]} of passing configs."""
    print("checks, bf16 (relative error vs fp32 F.linear):")
    shapes = [(4096, 6144, False), (1000, 1000, True)]
    ws = {(K, N): (weights(K, N)[0], torch.randn(N, device="cuda", dtype=torch.bfloat16)
                   if bias else None) for K, N, bias in shapes}
    passing = {}
    for M, configs in CANDIDATES.items():
        passing[M] = []
        for config in configs:
            try:
                worst = 0.0
                for K, N in ws:
                    w, b = ws[K, N]
                    for rows in ((M,) if M == 1 else (3, 8, 16)):
                        x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
                        try:
                            worst = max(worst, check(x, w, b, **config)[0])
                        except AssertionError as e:
                            raise AssertionError(f"{K}x{N} rows={rows}: {e}") from None
                passing[M].append(config)
                print(f"  ok   M={M} {config}: {worst:.1e}", flush=True)
            except Exception as e:  # a wrong result, or a config that does not compile
                print(f"  FAIL M={M} {config}: {str(e)[:200]}", flush=True)
    return passing


def checks(configs):
    """The chosen configs over M = 1..16, bf16 and fp16, bias, strided x, odd shapes."""
    for dtype in (torch.bfloat16, torch.float16):
        for K, N, bias in ((14336, 4096, False), (1000, 1000, True), (2048, 1024, True)):
            w = weights(K, N, dtype)[0]
            b = torch.randn(N, device="cuda", dtype=dtype) if bias else None
            worst = (0.0, 0.0)
            for M in range(1, dense_gemv.GEMV_MAX_M + 1):
                x = torch.randn(M, K, device="cuda", dtype=dtype)
                worst = max(worst, check(x, w, b, **configs[1 if M == 1 else 8]))
            x = torch.randn(8, K + 3, device="cuda", dtype=dtype)[:, :K]  # strided rows
            worst = max(worst, check(x, w, b, **configs[8]))
            print(f"  ok {str(dtype)[6:]} {K}x{N} bias={bias} M 1..16: gemv {worst[0]:.1e}, "
                  f"cuBLAS {worst[1]:.1e}", flush=True)


def graph_check(configs):
    """A bf16 ColumnParallelLinear (what the models build) captured in a CUDA graph at M = 1 and
    8, replayed on new inputs: dense_linear's GEMV (routed to `configs` for this check) must
    neither allocate nor sync in capture."""
    table = dense_gemv.DENSE_GEMV_PATHS
    dense_gemv.DENSE_GEMV_PATHS = ((1, 0, 1 << 30, 0, 1 << 30, configs[1]),
                                   (16, 0, 1 << 30, 0, 1 << 30, configs[8]))
    try:
        _graph_check()
    finally:
        dense_gemv.DENSE_GEMV_PATHS = table


def graph_replay_errors(layer, reference, sizes=(1, 8)):
    """Capture layer(x) [M, 4096] in a CUDA graph at each M (after one eager call: compiles,
    allocates the split-K workspace), replay it twice on new inputs; -> [(M, the largest
    relative error against reference(x))]."""
    out = []
    for M in sizes:
        x = torch.randn(M, 4096, device="cuda", dtype=torch.bfloat16)
        layer(x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = layer(x)
        worst = 0.0
        for _ in range(2):
            x.normal_()
            graph.replay()
            worst = max(worst, rel_err(y, reference(x)))
        out.append((M, worst))
    return out


def _graph_check():
    layer = ColumnParallelLinear(4096, 6144, bias=True).to("cuda", torch.bfloat16)
    for p in layer.parameters():
        p.data.normal_(std=0.02)

    def reference(x):
        return F.linear(x.float(), layer.weight.float(), layer.bias.float())

    for M, err in graph_replay_errors(layer, reference):
        assert err < 1e-2, (M, err)
        print(f"  ok CUDA graph of ColumnParallelLinear M={M}: {err:.1e} "
              f"(GEMV config {dense_gemv.gemv_config(M, 6144, 4096)})", flush=True)


def gemv_call(x, w, config):
    return lambda: dense_gemv.dense_gemv(x, w, **config)


def table(bw, rows, passing, deadline):
    """Per shape and M: cuBLAS, and the fastest passing candidate (with programs per SM varied
    at M = 1 and 8)."""
    print(f"\ncopy bandwidth {bw / 1e9:,.0f} GB/s; us per call (graph replays, weights from HBM)")
    print("| model | layer | KxN | M | cuBLAS us | GEMV us | speed-up | GEMV GB/s | % copy BW "
          "| cuBLAS % | best config | default us |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model, layer, K, N in SHAPES:
        if time.time() > deadline:
            print("(budget spent: table stopped)")
            return
        ws = weights(K, N)
        reps = 50 if K * N < (64 << 20) else 10
        for M in MS:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            base = graph_us([lambda w=w, x=x: F.linear(x, w) for w in ws], reps)
            configs = list(passing[1 if M == 1 else 8])
            if M in (1, 8):
                configs += [dict(c, programs_per_sm=p) for c in configs[:2] for p in PPSM]
            times = []
            for config in configs:
                t = graph_us([gemv_call(x, w, config) for w in ws], reps)
                times.append((t, config))
                rows.append(dict(model=model, layer=layer, K=K, N=N, M=M, cublas_us=base,
                                 gemv_us=t, config=config))
            if not times:
                print(f"| {model} | {layer} | {K}x{N} | {M} | {base:.1f} | - |")
                continue
            ours, config = min(times, key=lambda r: r[0])
            default = next((f"{t:.1f}" for t, c in times if c == {}), "-")
            gbs = 2 * K * N / ours / 1e3
            print(f"| {model} | {layer} | {K}x{N} | {M} | {base:.1f} | {ours:.1f} | "
                  f"{base / ours:.2f}x | {gbs:,.0f} | {gbs * 1e9 / bw:.0%} | "
                  f"{2 * K * N / base / 1e3 * 1e9 / bw:.0%} | {config} | {default} |", flush=True)
        del ws


def sweep_rows(ms, model_shape, deadline):
    """--sweep-rows: per layer of model_shape and M in ms, us per call (graph replays, weights
    from HBM) of the one-row GEMV, cuBLAS at M rows, the table's path at M and each tile of
    SWEEP_TILES that passes check(); then each layer's best tile against cuBLAS."""
    print("| layer | KxN | M | one-row GEMV | cuBLAS | table's path | best tile | vs cuBLAS | "
          "its tile |\n|---|---|---|---|---|---|---|---|---|")
    for model, layer, K, N in SHAPES:
        if model != model_shape:
            continue
        ws = weights(K, N)
        reps = 50 if K * N < (64 << 20) else 10
        x1 = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        one = graph_us([gemv_call(x1, w, dense_gemv.gemv_config(1, N, K)) for w in ws], reps)
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            base = graph_us([lambda w=w, x=x: F.linear(x, w) for w in ws], reps)
            path = dense_gemv.gemv_config(M, N, K)
            table_us = (f"{graph_us([gemv_call(x, w, path) for w in ws], reps):.1f}" if path
                        else "cuBLAS")
            times = []
            for tile in SWEEP_TILES:
                if time.time() > deadline:
                    break
                try:
                    check(x, ws[0], None, **tile)
                except Exception as e:  # a wrong result, or a tile that does not fit
                    print(f"  skip {layer} M={M} {tile}: {str(e)[:120]}", flush=True)
                    continue
                times.append((graph_us([gemv_call(x, w, tile) for w in ws], reps), tile))
            if not times:
                print(f"| {layer} | {K}x{N} | {M} | {one:.1f} | {base:.1f} | {table_us} | - |")
                continue
            best, tile = min(times, key=lambda r: r[0])
            print(f"| {layer} | {K}x{N} | {M} | {one:.1f} | {base:.1f} | {table_us} | {best:.1f} "
                  f"| {base / best:.2f}x | {tile} |", flush=True)
        del ws
        torch.cuda.empty_cache()


def e2e(args, start):
    """`tinypaged bench latency` with the GEMV on and off (TINYPAGED_DENSE_GEMV), alternating in
    one process (the second engine reuses the first's compiled kernels) until the budget is
    spent, at least once each; tok/s per sequence, best of the runs of each."""
    from tinypaged.bench import offline as bench

    best: dict[tuple[str, int], float] = {}
    runs = 0
    while True:  # pairs (on, off); another pair while under half the budget
        on = "1" if runs % 2 == 0 else "0"
        os.environ["TINYPAGED_DENSE_GEMV"] = on
        print(f"\n-- GEMV {'on' if on == '1' else 'off'} ({time.time() - start:.0f} s)", flush=True)
        result = bench.main(["latency", "--model-shape", args.model_shape, "--output-len",
                             str(args.output_len), "--batch-sizes", *map(str, args.batch_sizes),
                             "--max-num-seqs", str(max(args.batch_sizes)),
                             # each engine's KV cache fits even if the ones before were not
                             # freed (decode at these batch sizes needs little of it)
                             "--gpu-memory-utilization", f"{min(0.9, 0.3 * (runs + 1)):.1f}",
                             *(["--quantization", args.quantization] if args.quantization
                               else [])])
        gc.collect()
        torch.cuda.empty_cache()
        print(f"(GPU memory still allocated: {torch.cuda.memory_allocated() / 2**30:.1f} GiB)")
        for batch, r in result.items():
            key = (on, int(batch))
            best[key] = max(best.get(key, 0.0), r["tok_s_per_seq"])
        runs += 1
        if runs % 2 == 0 and time.time() - start > args.budget / 2:
            break
    print(f"\n{args.model_shape} {args.quantization or ''}, 512 in / {args.output_len} out, "
          f"{runs} engine runs "
          f"(best tok/s per sequence):")
    print("| batch | GEMV on | GEMV off (cuBLAS) | on / off |\n|---|---|---|---|")
    for batch in args.batch_sizes:
        a, b = best.get(("1", batch), 0.0), best.get(("0", batch), 0.0)
        print(f"| {batch} | {a:.1f} | {b:.1f} | {a / b if b else 0:.3f}x |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=float, default=40.0,
                        help="seconds from the start; the table (or --e2e's repeats) stop past it")
    parser.add_argument("--json", help="write every timing here")
    parser.add_argument("--e2e", action="store_true",
                        help="only the end-to-end A/B: bench latency with the GEMV on and off")
    parser.add_argument("--sweep-rows", type=int, nargs="+", metavar="M",
                        help="only the tile sweep at these row counts (1 < M <= DOT_MAX_M)")
    parser.add_argument("--model-shape", default="llama3-8b")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--quantization", default=None,
                        help="--e2e with this quantization (fp8: the FP8 decode GEMV, W8A16, on "
                             "vs W8A8 off)")
    args = parser.parse_args()
    start = time.time()
    if args.e2e:
        e2e(args, start)
        return
    if args.sweep_rows:
        sweep_rows(args.sweep_rows, args.model_shape, start + args.budget)
        return
    torch.manual_seed(0)
    passing = diagnose()
    rows = []
    if passing[1] and passing[8]:
        try:
            checks({M: passing[M][0] for M in passing})
            graph_check({M: passing[M][0] for M in passing})
        except AssertionError as e:
            print(f"  FAIL {str(e)[:300]}", flush=True)
    bw = copy_bandwidth()
    table(bw, rows, passing, start + args.budget)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_bandwidth=bw, rows=rows), f, indent=1)
    print(f"\ntotal {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
