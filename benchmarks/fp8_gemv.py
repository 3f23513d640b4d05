# ruff: noqa: B023  (each lambda is timed at once, in its own iteration)
"""The FP8 decode GEMV (kernels/dense_gemv.py reading an e4m3 weight: W8A16, and W8A8 on FP8
tensor cores with --sweep-dot) on the GPU.

1. Checks: against dense_gemv_reference for every scale kind (per tensor, per channel,
   block-wise [128, 128]), M = 1..16 (1, 8, 16 with the SiLU-and-mul input), bf16 and fp16
   activations, a Llama-3-8B layer, an odd shape with a bias (N, K not multiples of the tiles)
   and a wide one (N >= WIDE_N); three calls each (a moving result would be a split-K race) and
   the split-K workspace left zeroed. Then an FP8 linear (what the models
   build) captured in a CUDA graph at 1 and 8 rows and replayed on new inputs.
2. Timings, per Llama-3-8B layer and M = 1, 8, 16: the W8A16 GEMV (FP8_GEMV_CONFIGS, the tile
   of each layer's shape; the down projection forms its input from gate_up, as the models call
   it), the W8A8 path it replaces at decode (quantize_fp8 + fp8_gemm), and the bf16 decode linear
   (dense_linear); CUDA-graph replays over weight copies larger together than 3x the L2, so
   every call streams its weight from HBM; GB/s counts weight bytes against the copy bandwidth
   measured in the same run. --sweep also times candidate tiles and prints the best per row.

    PYTHONPATH=. python benchmarks/fp8_gemv.py [--sweep] [--json out.json]
    PYTHONPATH=. python benchmarks/fp8_gemv.py --sweep-dot [--tiles 0:5]  # w8a8dot only, ~90 s
    PYTHONPATH=. python benchmarks/fp8_gemv.py --sweep-rows --budget-s 180  # < 4 min

--sweep-rows: fp8_rows (W8A8 at 2-16 rows, x already e4m3) and the one-row w8_words GEMV
against the paths they replace, checks, tile sweep and the tables to paste (fp8_rows_sweep.py).

--sweep-dot: the w8a8dot mode (dense_gemv quantize_x, TINYPAGED_FP8_GEMV=w8a8dot) alone: its
candidate tiles (DOT_TILES x DOT_PROGRAMS, in order until --budget) at M = 1, 2, 4, 8, 16 on
every Llama-3-8B layer (down with the SiLU-and-mul input), the best per M by summed time, as
GB/s against W8A16 and W8A8 (quantize x, fp8_gemm), and FP8_GEMV_CONFIGS to paste; then
checks of the table's and the swept configs against the reference, and a CUDA graph.
    PYTHONPATH=. python benchmarks/dense_gemv.py --e2e --quantization fp8   # decode, on vs off
"""
import argparse
import itertools
import json
import os
import time

import fp8_rows_sweep
import torch
from awq_gemv import L2_BYTES, copy_bandwidth, graph_us
from dense_gemv import graph_replay_errors
from fp8_rows_sweep import config_line, fp8_linear_graph_errors, fp8_weight, workspace_clean

from tinypaged.kernels import dense_gemv as D
from tinypaged.kernels import fp8, fp8_act
from tinypaged.kernels._triton import cdiv
from tinypaged.models.layers import ColumnParallelLinear
from tinypaged.quantization.fp8 import Fp8Config

SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672),
          ("down", 14336, 4096)]  # Llama-3-8B, (layer, K, N)
KINDS = ("tensor", "channel", "block")


def checks():
    bad = 0
    for dtype in (torch.bfloat16, torch.float16):
        for kind in KINDS:
            # a Llama-3-8B layer, an odd shape, a wide one (the one-row wide tile, a partial
            # last column block)
            for K, N, bias in ((4096, 6144, False), (1000, 1000, True), (4096, D.WIDE_N + 8, True)):
                w, s, block = fp8_weight(N, K, kind)
                b = torch.randn(N, device="cuda", dtype=dtype) if bias else None
                worst, failed = 0.0, bad
                for M in range(1, D.GEMV_MAX_M + 1):
                    x = torch.randn(M, K, device="cuda", dtype=dtype)
                    ref = D.dense_gemv_reference(x.float(), w, None if b is None else b.float(),
                                                 s, block)
                    cfg = D.fp8_gemv_config(M, block, N=N)
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
                                     **D.fp8_gemv_config(M, block, N=N, silu_and_mul=True))
                    err = ((y.float() - ref).norm() / ref.norm()).item()
                    ok = err < 1e-2 and workspace_clean()
                    bad += not ok
                    print(f"  {'ok  ' if ok else 'FAIL'} silu_and_mul input M={M}: {err:.1e}")
    for scheme, M, err in fp8_linear_graph_errors():
        # from 2 rows the linear quantizes x to e4m3 (W8A8 through fp8_rows): against the
        # reference on bf16 x it is held to --sweep-rows' 0.06, one row (W8A16) to 1e-2
        limit = 1e-2 if M == 1 else 0.06
        bad += not err < limit
        print(f"  {'ok  ' if err < limit else 'FAIL'} CUDA graph, FP8 linear {scheme} M={M}: "
              f"{err:.1e}", flush=True)
    return bad


def candidates(M, block, N, silu):
    """Tiles tried by --sweep (the table's config for this shape first)."""
    if M == 1:
        grid = itertools.product((16, 32, 64) if block else (8, 16, 32),
                                 (128,) if block else (256, 512, 1024), (1, 2, 3), (4, 8), (3, 4))
        out = [dict(block_n=n, block_k=k, programs_per_sm=p, num_warps=w, num_stages=st)
               for n, k, p, w, st in grid]
    else:
        grid = itertools.product((32, 64, 128), (128,) if block else (128, 256), (2, 3), (3, 4),
                                 (8, 16))
        out = [dict(block_n=n, block_k=k, programs_per_sm=p, num_stages=st, min_block_m=mb)
               for n, k, p, st, mb in grid if mb >= M]
    return [D.fp8_gemv_config(M, block, N=N, silu_and_mul=silu)] + out


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
                # the down projection's FP8 GEMV forms its input from gate_up, as the models
                # call it (the bf16 column: dense_linear on the formed input)
                silu = layer == "down"
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                xg = torch.randn(M, 2 * K, device="cuda", dtype=torch.bfloat16) if silu else x
                bf16 = graph_us([lambda w=w: D.dense_linear(x, w) for w in dense])

                def w8a8(w):
                    if silu:
                        q, s = fp8_act.silu_and_mul_quant_fp8(xg, 128 if block else None)
                    else:
                        q, s = fp8.quantize_fp8(x, 128 if block else None)
                    return fp8.fp8_gemm(q, s, w[0], w[1], x.dtype, block)

                def gemv(cfg, w):
                    return D.dense_gemv(xg, w[0], None, w[1], block, silu_and_mul=silu, **cfg)

                old = graph_us([lambda w=w: w8a8(w) for w in ws])
                table_cfg = D.fp8_gemv_config(M, block, N=N, silu_and_mul=silu)
                ours = graph_us([lambda w=w: gemv(table_cfg, w) for w in ws])
                best = (ours, "table")
                if sweep and time.time() < deadline:
                    for cfg in candidates(M, block, N, silu)[1:]:
                        try:
                            t = graph_us([lambda w=w: gemv(cfg, w) for w in ws], 20)
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


# --sweep-dot: the w8a8dot mode (dense_gemv quantize_x) --------------------------------------
DOT_MS = (1, 2, 4, 8, 16)
# tiles, most promising first (the sweep stops at its budget): wgmma on e4m3 wants BLOCK_N >=
# 16 * num_warps; the stages of W and of x^T (gate and up with SiLU-and-mul: 2 x BLOCK_K x 16 x
# 2 bytes a stage) within the 227 KiB of shared memory (each compiles for sm_90 on a CPU)
DOT_TILES = [dict(block_n=n, block_k=k, num_warps=w, num_stages=st) for n, k, w, st in (
    (64, 256, 4, 4), (128, 256, 4, 4), (64, 512, 4, 3), (128, 128, 4, 4), (64, 128, 4, 4),
    (128, 256, 8, 3), (64, 512, 8, 3), (64, 256, 8, 3), (128, 128, 8, 4), (128, 256, 4, 3))]
DOT_PROGRAMS = (2, 3, 4)  # programs_per_sm: the split-K depth


def dot_candidates(tiles=slice(None)):
    """The swept configs: DOT_TILES[tiles] x DOT_PROGRAMS."""
    return [dict(t, programs_per_sm=p, quantize_x=True) for t in DOT_TILES[tiles]
            for p in DOT_PROGRAMS]


def dot_setup(layer, K, N, M, ws):
    """(x, silu_and_mul, {"w8a16" | "w8a8": [calls over the weight copies]}): the down
    projection takes gate_up [M, 2K] (silu_and_mul), as the models call it."""
    silu = layer == "down"
    x = torch.randn(M, 2 * K if silu else K, device="cuda", dtype=torch.bfloat16)

    def w8a8(w):
        if silu:
            q, s = fp8_act.silu_and_mul_quant_fp8(x)
        else:
            q, s = fp8.quantize_fp8(x)
        return fp8.fp8_gemm(q, s, w[0], w[1], x.dtype)

    cfg16 = D.fp8_gemv_config(M, None, "w8a16")
    return x, silu, {
        "w8a16": [lambda w=w: D.dense_gemv(x, w[0], None, w[1], silu_and_mul=silu, **cfg16)
                  for w in ws],
        "w8a8": [lambda w=w: w8a8(w) for w in ws]}


def sweep_dot(deadline, cands, ms=DOT_MS):
    """-> {M: {path or candidate index: {layer: us}}}: W8A16, W8A8, then the w8a8dot candidates
    in order, each on every (layer, M), until the deadline."""
    weights = {layer: [fp8_weight(N, K, "channel") for _ in range(max(2, cdiv(3 * L2_BYTES,
                                                                             N * K)))]
               for layer, K, N in SHAPES}
    setups = {(layer, M): dot_setup(layer, K, N, M, weights[layer])
              for layer, K, N in SHAPES for M in ms}
    times = {M: {} for M in ms}
    for (layer, M), (_, _, calls) in setups.items():
        for path, fns in calls.items():
            times[M].setdefault(path, {})[layer] = graph_us(fns, 20)
    print(f"  baselines timed; {deadline - time.time():.0f} s left for the candidates",
          flush=True)
    for i, cfg in enumerate(cands):
        if time.time() > deadline:
            print(f"  budget spent after {i} of {len(cands)} candidates")
            break
        try:
            for (layer, M), (x, silu, _) in setups.items():
                times[M].setdefault(i, {})[layer] = graph_us(
                    [lambda w=w: D.dense_gemv(x, w[0], None, w[1], silu_and_mul=silu, **cfg)
                     for w in weights[layer]], 20)
        except Exception as e:  # noqa: BLE001  (a tile that does not compile or fit)
            print(f"  ({cfg}: {str(e)[:80]})", flush=True)
            for t in times.values():
                t.pop(i, None)
    return times


def best_dot(times_m, cands, block_k=None):
    """The candidate with the least time summed over the four layers (every layer timed), among
    those of BLOCK_K block_k if given (block-wise weights: the scale block's 128)."""
    full = [(sum(t.values()), i) for i, t in times_m.items() if isinstance(i, int)
            and len(t) == len(SHAPES) and (block_k is None or cands[i]["block_k"] == block_k)]
    return (min(full)[0], cands[min(full)[1]]) if full else (None, None)


def dot_table(times, cands, bw):
    """Per M: the best w8a8dot config's GB/s against W8A16 and W8A8, and the table to paste."""
    weight_bytes = sum(N * K for _, K, N in SHAPES)
    print(f"\ncopy bandwidth {bw / 1e9:,.0f} GB/s; GB/s = weight bytes of qkv+o+gate_up+down / "
          "their summed time (CUDA-graph replays, weights from HBM)")
    print("| M | w8a8dot GB/s | % copy | W8A16 GB/s | W8A8 GB/s | vs W8A16 | vs W8A8 | "
          "us qkv/o/gate_up/down | best config |")
    print("|---|---|---|---|---|---|---|---|---|")
    entries = {}
    for M, t in times.items():
        us, cfg = best_dot(t, cands)
        if cfg is None:
            print(f"| {M} | (no config timed on every layer) |")
            continue
        old16, w8a8 = sum(t["w8a16"].values()), sum(t["w8a8"].values())
        i = cands.index(cfg)
        per_layer = "/".join(f"{t[i][layer]:.1f}" for layer, _, _ in SHAPES)
        print(f"| {M} | {weight_bytes / us / 1e3:,.0f} | {weight_bytes / us * 1e6 / bw:.0%} | "
              f"{weight_bytes / old16 / 1e3:,.0f} | {weight_bytes / w8a8 / 1e3:,.0f} | "
              f"{old16 / us:.2f}x | {w8a8 / us:.2f}x | {per_layer} | {cfg} |")
        print(json.dumps(dict(M=M, w8a8dot_us=round(us, 2), w8a16_us=round(old16, 2),
                              w8a8_us=round(w8a8, 2), config=cfg)))
        block_cfg = best_dot(t, cands, block_k=128)[1] or dict(cfg, block_k=128)
        entries[f"w8a8dot_m{M}"] = cfg
        entries[f"w8a8dot_m{M}_block"] = dict(block_cfg, block_n=min(block_cfg["block_n"], 128))
    print("\n# ready to paste into kernels/dense_gemv.py (w8a8dot rows from this sweep; _block:")
    print("# the best BLOCK_K 128 tile, timed on per-channel weights)")
    print("FP8_GEMV_CONFIGS = {")
    print("    **FP8_ONE_ROW_CONFIGS,")  # --sweep-rows prints those
    for key, cfg in {**{k: v for k, v in D.FP8_GEMV_CONFIGS.items()
                        if not k.startswith("w8a8dot") and k not in D.FP8_ONE_ROW_CONFIGS},
                     **entries}.items():
        print(config_line(key, cfg))
    print("}")
    return entries


def dot_checks(swept, ms=DOT_MS, shapes=((4096, 6144), (1000, 1000))):
    """quantize_x on the GPU against its reference (the same per-step quantization): each table
    config on a Llama-3-8B layer and an odd shape, the swept best ({table key: config}) on the
    former, with and without the SiLU-and-mul input; an FP8 linear under
    TINYPAGED_FP8_GEMV=w8a8dot in a CUDA graph; -> number failed."""
    bad = 0
    for kind in KINDS:
        for K, N in shapes:
            w, s, block = fp8_weight(N, K, kind)
            worst, quant_worst, failed = 0.0, 0.0, bad
            for M, silu in itertools.product(ms, (False, True)):
                key = f"w8a8dot_m{M}" + ("_block" if block else "")
                for cfg in [D.fp8_gemv_config(M, block, "w8a8dot")] + (
                        [swept[key]] if key in swept and K == shapes[0][0] else []):
                    x = torch.randn(M, 2 * K if silu else K, device="cuda", dtype=torch.bfloat16)
                    ref = D.dense_gemv_reference(x, w, None, s, block, silu_and_mul=silu, **cfg)
                    full = D.dense_gemv_reference(x.float(), w, None, s, block, silu_and_mul=silu)
                    errs = [((D.dense_gemv(x, w, None, s, block, silu_and_mul=silu, **cfg).float()
                              - ref.float()).norm() / ref.float().norm()).item() for _ in range(3)]
                    quant = ((ref.float() - full).norm() / full.norm()).item()
                    # silu: a last-bit difference of the sigmoid may move an x by a bf16 step,
                    # rarely its e4m3 value or its step's scale
                    ok = max(errs) < (2e-2 if silu else 1e-2) and quant < 0.06 and \
                        workspace_clean()
                    bad += not ok
                    worst, quant_worst = max(worst, *errs), max(quant_worst, quant)
                    if not ok:
                        print(f"  FAIL w8a8dot {kind} {K}x{N} M={M} silu={silu} {cfg}: {errs}, "
                              f"{quant:.1e}")
            print(f"  {'ok  ' if bad == failed else 'FAIL'} w8a8dot {kind:7s} {K}x{N} M "
                  f"{','.join(map(str, ms))}, silu_and_mul or not: vs its reference "
                  f"{worst:.1e}; its x quantization vs fp32 x {quant_worst:.1e}", flush=True)
    os.environ["TINYPAGED_FP8_GEMV"] = "w8a8dot"
    method = Fp8Config.online()
    layer = ColumnParallelLinear(4096, 6144, bias=False, quant_config=method)
    layer.weight.data.normal_(std=0.02)
    method.process_weights_after_loading(layer)
    layer.to("cuda")
    for M, err in graph_replay_errors(layer, lambda x: D.dense_gemv_reference(
            x, layer.weight, None, layer.weight_scale, None,
            **D.fp8_gemv_config(x.shape[0], None, "w8a8dot")).float()):
        bad += not err < 1e-2
        print(f"  {'ok  ' if err < 1e-2 else 'FAIL'} CUDA graph, w8a8dot FP8 linear M={M}: "
              f"{err:.1e}", flush=True)
    os.environ.pop("TINYPAGED_FP8_GEMV")
    return bad


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="also time candidate tiles")
    parser.add_argument("--sweep-dot", action="store_true",
                        help="only the w8a8dot mode: sweep its tiles at M = 1, 2, 4, 8, 16 over "
                             "the Llama-3-8B layers, print the best per M against W8A16 and "
                             "W8A8 and the FP8_GEMV_CONFIGS table (then check the table's)")
    parser.add_argument("--sweep-rows", action="store_true",
                        help="only fp8_rows (2-16 rows) and the one-row w8_words GEMV: checks, "
                             "old vs new per Llama-3-8B layer, a tile sweep, the tables to paste")
    parser.add_argument("--budget", "--budget-s", type=float, default=None,
                        help="seconds from the start after which the sweep stops (default 420; "
                             "--sweep-dot: 50, then the checks; --sweep-rows: 180, checks "
                             "first)")
    parser.add_argument("--tiles", default=":",
                        help="--sweep-dot: a slice of DOT_TILES, e.g. 0:5 or 5: (two runs)")
    parser.add_argument("--dry-run", action="store_true",
                        help="--sweep-dot's or --sweep-rows' grid and printing on made-up "
                             "timings (no GPU)")
    parser.add_argument("--json", help="write every timing here")
    args = parser.parse_args()
    start = time.time()
    if args.sweep_rows:
        fp8_rows_sweep.main(args.budget or 180.0, args.dry_run, args.json)
        return
    if args.sweep_dot:
        cands = dot_candidates(slice(*(int(p) if p else None for p in args.tiles.split(":"))))
        if args.dry_run:
            n = len(SHAPES)
            times = {M: {"w8a16": dict.fromkeys("abcd"[:n], 30.0), "w8a8": dict.fromkeys(
                "abcd"[:n], 40.0), **{i: {layer: 20.0 + i % 7 for layer, _, _ in SHAPES}
                                      for i in range(len(cands))}} for M in DOT_MS}
            print(f"{len(cands)} candidates x {len(DOT_MS)} M x {n} layers")
            dot_table(times, cands, 4.0e12)
            return
        torch.manual_seed(0)
        times = sweep_dot(start + (args.budget or 50.0), cands)
        swept = dot_table(times, cands, copy_bandwidth())
        if args.json:
            with open(args.json, "w") as f:
                json.dump({str(M): {str(k): v for k, v in t.items()} for M, t in times.items()},
                          f, indent=1)
        print(f"\nchecks of the current table (relative error):\n"
              f"{dot_checks(swept)} failed checks; total {time.time() - start:.0f} s")
        return
    torch.manual_seed(0)
    print("checks (relative error vs the fp32 reference):")
    bad = checks()
    rows = []
    table(copy_bandwidth(), args.sweep, rows, start + (args.budget or 420.0))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\n{bad} failed checks; total {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
