# ruff: noqa: B023  (each lambda is timed at once, in its own iteration)
"""benchmarks/fp8_gemv.py --sweep-rows: the FP8 decode kernels of issue 33 on one GPU, in one
command of under 4 minutes (--budget-s bounds the tile sweep).

1. Checks on the GPU: kernels/fp8_rows.py (x already e4m3; W by pointer loads and by TMA, at
   the table's tiles) against fp8_rows_reference for per-tensor, per-channel and block-wise
   [128, 128] weights, M = 1..16, a Llama-3-8B layer and an odd shape; the one-row W8A16 GEMV
   with w8_words (e4m3 bytes to fp32 by integer ops) against dense_gemv_reference and against
   the converting GEMV, with and without the SiLU-and-mul input; three calls each (a moving
   result would be a split-K race), the split-K workspace left zeroed; an FP8 linear at 2, 8
   and 16 rows (W8A8 through fp8_rows, W by pointer loads and by TMA) in a CUDA graph.
2. Timings per Llama-3-8B layer (qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down
   14336->4096, the down projection from gate_up as the models call it), per-channel and block
   weights, CUDA-graph replays over weight copies larger together than 3x the L2:
   - 1 row: the W8A16 GEMV as FP8_GEMV_CONFIGS has it (conversion instructions) against
     w8_words on the same tiles, then tiles with W by TMA (ONE_ROW_TMA_TILES, taken in turn
     with fp8_rows') and w8_words tiles (WORDS_TILES, last), each checked against
     dense_gemv_reference on every layer before it is timed;
   - 2, 4, 8, 16 rows: the W8A8 path, x quantized by its own kernel (quantize_fp8 or
     silu_and_mul_quant_fp8), then fp8_gemm (old) or fp8_rows (new): the product alone and the
     path with its quantization; then fp8_rows tiles until the budget: W by pointer loads
     (ROWS_TILES) and by TMA (w_tma=True: ROWS_TMA_TILES, deeper pipelines, then ROWS_TILES'
     tiles that a descriptor takes), each candidate checked against fp8_rows_reference on
     every layer and M before it is timed (a failing one is reported and skipped).
3. A summary (us per layer, GB/s of FP8 weight bytes over the four layers' summed time, % of
   the copy bandwidth measured in the same run; the best pointer-load and the best TMA tile
   each on a line of their own) and the tables to paste:
   FP8_ROWS_CONFIGS (kernels/fp8_rows.py) and FP8_ONE_ROW_CONFIGS (kernels/dense_gemv.py),
   each printed last under its own name for .gpu/paste.py.
"""
import itertools
import json
import os
import time

import torch
from awq_gemv import L2_BYTES, copy_bandwidth, graph_us
from dense_gemv import graph_replay_errors

from tinypaged.kernels import dense_gemv as D
from tinypaged.kernels import fp8, fp8_act
from tinypaged.kernels import fp8_rows as R
from tinypaged.kernels._triton import cdiv
from tinypaged.kernels.split_k import SPLIT_K_WORKSPACE
from tinypaged.models.layers import ColumnParallelLinear
from tinypaged.quantization.fp8 import Fp8Config

DEV = "cuda"
CHECK_SHAPES = ((4096, 6144), (1024, 1000))  # (K, N): a Llama-3-8B layer, an odd shape
SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672),
          ("down", 14336, 4096)]  # Llama-3-8B, (layer, K, N)
ROWS_MS = (2, 4, 8, 16)
# fp8_rows tiles (block_n, block_k, num_warps, num_stages, programs_per_sm), most promising
# first; wgmma wants block_n >= 16 * num_warps; W's and a^T's stages within 227 KiB of shared
# memory (each compiles for sm_90 on a CPU); block-wise: block_n divides 128, block_k <= 128
ROWS_TILES = {
    "channel": [(64, 256, 4, 4, 2), (128, 256, 4, 4, 2), (64, 512, 4, 3, 2), (64, 256, 4, 4, 3),
                (128, 256, 8, 4, 2), (128, 128, 4, 4, 2), (64, 128, 4, 6, 2), (64, 512, 4, 4, 3),
                (128, 512, 8, 3, 2), (128, 256, 4, 3, 3), (64, 256, 4, 4, 4), (256, 128, 8, 4, 2)],
    "block": [(64, 128, 4, 4, 2), (128, 128, 4, 4, 2), (64, 128, 4, 6, 2), (128, 128, 8, 4, 2),
              (64, 128, 4, 4, 3), (128, 128, 4, 6, 3), (64, 64, 4, 8, 2)],
}
# fp8_rows tiles with W by TMA (w_tma=True), deepest pipelines first: a stage holds a W tile
# (block_n * block_k bytes) and a^T's (16 * block_k), within 227 KiB (boxes <= 256 a side); a
# program this large leaves one a SM, so programs_per_sm 1 (one wave) is tried too
ROWS_TMA_TILES = {
    "channel": [(64, 256, 4, 8, 2), (64, 256, 4, 6, 2), (128, 256, 4, 6, 2), (64, 128, 4, 10, 2),
                (64, 256, 4, 10, 1), (128, 128, 4, 8, 2), (128, 256, 8, 6, 2), (64, 256, 4, 8, 3),
                (128, 128, 4, 12, 1), (64, 128, 4, 8, 4)],
    "block": [(64, 128, 4, 8, 2), (64, 128, 4, 6, 2), (128, 128, 4, 8, 2), (64, 128, 4, 12, 2),
              (128, 128, 8, 8, 2), (64, 128, 4, 10, 1), (64, 128, 4, 8, 3), (128, 128, 4, 12, 1)],
}
# one-row tiles with W by TMA (w_tma=True; block_k <= 256, the box's limit), the W8A16 GEMV
# converting e4m3 on the CUDA cores (block_n, block_k, num_warps, num_stages, programs_per_sm)
ONE_ROW_TMA_TILES = {
    "channel": [(16, 256, 4, 6, 2), (32, 256, 4, 6, 2), (16, 256, 4, 8, 2), (64, 256, 4, 6, 2),
                (16, 256, 4, 3, 2), (16, 128, 4, 8, 2), (32, 256, 8, 8, 2), (16, 256, 4, 6, 3)],
    "block": [(64, 128, 4, 6, 2), (32, 128, 4, 8, 2), (64, 128, 4, 3, 2), (128, 128, 8, 6, 2),
              (64, 128, 4, 8, 3)],
}
# one-row w8_words tiles (block_n, block_k, num_warps, num_stages, programs_per_sm)
WORDS_TILES = {
    "channel": [(16, 512, 4, 3, 2), (16, 1024, 4, 3, 2), (32, 512, 4, 3, 2), (16, 512, 4, 4, 2),
                (16, 512, 8, 3, 2), (16, 512, 4, 3, 3), (32, 1024, 8, 3, 2), (16, 256, 4, 4, 3)],
    "block": [(64, 128, 4, 4, 2), (32, 128, 4, 4, 2), (64, 128, 4, 4, 3), (128, 128, 8, 4, 2)],
}
KEYS = ("block_n", "block_k", "num_warps", "num_stages", "programs_per_sm")


def fp8_weight(N, K, kind, dev=None):
    """(e4m3 weight [N, K], fp32 scale, block) as quantization/fp8.py holds them."""
    dev = dev or DEV
    w = torch.randn(N, K, device=dev) / K**0.5
    if kind == "block":
        s = torch.rand(cdiv(N, 128), cdiv(K, 128), device=dev) * 1e-3 + 1e-4
        full = s.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
        return (w / full).clamp(-448, 448).to(torch.float8_e4m3fn), s, (128, 128)
    s = w.abs().amax(1, keepdim=True) / fp8.FP8_MAX
    if kind == "tensor":
        s = s.max().reshape(1, 1)
    return (w / s).to(torch.float8_e4m3fn), s, None


def quantize(x, block, silu):
    """The W8A8 path's activation quantization: (e4m3 x, scales) per token (group)."""
    group = None if block is None else block[1]
    if silu:
        return fp8_act.silu_and_mul_quant_fp8(x, group)
    return fp8.quantize_fp8(x, group)


def rel(y, ref):
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def workspace_clean():
    """Whether every split-K workspace came back zeroed (as the kernels must leave it); zeroes
    it either way, so one failure does not fail every later check."""
    clean = all(not (p.any() or c.any()) for p, c in SPLIT_K_WORKSPACE.values())
    for p, c in SPLIT_K_WORKSPACE.values():
        p.zero_()
        c.zero_()
    return clean


def report(ok, text):
    print(f"  {'ok  ' if ok else 'FAIL'} {text}", flush=True)
    return not ok


def checks():
    """Part 1 of the module docstring; -> the number of failed checks."""
    bad = 0
    for kind in ("tensor", "channel", "block"):
        for K, N in CHECK_SHAPES:
            w, s, block = fp8_weight(N, K, kind)
            worst, ok = 0.0, True
            for M in range(1, 17):
                q, qs = quantize(torch.randn(M, K, device=DEV, dtype=torch.bfloat16), block,
                                 False)
                ref = R.fp8_rows_reference(q, qs, w, s, torch.bfloat16, block)
                table = R.fp8_rows_config(M, block)  # W by pointer loads and by TMA
                for cfg in (dict(table, w_tma=tma, **split) for tma in (False, True)
                            for split in ({}, dict(split_k=1))):
                    errs = [rel(R.fp8_rows(q, qs, w, s, torch.bfloat16, block, **cfg), ref)
                            for _ in range(3)]
                    ok &= max(errs) < 1e-2 and max(errs) - min(errs) < 1e-3 and workspace_clean()
                    worst = max(worst, *errs)
            bad += report(ok, f"fp8_rows {kind:7s} {K}x{N} M 1..16 (pointer, TMA): max rel err "
                              f"{worst:.1e}")
        for silu in (False, True):  # one row, e4m3 bytes to fp32 by integer ops
            if kind == "tensor":
                continue
            K, N = CHECK_SHAPES[0]
            w, s, block = fp8_weight(N, K, kind)
            x = torch.randn(1, 2 * K if silu else K, device=DEV, dtype=torch.bfloat16)
            cfg = dict(D.fp8_gemv_config(1, block, N=N, silu_and_mul=silu), silu_and_mul=silu)
            ref = D.dense_gemv_reference(x.float(), w, None, s, block, silu_and_mul=silu)
            conv = D.dense_gemv(x, w, None, s, block, **cfg)
            errs = [rel(D.dense_gemv(x, w, None, s, block, w8_words=True, **cfg), ref)
                    for _ in range(3)]
            words = D.dense_gemv(x, w, None, s, block, w8_words=True, **cfg)
            vs_conv = rel(words, conv)
            ok = max(errs) < 1e-2 and max(errs) - min(errs) < 1e-3 and vs_conv < 1e-2 \
                and workspace_clean()
            bad += report(ok, f"w8_words {kind:7s} {K}x{N} M=1 silu_and_mul={silu}: vs fp32 "
                              f"{max(errs):.1e}, vs the converting GEMV {vs_conv:.1e}")
            tma = dict(cfg, block_k=min(cfg.get("block_k", 256), 256), w_tma=True)  # box <= 256
            errs = [rel(D.dense_gemv(x, w, None, s, block, **tma), ref) for _ in range(3)]
            ok = max(errs) < 1e-2 and max(errs) - min(errs) < 1e-3 and workspace_clean()
            bad += report(ok, f"W by TMA {kind:7s} {K}x{N} M=1 silu_and_mul={silu}: vs fp32 "
                              f"{max(errs):.1e}")
    table = dict(R.FP8_ROWS_CONFIGS)
    for tma in (False, True):  # the table's tiles, then the same with W by TMA
        R.FP8_ROWS_CONFIGS.update({key: dict(cfg, w_tma=tma) for key, cfg in table.items()})
        try:
            for scheme, M, err in fp8_linear_graph_errors(sizes=(2, 8, 16)):
                bad += report(err < 0.06, f"CUDA graph, FP8 linear {scheme} M={M} (W8A8 through "
                                          f"fp8_rows, W by {'TMA' if tma else 'pointers'}): vs "
                                          f"bf16 x {err:.1e}")
        finally:
            R.FP8_ROWS_CONFIGS.update(table)
    return bad


def fp8_linear_graph_errors(sizes=(1, 8)):
    """[(weight scheme, M, error)]: an FP8 ColumnParallelLinear 4096 -> 6144 (quantized at load
    per channel; block-wise [128, 128] as a checkpoint holds it) replayed in a CUDA graph at
    each M against its dequantized weight (dense_gemv.graph_replay_errors)."""
    out = []
    for method in (Fp8Config.online(), Fp8Config(weight_scheme="block", block=(128, 128))):
        layer = ColumnParallelLinear(4096, 6144, bias=False, quant_config=method)
        if method.from_dense:
            layer.weight.data.normal_(std=0.02)
        else:
            w, s, _ = fp8_weight(6144, 4096, "block", "cpu")
            layer.weight.data.copy_(w)
            layer.weight_scale_inv.data.copy_(s)
        method.process_weights_after_loading(layer)
        layer.to(DEV)
        deq = method.dequantized_weight(layer)
        errors = graph_replay_errors(layer, lambda x, deq=deq: x.float() @ deq.t(), sizes=sizes)
        out += [(method.weight_scheme, M, err) for M, err in errors]
    return out


def setups(kind, weights):
    """{(layer, M): (x, silu)}: the down projection takes gate_up [M, 2K] (silu), as the
    models call it."""
    out = {}
    for (layer, K, _), M in itertools.product(SHAPES, (1, *ROWS_MS)):
        silu = layer == "down"
        out[layer, M] = (torch.randn(M, 2 * K if silu else K, device=DEV,
                                     dtype=torch.bfloat16), silu)
    return out


def time_kind(kind, deadline, times):
    """Fill times[kind][M][path][layer] (us): the baselines, then candidates until deadline;
    -> (candidates, failed candidate checks)."""
    weights = {layer: [fp8_weight(N, K, kind) for _ in range(max(2, cdiv(3 * L2_BYTES, N * K)))]
               for layer, K, N in SHAPES}
    block = weights[SHAPES[0][0]][0][2]
    xs = setups(kind, weights)
    quantized = {key: quantize(x, block, silu) for key, (x, silu) in xs.items() if key[1] > 1}
    t = times.setdefault(kind, {})

    def put(M, path, layer, us):
        t.setdefault(M, {}).setdefault(path, {})[layer] = us

    def gemv(layer, M, cfg):
        x, silu = xs[layer, M]
        return graph_us([lambda w=w: D.dense_gemv(x, w[0], None, w[1], block, silu_and_mul=silu,
                                                  **cfg) for w in weights[layer]], 20)

    def rows(layer, M, cfg, with_quant):
        x, silu = xs[layer, M]
        q, qs = quantized[layer, M]
        if with_quant:
            return graph_us([lambda w=w: R.fp8_rows(*quantize(x, block, silu), w[0], w[1],
                                                    x.dtype, block, **cfg)
                             for w in weights[layer]], 20)
        return graph_us([lambda w=w: R.fp8_rows(q, qs, w[0], w[1], x.dtype, block, **cfg)
                         for w in weights[layer]], 20)

    for layer, _, N in SHAPES:  # the table's one-row tile of this layer's shape
        one = D.fp8_gemv_config(1, block, N=N, silu_and_mul=xs[layer, 1][1])
        put(1, "convert", layer, gemv(layer, 1, one))
        put(1, "words", layer, gemv(layer, 1, dict(one, w8_words=True)))
        for M in ROWS_MS:
            x, silu = xs[layer, M]
            q, qs = quantized[layer, M]
            cfg = R.fp8_rows_config(M, block)
            put(M, "fp8_gemm", layer, graph_us([lambda w=w: fp8.fp8_gemm(
                q, qs, w[0], w[1], x.dtype, block) for w in weights[layer]], 20))
            put(M, "quant+fp8_gemm", layer, graph_us([lambda w=w: fp8.fp8_gemm(
                *quantize(x, block, silu), w[0], w[1], x.dtype, block)
                for w in weights[layer]], 20))
            put(M, "fp8_rows", layer, rows(layer, M, cfg, False))
            put(M, "quant+fp8_rows", layer, rows(layer, M, cfg, True))
    print(f"  {kind}: baselines timed; {deadline - time.time():.0f} s left for the candidates",
          flush=True)
    cands, refs, failed = candidates(kind), {}, 0
    for i, (what, cfg) in enumerate(cands):
        if time.time() > deadline:
            print(f"  {kind}: budget spent after {i} of {len(cands)} candidates", flush=True)
            break
        try:
            ok = (rows_ok(kind, cfg, weights, quantized, block, refs) if what == "rows"
                  else one_row_ok(kind, cfg, weights, xs, block, refs))
            if not ok:
                failed += 1
                continue
            for layer, _, _ in SHAPES:
                if what != "rows":  # one row: words or TMA
                    put(1, i, layer, gemv(layer, 1, cfg))
                else:
                    for M in ROWS_MS:
                        put(M, i, layer, rows(layer, M, cfg, False))
        except Exception as e:  # noqa: BLE001  (a tile that does not compile or fit)
            print(f"  ({kind} {cfg}: {str(e)[:80]})", flush=True)
            for by_path in t.values():
                by_path.pop(i, None)
    return cands, failed


def one_row_ok(kind, cfg, weights, xs, block, refs):
    """Check a one-row candidate against dense_gemv_reference on every layer (the first weight
    copy; refs caches the references) before it is timed; report it if it fails."""
    worst, ok = 0.0, True
    for layer, _, _ in SHAPES:
        w, s, _ = weights[layer][0]
        x, silu = xs[layer, 1]
        if (layer, 1) not in refs:
            refs[layer, 1] = D.dense_gemv_reference(x.float(), w, None, s, block,
                                                    silu_and_mul=silu)
        err = rel(D.dense_gemv(x, w, None, s, block, silu_and_mul=silu, **cfg), refs[layer, 1])
        ok &= err < 1e-2 and workspace_clean()
        worst = max(worst, err)
    if not ok:
        report(False, f"one-row {kind} candidate {cfg}: max rel err {worst:.1e}; not timed")
    return ok


def rows_ok(kind, cfg, weights, quantized, block, refs):
    """Check an fp8_rows candidate against fp8_rows_reference on every layer and M (the first
    weight copy; refs caches the references) before it is timed; report it if it fails."""
    worst, ok = 0.0, True
    for (layer, _, _), M in itertools.product(SHAPES, ROWS_MS):
        w, s, _ = weights[layer][0]
        q, qs = quantized[layer, M]
        if (layer, M) not in refs:
            refs[layer, M] = R.fp8_rows_reference(q, qs, w, s, torch.bfloat16, block)
        err = rel(R.fp8_rows(q, qs, w, s, torch.bfloat16, block, **cfg), refs[layer, M])
        ok &= err < 1e-2 and workspace_clean()
        worst = max(worst, err)
    if not ok:
        report(False, f"fp8_rows {kind} candidate {cfg}: max rel err {worst:.1e}; not timed")
    return ok


def candidates(kind):
    """[(what, config)]: the fp8_rows tiles by TMA and by pointer loads and the one-row tiles by
    TMA taken in turn, so that a budget cut short still times the first of each, then the
    one-row words tiles (which lost to the conversion at their best tiles)."""
    words = [("words", dict(zip(KEYS, tile), w8_words=True)) for tile in WORDS_TILES[kind]]
    rows = [("rows", dict(zip(KEYS, tile))) for tile in ROWS_TILES[kind]]
    tma = ROWS_TMA_TILES[kind] + [tile for tile in ROWS_TILES[kind]  # the same tiles by TMA
                                  if tile not in ROWS_TMA_TILES[kind] and max(tile[:2]) <= 256]
    tma = [("rows", dict(zip(KEYS, tile), w_tma=True)) for tile in tma]
    one_row = [("one_row", dict(zip(KEYS, tile), w_tma=True)) for tile in ONE_ROW_TMA_TILES[kind]]
    turns = itertools.zip_longest(tma, rows, one_row)
    return [c for turn in turns for c in turn if c is not None] + words


def best(t_m, cands, fallback, keep=lambda cfg: True):
    """(summed us, config) of the candidate fastest over the four layers (timed on all), of
    those whose config `keep` takes."""
    full = [(sum(v.values()), i) for i, v in t_m.items()
            if isinstance(i, int) and len(v) == len(SHAPES) and keep(cands[i][1])]
    if not full:
        return sum(t_m[fallback].values()), None
    us, i = min(full)
    return us, cands[i][1]


def summary(times, cands, bw):
    """The per-layer table and the two tables to paste."""
    weight_bytes = sum(N * K for _, K, N in SHAPES)
    print(f"\ncopy bandwidth {bw / 1e9:,.0f} GB/s; us per call (CUDA-graph replays, weights "
          "from HBM); GB/s = FP8 weight bytes of qkv+o+gate_up+down / their summed time")
    print("| scales | M | path | qkv | o | gate_up | down | sum us | GB/s | % copy | vs old |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows_entries, gemv_entries = {}, {}
    blocks = {"channel": None, "block": (128, 128)}
    for kind, by_m in times.items():
        suffix = "_block" if kind == "block" else ""
        for M, t in sorted(by_m.items()):
            old = "convert" if M == 1 else "fp8_gemm"
            new = "words" if M == 1 else "fp8_rows"
            us_best, cfg = best(t, cands[kind], new)
            paths = [old, new] if M == 1 else [old, new, "quant+fp8_gemm", "quant+fp8_rows"]
            for path in paths:
                per = t[path]
                total = sum(per.values())
                base = sum(t["quant+fp8_gemm" if path.startswith("quant") else old].values())
                print(f"| {kind} | {M} | {path} | " + " | ".join(f"{per[layer]:.1f}" for layer,
                      _, _ in SHAPES) + f" | {total:.1f} | {weight_bytes / total / 1e3:,.0f} | "
                      f"{weight_bytes / total * 1e6 / bw:.0%} | {base / total:.2f}x |")
            if cfg is not None:
                i = next(j for j, c in enumerate(cands[kind]) if c[1] is cfg)
                print(f"| {kind} | {M} | best swept {new} | " + " | ".join(
                    f"{t[i][layer]:.1f}" for layer, _, _ in SHAPES) + f" | {us_best:.1f} | "
                    f"{weight_bytes / us_best / 1e3:,.0f} | "
                    f"{weight_bytes / us_best * 1e6 / bw:.0%} | "
                    f"{sum(t[old].values()) / us_best:.2f}x | {cfg}")
            for variant, tma in (("w8_words" if M == 1 else "pointer", False), ("TMA", True)):
                us_v, cfg_v = best(t, cands[kind], new, lambda c: c.get("w_tma", False) == tma)
                if cfg_v is not None:  # the best of each way to load W, to compare them
                    i = next(j for j, c in enumerate(cands[kind]) if c[1] is cfg_v)
                    what = "one-row GEMV" if M == 1 else new
                    print(f"| {kind} | {M} | best {variant} {what} | " + " | ".join(
                        f"{t[i][layer]:.1f}" for layer, _, _ in SHAPES) + f" | {us_v:.1f} | "
                        f"{weight_bytes / us_v / 1e3:,.0f} | "
                        f"{weight_bytes / us_v * 1e6 / bw:.0%} | "
                        f"{sum(t[old].values()) / us_v:.2f}x | {cfg_v}")
            if M == 1:  # the one-row entries: the table's tiles (one per shape), the same
                # with w8_words, or a swept tile for every shape, whichever is fastest
                options = [(sum(t["convert"].values()), {}),
                           (sum(t["words"].values()), dict(w8_words=True))]
                if cfg is not None:
                    options.append((us_best, cfg))
                won = min(options, key=lambda o: o[0])[1]
                for key, table in D.FP8_ONE_ROW_CONFIGS.items():
                    if won and key.endswith("_block") == bool(suffix):
                        gemv_entries[key] = dict(table, **won) if won.keys() == {"w8_words"} \
                            else won
            else:
                # the table's tile stays unless a swept one beat it (budget cut or noise)
                table = R.fp8_rows_config(M, blocks[kind])
                rows_entries[f"m{M}{suffix}"] = min(
                    [(sum(t[new].values()), table)] + [(us_best, cfg)] * (cfg is not None),
                    key=lambda o: o[0])[1]
    print("\n# fp8_rows tiles from this sweep (kernels/fp8_rows.py)")
    print_table("FP8_ROWS_CONFIGS", {**R.FP8_ROWS_CONFIGS, **rows_entries})
    print("\n# the one-row W8A16 tiles from this sweep (kernels/dense_gemv.py)")
    print_table("FP8_ONE_ROW_CONFIGS", {**D.FP8_ONE_ROW_CONFIGS, **gemv_entries})


def print_table(name, entries):
    print(f"{name} = {{")
    for key, cfg in entries.items():
        print(config_line(key, cfg))
    print("}")


def config_line(key, cfg):
    """`    "key": dict(a=1, ...),` as a tile table in kernels/ holds it (two lines past 100)."""
    args = [f"{k}={v}" for k, v in cfg.items()]
    line = f'    "{key}": dict({", ".join(args)}),'
    if len(line) > 100:
        head = f'    "{key}": dict('
        line = f"{head}{', '.join(args[:4])},\n{' ' * len(head)}{', '.join(args[4:])}),"
    return line


def dry_run():
    """The tables on made-up timings (no GPU): the printing and the paste format."""
    times, cands = {}, {}
    for kind in ("channel", "block"):
        cands[kind] = candidates(kind)
        words = [i for i, (what, _) in enumerate(cands[kind]) if what != "rows"]
        rows = [i for i, (what, _) in enumerate(cands[kind]) if what == "rows"]
        layers = [layer for layer, _, _ in SHAPES]
        times[kind] = {1: {"convert": dict.fromkeys(layers, 30.0),
                           "words": dict.fromkeys(layers, 28.0),
                           **{i: dict.fromkeys(layers, 25.0 + i) for i in words}}}
        for M in ROWS_MS:
            times[kind][M] = {
                path: dict.fromkeys(layers, us) for path, us in (
                    ("fp8_gemm", 40.0), ("fp8_rows", 33.0), ("quant+fp8_gemm", 44.0),
                    ("quant+fp8_rows", 37.0))}
            times[kind][M].update({i: dict.fromkeys(layers, 20.0 + (i * 7 + M) % 11)
                                   for i in rows})
    summary(times, cands, 4.25e12)


def main(budget_s: float, dry: bool = False, json_path: str | None = None) -> None:
    """--sweep-rows: checks, baselines and candidates (until budget_s from the start), tables."""
    if dry:
        dry_run()
        return
    start = time.time()
    torch.manual_seed(0)
    print("checks (relative error):", flush=True)
    bad = checks()
    bw = copy_bandwidth()
    times, cands = {}, {}
    # the per-channel sweep gets two thirds of what is left (Llama-3-8B's FP8 is per channel)
    left = start + budget_s - time.time()
    cands["channel"], failed = time_kind("channel", time.time() + left * 2 / 3, times)
    cands["block"], failed_block = time_kind("block", start + budget_s, times)
    bad += failed + failed_block
    summary(times, cands, bw)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({kind: {str(M): {str(p): v for p, v in t.items()} for M, t in by_m.items()}
                       for kind, by_m in times.items()}, f, indent=1)
    print(f"\n{bad} failed checks; total {time.time() - start:.0f} s "
          f"(TINYPAGED_FP8_ROWS={os.environ.get('TINYPAGED_FP8_ROWS', '1')})")
