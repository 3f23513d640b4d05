"""GGUF block-quantized GEMV on the GPU beside the bf16 linear and the AWQ GEMV, then batch-1
decode of a Llama-3-8B-shape model with Q4_K_M-like weights beside bf16.

1. Checks, then kernels: each GGML type's GEMV (M = 1 and 8) and the prefill path (dequantize
   + cuBLAS, M = 512) against the torch reference of the block layout; then the Llama-3-8B layer
   shapes timed in CUDA graphs over weight copies larger than L2 (awq_gemv.graph_us), beside
   the bf16 F.linear and the AWQ g128 GEMV of the same shape.
2. Tokens: a small random llama with Q4_K_M-like weights generates greedily through the engine
   twice, in float32, with the blocks kept (GEMV / dequantize kernels) and with the same weights
   dequantized to dense float32 at load; the tokens must agree.
3. Decode: `tinypaged bench latency` (512 prompt tokens, 256 out, batch 1 and 8) on the
   Llama-3-8B shape, bf16 (dummy weights) and Q4_K_M-like GGUF blocks (random bytes, finite
   scales: Q4_K everywhere, Q6_K for the LM head and for attn_v / ffn_down of the layers
   llama.cpp's Q4_K_M gives more bits), CUDA graphs on.

    PYTHONPATH=. python benchmarks/gguf_gemv.py            # all of it, ~5 minutes
    PYTHONPATH=. python benchmarks/gguf_gemv.py --only kernels --m 1 --sweep  # GEMV configs
    PYTHONPATH=. python benchmarks/gguf_gemv.py --only kernels --m 8 --dequant  # vs cuBLAS

4. Rows (`--only rows`, not in the default run): 2..64-row decode, gguf_rows.py (each weight
   dequantized once, rows on tensor cores) beside the path DECODE_PATHS takes without
   TINYPAGED_GGUF_ROWS (past 16 rows: dequantize + cuBLAS, the path before gguf_rows took
   them) and beside bf16 (the engine's dense_linear and cuBLAS), for M = 1, 2, 4, 8, 16
   (--rows-m) on the Llama-3-8B layer shapes (--shapes; smol_* the default model's);
   --sweep-rows times gguf_rows' tile grid at --sweep-m rows instead (summed over a layer of
   --sweep-layer) and prints kernels/gguf.py's ROWS_CONFIGS table:

    PYTHONPATH=. python benchmarks/gguf_gemv.py --only rows --types Q4_K Q6_K --no-awq
    PYTHONPATH=. python benchmarks/gguf_gemv.py --only rows --sweep-rows --sweep-m 8 16

5. Sub-block products (`--only subdot`, not in the default run): gguf_subdot.py on Q4_K (its
   one type; other --types are skipped). Checks it against the reference, sweeps
   --subdot-configs at --sweep-m rows (default 8; summed over a layer's linears, half of
   --budget-s at most) and prints kernels/gguf.py's SUBDOT_CONFIGS table, then times the
   fastest beside gguf_rows (ROWS_CONFIGS) and bf16 (dense_linear) at --subdot-m rows (default
   8 4 16), per layer, in CUDA graphs:

    PYTHONPATH=. python benchmarks/gguf_gemv.py --only subdot --budget-s 200
"""
import argparse
import contextlib
import gc
import itertools
import json
import os
import tempfile
import textwrap
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from awq_gemv import L2_BYTES, awq_weights, copy_bandwidth, gemv, graph_us

from tinypaged.bench import offline as bench
from tinypaged.kernels import gguf
from tinypaged.kernels._triton import cdiv
from tinypaged.kernels.dense_gemv import dense_linear
from tinypaged.kernels.gguf_format import GGML_TYPES, row_bytes
from tinypaged.kernels.gguf_mma import MMA_TYPES, gguf_mma
from tinypaged.kernels.gguf_rows import gguf_rows
from tinypaged.kernels.gguf_subdot import gguf_subdot, subdot_supported
from tinypaged.models import loader
from tinypaged.quantization import gguf as gguf_layers

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
          "down": (14336, 4096), "lm_head": (4096, 128256),  # name -> (K, N)
          # the default model's layers (SmolLM2-135M, Q4_1): --shapes smol_qkv ... smol_down
          "smol_qkv": (576, 960), "smol_o": (576, 576), "smol_gate_up": (576, 3072),
          "smol_down": (1536, 576)}
TYPES = {"Q4_K": 12, "Q6_K": 14, "Q5_K": 13, "Q8_0": 8, "Q4_0": 2, "Q4_1": 3}
FP16_FIELDS = {2: (0,), 3: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}
SCALE = {2: 5e-3, 3: 5e-3, 8: 5e-4, 12: 4e-4, 13: 2e-4, 14: 6e-5}  # weights of ~0.05
# --sweep: (block_n, num_warps, num_stages) of the GEMV (--configs picks others)
SWEEP = ["64/2/1/p", "32/2/1/p", "32/2/1", "64/4/1/p", "16/2/1/p", "32/2/2"]
DEVICE = "cuda"  # of the checks' tensors (a CPU test of kernel_bench.py's wiring sets "cpu")
X_DTYPE = torch.bfloat16  # of the rows stage's x (a CPU run under the interpreter: fp16)


def random_rows(type_id: int, N: int, K: int) -> torch.Tensor:
    """File rows uint8 [N, row_bytes] on the GPU: random quants, fp16 fields in [0, SCALE)."""
    t = GGML_TYPES[type_id]
    nb = K // t.block_elems
    blocks = torch.randint(0, 256, (N, nb, t.block_bytes), dtype=torch.uint8, device=DEVICE)
    for off in FP16_FIELDS[type_id]:
        field = (torch.rand(N, nb, 1, device=DEVICE) * SCALE[type_id]).half()
        blocks[..., off : off + 2] = field.view(torch.uint8)
    return blocks.reshape(N, -1)


def random_qweight(type_id: int, N: int, K: int) -> torch.Tensor:
    """random_rows in the kernels' device layout."""
    return gguf.to_device_layout(random_rows(type_id, N, K), type_id, K)


@contextlib.contextmanager
def rows_off():
    """TINYPAGED_GGUF_ROWS=0 inside (DECODE_PATHS' choice), as it was after."""
    before = os.environ.get("TINYPAGED_GGUF_ROWS")
    os.environ["TINYPAGED_GGUF_ROWS"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TINYPAGED_GGUF_ROWS"]
        else:
            os.environ["TINYPAGED_GGUF_ROWS"] = before


def run(x, qweight, type_id, config):
    if config.get("rows") is not None:  # gguf_rows with these tiles
        return gguf_rows(x, qweight, type_id, **config["rows"])
    if config.get("subdot") is not None:  # gguf_subdot with these settings
        return gguf_subdot(x, qweight, type_id, **config["subdot"])
    if config.get("old"):  # what gguf_linear runs without TINYPAGED_GGUF_ROWS
        with rows_off():
            return gguf.gguf_linear(x, qweight, type_id)
    if config.get("mma"):
        return gguf_mma(x, qweight, type_id, block_n=config["block_n"],
                        num_warps=config["num_warps"], xs_dot=config["xs_dot"])
    if x.shape[0] <= gguf.GEMV_MAX_M and not config.get("dequant"):
        return gguf.gguf_gemv(x, qweight, type_id, **config)
    return x @ gguf.gguf_dequantize(qweight, type_id, x.shape[1], x.dtype).T


def check(x, qweight, type_id, config=None, ref=None):
    """Relative error against the fp32 reference, twice (the split-K workspace is re-zeroed)."""
    if ref is None:
        ref = x.float() @ gguf.dequantize_reference(qweight, type_id, x.shape[1]).T
    for _ in range(2):
        y = run(x, qweight, type_id, config or {})
        err = ((y.float() - ref).norm() / ref.norm()).item()
        assert torch.isfinite(y).all() and err < 1e-2, (type_id, config, err)
    return err


CHECK_SHAPES = ["4096x4096", "2048x1000"]  # the o shape and a ragged N


def checks(types, ms, shapes=CHECK_SHAPES):
    """Every (name, type id) of `types` and M of `ms` against the reference on `shapes`."""
    for (tname, type_id), M in itertools.product(types, ms):
        for K, N in (map(int, shape.split("x")) for shape in shapes):
            print(f"check {tname} M={M} {K}x{N}: ", end="", flush=True)
            x = torch.randn(M, K, device=DEVICE).bfloat16()
            err = check(x, random_qweight(type_id, N, K), type_id)
            print(f"rel. error {err:.1e} ok", flush=True)


def kernels(args, deadline):
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    print("| layer | K x N | type | M | config | bf16 us | AWQ g128 us | GGUF us | vs bf16 | "
          "GGUF GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, M in itertools.product(args.shapes, args.m):
        K, N = SHAPES[name]
        x = torch.randn(M, K, device="cuda").bfloat16()
        dense = [torch.randn(N, K, device="cuda").bfloat16()
                 for _ in range(max(2, cdiv(3 * L2_BYTES, 2 * N * K)))]
        base = graph_us([lambda w=w, x=x: F.linear(x, w) for w in dense], reps=20)
        del dense
        awq_t = "-"
        if M <= 16 and name != "lm_head" and args.awq:
            aw = awq_weights(K, N, max(2, cdiv(3 * L2_BYTES, K * N // 2)))
            awq_t = f"{graph_us([lambda w=w, x=x: gemv(x, w) for w in aw], reps=20):.1f}"
            del aw
        for tname, type_id in args.types:
            if time.time() > deadline:
                print("(time budget spent: stopping)")
                return
            nbytes = N * row_bytes(type_id, K)
            weights = [random_qweight(type_id, N, K)
                       for _ in range(max(2, cdiv(3 * L2_BYTES, nbytes)))]
            configs = [None]
            if args.sweep and M in args.sweep_m and tname in args.sweep_types:
                for c in args.configs:  # block_n/warps/stages, /p: prefetch, /a: asm
                    if "/a" in c and type_id != 14:  # Q6_K's only
                        continue
                    b, w, st = map(int, c.split("/")[:3])
                    configs.append(dict(block_n=b, num_warps=w, num_stages=st,
                                        prefetch="/p" in c, asm="/a" in c))
            if M > 1 and M <= gguf.GEMV_MAX_M and args.dequant:  # batched: dequantize + cuBLAS
                configs.append(dict(dequant=True))
            if M > 1 and type_id in MMA_TYPES:  # batched: tensor cores (block_n/warps)
                for c in args.mma:  # block_n/warps[/d]: d, sums of x by a product
                    b, w = map(int, c.split("/")[:2])
                    configs.append(dict(mma=True, block_n=b, num_warps=w, xs_dot="/d" in c))
            ref = None
            for config in configs:
                if time.time() > deadline:
                    break
                if ref is None:
                    ref = x.float() @ gguf.dequantize_reference(weights[0], type_id, K).T
                try:
                    check(x, weights[0], type_id, config, ref)
                except AssertionError as error:
                    print(f"| {name} | {K}x{N} | {tname} | {M} | {config} | CHECK FAILED: "
                          f"{error} |", flush=True)
                    continue
                t = graph_us([lambda w=w, x=x, t=type_id, c=config: run(x, w, t, c or {})
                              for w in weights], reps=20)
                label = ("default" if config is None else "dequant+cuBLAS" if "dequant" in config
                         else f"mma {config['block_n']}/{config['num_warps']}w"
                         + ("/d" if config["xs_dot"] else "") if "mma" in config
                         else f"{config['block_n']}/{config['num_warps']}w/{config['num_stages']}s"
                         + ("/p" if config["prefetch"] else "") + ("/a" if config["asm"] else ""))
                print(f"| {name} | {K}x{N} | {tname} | {M} | {label} | {base:.1f} | {awq_t} | "
                      f"{t:.1f} | {base / t:.2f}x | {nbytes / t / 1e3:.0f} |", flush=True)
            del weights, ref


# block_n/warps/stages[/programs per SM][/a: PTX nibbles, the 4-bit types only]
ROWS_SWEEP = ["64/4/2", "64/4/2/a", "32/4/2/a", "64/4/3/a", "128/4/2/a", "128/8/2/a",
              "64/4/2/2/a"]
ROWS_SHAPES = ["qkv", "o", "gate_up", "down"]  # a layer's linears, summed by --sweep-rows
# --sweep-layer smol: the default model's (SmolLM2-135M) instead
LAYERS = {"llama3-8b": ROWS_SHAPES, "smol": [f"smol_{name}" for name in ROWS_SHAPES]}


def weight_copies(type_id, N, K):
    """Enough random qweights (device layout) to stream past L2 between calls."""
    nbytes = N * row_bytes(type_id, K)
    return [random_qweight(type_id, N, K) for _ in range(max(2, cdiv(3 * L2_BYTES, nbytes)))]


def timed(x, weights, type_id, config, w_ref=None):
    """us per call in a CUDA graph, after a check against the reference (None: it failed);
    w_ref: weights[0] dequantized in fp32, if at hand."""
    if w_ref is None:
        w_ref = gguf.dequantize_reference(weights[0], type_id, x.shape[1])
    try:
        check(x, weights[0], type_id, config, x.float() @ w_ref.T)
    except AssertionError as error:
        print(f"CHECK FAILED {type_id} M={x.shape[0]} {config}: {error}", flush=True)
        return None
    return graph_us([lambda w=w: run(x, w, type_id, config) for w in weights], reps=20)


def fmt_us(t):
    return "FAILED" if t is None else f"{t:.1f}"


def speedup(base, t):
    return "-" if t is None else f"{base / t:.2f}x"


def rows_table(args, deadline):
    """gguf_rows (ROWS_CONFIGS' tiles) vs the old path vs bf16, per layer, type and M."""
    print(f"copy bandwidth {copy_bandwidth() / 1e12:.2f} TB/s")
    print("| layer | K x N | type | M | old path | old us | rows us | bf16 us (dense_linear / "
          "cuBLAS) | rows vs bf16 | old vs bf16 | rows GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.shapes:
        K, N = SHAPES[name]
        xs = {M: torch.randn(M, K, device=DEVICE).to(X_DTYPE) for M in args.rows_m}
        dense = [torch.randn(N, K, device=DEVICE).to(X_DTYPE)
                 for _ in range(max(2, cdiv(3 * L2_BYTES, 2 * N * K)))]
        bf16 = {M: (graph_us([lambda w=w, x=x: dense_linear(x, w) for w in dense], reps=20),
                    graph_us([lambda w=w, x=x: F.linear(x, w) for w in dense], reps=20))
                for M, x in xs.items()}
        del dense
        for tname, type_id in args.types:
            weights = weight_copies(type_id, N, K)  # once per layer and type, for every M
            w_ref = gguf.dequantize_reference(weights[0], type_id, K)
            for M, x in xs.items():
                if time.time() > deadline:
                    print("(time budget spent: stopping)")
                    return
                with rows_off():
                    path = gguf.decode_path(type_id, K, M)
                if M > 16:  # before gguf_rows took verification sizes: dequantize + cuBLAS
                    path = None
                old = timed(x, weights, type_id, dict(old=M <= 16, dequant=M > 16), w_ref)
                new = timed(x, weights, type_id, dict(rows=gguf.rows_config(type_id, M)), w_ref)
                ours, cublas = bf16[M]
                gbs = "-" if new is None else f"{N * row_bytes(type_id, K) / new / 1e3:.0f}"
                print(f"| {name} | {K}x{N} | {tname} | {M} | "
                      f"{path[0] if path else 'dequant+cuBLAS'} | {fmt_us(old)} | {fmt_us(new)} "
                      f"| {ours:.1f} / {cublas:.1f} | {speedup(ours, new)} | "
                      f"{speedup(ours, old)} | {gbs} |", flush=True)
            del weights, w_ref


def rows_sweep(args, deadline):
    """gguf_rows' tiles (block_n/warps/stages[/programs per SM][/a]) per type and M, summed over a
    layer's linears; prints the fastest as kernels/gguf.py's ROWS_CONFIGS."""
    def configs_of(type_id):
        """(label, gguf_rows keyword arguments) of --rows-configs for a type: /a (PTX nibbles)
        only applies to the 4-bit types, elsewhere it is dropped and repeats are skipped."""
        configs = {}
        for c in args.rows_configs:
            asm = c.endswith("/a") and type_id in (2, 3, 12, 13)
            b, w, st, *pps = map(int, c.removesuffix("/a").split("/"))
            config = dict(block_n=b, num_warps=w, num_stages=st,
                          **({"programs_per_sm": pps[0]} if pps else {}),
                          **({"asm": True} if asm else {}))
            label = c if asm or not c.endswith("/a") else c.removesuffix("/a")
            configs.setdefault(label, config)
        return list(configs.items())

    best, layer = {}, LAYERS[args.sweep_layer]
    print("| type | M | block_n/warps/stages[/pps][/a] | " + " | ".join(layer)
          + " | layer us |")
    print("|---|---|---|" + "---|" * len(layer) + "---|")
    for (tname, type_id), M in itertools.product(args.types, args.sweep_m):
        configs = configs_of(type_id)
        per_shape = {label: [] for label, _ in configs}
        for name in layer:
            K, N = SHAPES[name]
            x = torch.randn(M, K, device=DEVICE).to(X_DTYPE)
            weights = weight_copies(type_id, N, K)
            w_ref = gguf.dequantize_reference(weights[0], type_id, K)
            for label, config in configs:
                if time.time() > deadline:
                    print("(time budget spent: stopping)")
                    break
                t = timed(x, weights, type_id, dict(rows=config), w_ref)
                per_shape[label].append(t if t is not None else float("inf"))
            del weights, w_ref
        totals = {}
        for label, _ in configs:
            if len(per_shape[label]) == len(layer):
                totals[label] = sum(per_shape[label])
                print(f"| {tname} | {M} | {label} | "
                      + " | ".join(f"{t:.1f}" for t in per_shape[label])
                      + f" | {totals[label]:.1f} |", flush=True)
        if totals:
            best[(type_id, M)] = dict(configs)[min(totals, key=totals.get)]
    print("\n# kernels/gguf.py (fastest summed over qkv, o, gate_up, down at each swept M; "
          "each M covers the rows up to it)")
    print("ROWS_CONFIGS: dict[int, tuple[tuple[int, dict], ...]] = {")
    for tname, type_id in args.types:
        rows = [f"        ({M}, dict({', '.join(f'{k}={v}' for k, v in config.items())})),"
                for M in sorted(args.sweep_m) if (config := best.get((type_id, M)))]
        if rows:
            print(f"    {type_id}: (  # {tname}\n" + "\n".join(rows) + "\n    ),")
    print("}")


# gguf_subdot: block_n/warps/stages[/programs per SM] then flags: a (PTX quants), j (one
# product a super-block). 64 rows and 4+ warps take wgmma, 32 rows the m16n8k16 MMA. The first
# ones are the likeliest (the sweep may run out of time)
SUBDOT_SWEEP = ["64/4/3/a/j", "64/4/3/a", "128/8/3/a/j", "128/4/3/a", "32/2/3/a",
                "64/4/3/8/a/j", "64/4/4/a/j", "64/4/3/j"]
SUBDOT_CHECKS = ["64/4/3/a", "64/4/3/a/j"]  # checked at 3, 8 and 16 rows first


def subdot_configs(labels):
    """(label, gguf_subdot keyword arguments) of sweep labels, repeats dropped."""
    configs = {}
    for label in labels:
        parts = label.split("/")
        nums = [int(p) for p in parts if p.isdigit()]
        flags = {p for p in parts if not p.isdigit()}
        if not flags <= {"a", "j"}:
            raise SystemExit(f"subdot config {label!r}: flags are a (PTX quants) and j (one "
                             f"product a super-block); got {sorted(flags - {'a', 'j'})}")
        config = dict(block_n=nums[0], num_warps=nums[1], num_stages=nums[2],
                      **({"programs_per_sm": nums[3]} if len(nums) > 3 else {}),
                      asm="a" in flags, join="j" in flags)
        configs.setdefault(label, config)
    return list(configs.items())


def subdot_config_line(max_m, config):
    """A row of SUBDOT_CONFIGS: gguf_subdot's arguments that differ from its defaults (the
    tiles always), wrapped at 100 columns."""
    defaults = dict(asm=False, join=False)
    items = [f"{k}={v}" for k, v in config.items() if k not in defaults or v != defaults[k]]
    line = f"        ({max_m}, dict({', '.join(items)})),"
    if len(line) <= 100:
        return line
    return (f"        ({max_m}, dict(\n" + textwrap.fill(
        ", ".join(items), 96, initial_indent=" " * 12, subsequent_indent=" " * 12) + ")),")


def subdot_stage(args, deadline):
    """gguf_subdot (the --types it takes: Q4_K): checks, a tile sweep (prints SUBDOT_CONFIGS),
    then a per-layer table beside gguf_rows and bf16."""
    types = [(tname, type_id) for tname, type_id in args.types if subdot_supported(type_id, 256)]
    if not types:
        print("subdot: gguf_subdot takes Q4_K only; none of --types is Q4_K")
        return
    start = time.time()
    sweep_deadline = start + (deadline - start) / 2
    for (tname, type_id), M in itertools.product(types, (3, 8, 16)):
        for K, N in (map(int, shape.split("x")) for shape in CHECK_SHAPES):
            x = torch.randn(M, K, device=DEVICE).to(X_DTYPE)
            qweight = random_qweight(type_id, N, K)
            for label, config in subdot_configs(SUBDOT_CHECKS):
                try:
                    err = check(x, qweight, type_id, dict(subdot=config))
                    print(f"check subdot {tname} M={M} {K}x{N} {label}: rel. error {err:.1e} "
                          "ok", flush=True)
                except AssertionError as error:  # the timings below skip failing configs
                    print(f"CHECK FAILED subdot {tname} M={M} {K}x{N} {label}: {error}",
                          flush=True)
    weights, refs = {}, {}

    def weights_of(type_id, name):  # random copies past L2 and the first one dequantized
        if (type_id, name) not in weights:
            K, N = SHAPES[name]
            weights[type_id, name] = weight_copies(type_id, N, K)
            refs[type_id, name] = gguf.dequantize_reference(weights[type_id, name][0],
                                                            type_id, K)
        return weights[type_id, name], refs[type_id, name]

    best = {}
    print("| type | M | subdot block_n/warps/stages[/pps]/flags | " + " | ".join(ROWS_SHAPES)
          + " | layer us |")
    print("|---|---|---|" + "---|" * len(ROWS_SHAPES) + "---|")
    combos = list(itertools.product(types, args.sweep_m))
    for n, ((tname, type_id), M) in enumerate(combos):
        # each type and M gets an equal share of what is left of the sweep's time
        combo_deadline = time.time() + (sweep_deadline - time.time()) / (len(combos) - n)
        configs = subdot_configs(args.subdot_configs)
        totals = {}
        for label, config in configs:
            if time.time() > combo_deadline:
                print(f"(sweep budget of {tname} M={M} spent: stopping)")
                break
            times = []
            for name in ROWS_SHAPES:
                K, _ = SHAPES[name]
                x = torch.randn(M, K, device=DEVICE).to(X_DTYPE)
                ws, w_ref = weights_of(type_id, name)
                t = timed(x, ws, type_id, dict(subdot=config), w_ref)
                times.append(float("inf") if t is None else t)
            totals[label] = sum(times)
            print(f"| {tname} | {M} | {label} | " + " | ".join(f"{t:.1f}" for t in times)
                  + f" | {totals[label]:.1f} |", flush=True)
        if totals and min(totals.values()) < float("inf"):
            label = min(totals, key=totals.get)
            best[type_id, M] = label, dict(configs)[label]
    print("\n# kernels/gguf.py (fastest summed over qkv, o, gate_up, down at each swept M; "
          "each M covers the rows up to it, the last up to 16)")
    print("SUBDOT_CONFIGS: dict[int, tuple[tuple[int, dict], ...]] = {")
    for tname, type_id in types:
        swept = [M for M in sorted(args.sweep_m) if (type_id, M) in best]
        rows = [subdot_config_line(16 if M == swept[-1] else M, best[type_id, M][1])
                for M in swept]
        if rows:
            print(f"    {type_id}: (  # {tname}\n" + "\n".join(rows) + "\n    ),")
    print("}")

    def subdot_of(type_id, M):  # this sweep's fastest at the nearest swept M, else the table's
        swept = sorted(m for t, m in best if t == type_id)
        for max_m in swept:
            if M <= max_m:
                return best[type_id, max_m]
        if swept:
            return best[type_id, swept[-1]]
        return "SUBDOT_CONFIGS", gguf.subdot_config(type_id, M)

    print("\nus per call (CUDA graph replays): subdot / gguf_rows / bf16 dense_linear")
    print("| type | M | " + " | ".join(ROWS_SHAPES) + " | layer subdot | layer rows | "
          "layer bf16 | subdot vs bf16 | rows vs bf16 | subdot config |")
    print("|---|---|" + "---|" * len(ROWS_SHAPES) + "---|---|---|---|---|---|")
    bf16 = {}
    for (tname, type_id), M in itertools.product(types, args.subdot_m):
        cells, sums = [], [0.0, 0.0, 0.0]
        label, config = subdot_of(type_id, M)
        for name in ROWS_SHAPES:
            if time.time() > deadline:
                print("(time budget spent: stopping)")
                return
            K, N = SHAPES[name]
            x = torch.randn(M, K, device=DEVICE).to(X_DTYPE)
            if (name, M) not in bf16:
                dense = [torch.randn(N, K, device=DEVICE).to(X_DTYPE)
                         for _ in range(max(2, cdiv(3 * L2_BYTES, 2 * N * K)))]
                bf16[name, M] = graph_us([lambda w=w, x=x: dense_linear(x, w) for w in dense],
                                         reps=20)
                del dense
            ws, w_ref = weights_of(type_id, name)
            sub = timed(x, ws, type_id, dict(subdot=config), w_ref)
            rows = timed(x, ws, type_id, dict(rows=gguf.rows_config(type_id, M)), w_ref)
            ts = (sub, rows, bf16[name, M])
            cells.append(" / ".join(fmt_us(t) for t in ts))
            sums = [a + (float("inf") if t is None else t) for a, t in zip(sums, ts)]
        print(f"| {tname} | {M} | " + " | ".join(cells) + f" | {sums[0]:.1f} | {sums[1]:.1f} "
              f"| {sums[2]:.1f} | {speedup(sums[2], sums[0])} | {speedup(sums[2], sums[1])} | "
              f"{label} |", flush=True)


def q4_k_m_type(name: str, num_layers: int) -> int:
    """llama.cpp's Q4_K_M choice, roughly: Q6_K for the LM head and for attn_v / ffn_down of the
    first and last eighth of the layers and every third layer between, Q4_K elsewhere."""
    if name == "lm_head.weight":
        return 14
    if ".v_proj." in name or ".down_proj." in name:
        i = int(name.split(".")[2])
        eighth = num_layers // 8
        more_bits = i < eighth or i >= 7 * eighth or (i - eighth) % 3 == 2
        return 14 if more_bits else 12
    return 12


def q4_k_m_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of every matrix of a llama model of config `cfg`."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter)})
    return shapes


def q4_k_m_bytes(cfg: dict) -> int:
    """Packed bytes of those matrices in the Q4_K_M-like types (the embedding table counted
    whole, as `tinypaged bench` counts it)."""
    layers = cfg["num_hidden_layers"]
    return sum(N * row_bytes(q4_k_m_type(name, layers), K)
               for name, (N, K) in q4_k_m_shapes(cfg).items())


def random_gguf_weights(cfg: dict, dequantize: bool = False):
    """What gguf_weights yields for a model of config `cfg`, with random Q4_K_M-like blocks."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    shapes = q4_k_m_shapes(cfg)
    gen = torch.Generator(device="cuda").manual_seed(0)
    torch.manual_seed(0)
    for name, (N, K) in shapes.items():
        type_id = q4_k_m_type(name, layers)
        data = random_rows(type_id, N, K)
        if dequantize:
            yield name, gguf.gguf_dequantize(gguf.to_device_layout(data, type_id, K), type_id, K)
        else:
            yield name, gguf_layers.GGUFWeight(type_id, data, (N, K))
    for i in range(layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            yield f"model.layers.{i}.{norm}.weight", 1 + 0.1 * torch.rand(h, generator=gen,
                                                                          device="cuda")
    yield "model.norm.weight", torch.ones(h, device="cuda")


def gguf_model_dir(cfg: dict, quantized: bool) -> str:
    path = Path(tempfile.mkdtemp(prefix="tinypaged-gguf-bench-"))
    config = {**cfg, "torch_dtype": "bfloat16"}
    if quantized:
        config["quantization_config"] = {"quant_method": "gguf"}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def patched_weights(cfg: dict, dequantize: bool = False):
    loader.iterate_weights = lambda model_dir, sliced=False: random_gguf_weights(cfg, dequantize)


def same_tokens():
    from tinypaged import LLM, SamplingParams

    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=1024,
               intermediate_size=2048, num_hidden_layers=4, num_attention_heads=16,
               num_key_value_heads=4, head_dim=64, vocab_size=4096, tie_word_embeddings=False,
               max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0)
    # 6 sequences: decode steps of 6 rows run the tensor-core path (DECODE_PATHS)
    prompts = [{"prompt_token_ids": [(i * 37 + j * 11) % 4000 + 5 for j in range(40 + 30 * i)]}
               for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = []
    for quantized in (True, False):
        patched_weights(cfg, dequantize=not quantized)
        # eager: a correctness check, which need not compile the GEMV for every graph bucket;
        # float32: in bf16 the dense copy's weights are rounded to 8 bits and random-model
        # greedy tokens part within ~10 steps (seen on the H200), which tests nothing
        llm = LLM(gguf_model_dir(cfg, quantized), skip_tokenizer_init=True, max_model_len=512,
                  gpu_memory_utilization=0.3, max_num_seqs=len(prompts), enforce_eager=True,
                  dtype="float32")
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.shutdown()
        del llm
        free_gpu()
    same = sum(a == b for a, b in zip(*outs))
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
             for a, b in zip(*outs)]
    print(f"greedy tokens (float32), Q4_K_M blocks vs the same weights dequantized: "
          f"{same}/{len(prompts)} sequences identical; first difference at {first}")
    return same == len(prompts)


def free_gpu():
    """Free an engine that went out of scope: its runner and CUDA graphs reference each other, so
    only a collection frees its KV cache (without one the next engine found the GPU full)."""
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    print(f"GPU memory free: {free / 2**30:.1f} of {total / 2**30:.1f} GiB", flush=True)


def decode(args):
    """bench latency of the GGUF blocks (first: it is what this measures; --rows-ab: with
    TINYPAGED_GGUF_ROWS=0, then 1), then bf16."""
    cfg = bench.SHAPES["llama3-8b"]
    # each engine takes 40% of the GPU for weights and KV cache: both fit even side by side
    batches = [str(b) for b in args.batch_sizes]
    argv = ["latency", "--batch-sizes", *batches, "--max-num-seqs", str(max(args.batch_sizes)),
            "--gpu-memory-utilization", "0.4", "--output-len", str(args.output_len)]
    runs = {}
    for rows in ("0", "1") if args.rows_ab else (None,):
        before = os.environ.get("TINYPAGED_GGUF_ROWS")
        if rows is not None:  # read when the engine runs (and captures its graphs)
            os.environ["TINYPAGED_GGUF_ROWS"] = rows
        original = loader.iterate_weights
        patched_weights(cfg)
        label = "GGUF" if rows is None else f"GGUF ROWS={rows}"
        runs[label] = bench.main(argv + ["--model-shape", gguf_model_dir(cfg, quantized=True)])
        loader.iterate_weights = original
        if before is None:
            os.environ.pop("TINYPAGED_GGUF_ROWS", None)
        else:
            os.environ["TINYPAGED_GGUF_ROWS"] = before
        free_gpu()
    bf16 = bench.main(argv + ["--model-shape", "llama3-8b"])
    packed = q4_k_m_bytes(cfg)
    print(f"\n| Llama-3-8B shape, decode | bf16 tok/s | Q4_K_M-like tok/s | speed-up | "
          f"GGUF weights GB/s ({packed / 1e9:.2f} GB a step) |")
    print("|---|---|---|---|---|")
    for batch in args.batch_sizes:
        a = bf16[batch]["tok_s_per_seq"]
        for label, q in runs.items():
            b = q[batch]["tok_s_per_seq"]
            print(f"| batch {batch} (per sequence), {label} | {a:.1f} | {b:.1f} | {b / a:.2f}x | "
                  f"{packed * b / 1e9:,.0f} |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="block_n / warps / stages")
    parser.add_argument("--sweep-types", nargs="+", default=["Q4_K"])
    parser.add_argument("--sweep-m", type=int, nargs="+",
                        help="rows of x of the sweeps (default: 1; --sweep-rows: 8 16)")
    parser.add_argument("--configs", nargs="+", default=SWEEP,
                        help="block_n/warps/stages[/p][/a]: /p prefetches the next step, "
                        "/a: Q6_K's PTX byte permutes")
    parser.add_argument("--mma", nargs="*", default=["64/4", "128/8"],
                        help="gguf_mma configs (block_n/warps) timed at M > 1")
    parser.add_argument("--dequant", action="store_true",
                        help="also time dequantize + cuBLAS at 1 < M <= 8")
    parser.add_argument("--m", type=int, nargs="+", default=[1, 8, 512], help="rows of x")
    parser.add_argument("--check-m", type=int, nargs="+", help="rows of x of the checks")
    parser.add_argument("--check-shapes", nargs="+", default=CHECK_SHAPES,
                        help="KxN of the checks")
    parser.add_argument("--types", nargs="+", choices=list(TYPES),
                        help="GGML types (default: all; rows: the k-quants and Q8_0)")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES),
                        default=[s for s in SHAPES if not s.startswith("smol_")])
    parser.add_argument("--no-awq", dest="awq", action="store_false")
    parser.add_argument("--budget-s", type=float, default=1e9,
                        help="stop timing kernels after this many seconds")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8],
                        help="decode batch sizes")
    parser.add_argument("--output-len", type=int, default=256, help="decode tokens")
    parser.add_argument("--rows-ab", action="store_true",
                        help="decode: the GGUF engine with TINYPAGED_GGUF_ROWS=0, then 1")
    parser.add_argument("--only", nargs="+",
                        choices=["checks", "kernels", "tokens", "decode", "rows", "subdot"],
                        help="stages to run (default: all but rows)")
    parser.add_argument("--rows-m", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                        help="rows of x of the rows stage's table")
    parser.add_argument("--sweep-layer", choices=list(LAYERS), default="llama3-8b",
                        help="--sweep-rows: whose layer's linears are summed")
    parser.add_argument("--sweep-rows", action="store_true",
                        help="rows stage: sweep gguf_rows' tiles at --sweep-m rows instead")
    parser.add_argument("--rows-configs", nargs="+", default=ROWS_SWEEP,
                        help="block_n/warps/stages[/programs per SM][/a] of gguf_rows "
                        "(--sweep-rows; /a: PTX nibbles)")
    parser.add_argument("--subdot-configs", nargs="+", default=SUBDOT_SWEEP,
                        help="block_n/warps/stages[/pps]/flags of gguf_subdot (--only subdot; "
                        "a: PTX quants, j: one product a super-block)")
    parser.add_argument("--subdot-m", type=int, nargs="+", default=[8, 4, 16],
                        help="rows of x of the subdot stage's table, in this order")
    args = parser.parse_args()
    subdot = bool(args.only) and "subdot" in args.only
    args.sweep_m = args.sweep_m or ([8, 16] if args.sweep_rows else [8] if subdot else [1])
    args.types_given = args.types is not None
    args.types = args.types or list(TYPES)
    if args.only and "rows" in args.only and not args.types_given:
        args.types = ["Q4_K", "Q5_K", "Q6_K", "Q8_0"]
    args.types = [(t, TYPES[t]) for t in args.types]
    deadline = time.time() + args.budget_s
    torch.manual_seed(0)
    stages = args.only or ["checks", "kernels", "tokens", "decode"]
    if "checks" in stages:
        checks(args.types, args.check_m or args.m, args.check_shapes)
    if "kernels" in stages:
        kernels(args, deadline)
    if "tokens" in stages:
        same_tokens()
    if "decode" in stages:
        decode(args)
    if "subdot" in stages:
        subdot_stage(args, deadline)
    if "rows" in stages:
        if args.sweep_rows:
            rows_sweep(args, deadline)
        else:
            rows_table(args, deadline)


if __name__ == "__main__":
    main()
