"""The Gluon prefill kernel (kernels/attention_gluon.py) on an H200: correct, then how fast.

    PYTHONPATH=. python benchmarks/prefill_gluon.py                  # every config, ~1 min
    PYTHONPATH=. python benchmarks/prefill_gluon.py --configs 128,128,2,pingpong,1 --no-time

1. Baselines, in this process: the Triton Hopper kernel (attention_hopper.py at HOPPER_CONFIG,
   what TINYPAGED_PREFILL_ATTENTION=triton runs) and SDPA cuDNN on dense [B, 32, L, 128] q/k/v
   (causal: the same FLOPs as 32/8 GQA), timed on B4 L2048 32/8, B4 L2048 32/32, B1 L8192 32/8,
   and the Triton kernel alone on a ragged step of the offline workload (offline_step).
2. Checks: each Gluon config (block_m, block_n, stages, mode, head_group;
   attention_gluon.GLUON_CONFIGS) in
   a child process of its own, all at once, so that a compile error, a fault or a hang (a
   barrier phase gone wrong waits forever: the child is killed after --child-timeout seconds)
   costs only that config. A child compares the kernel with paged_attention_ref (max error,
   ok/FAIL per case: 32/8 and 32/32 heads, ragged prefills of 1, 17, 300 and 2048 tokens, chunks
   whose queries start inside a cached prefix, the offline step's 130 sequences, block_size 16,
   bf16 and fp16; slots no sequence
   owns hold NaN), and paged_attention with TINYPAGED_PREFILL_ATTENTION=gluon once.
3. Timings: one child times every config that neither crashed nor hung in 2 (a wrong result is
   still timed) on the four shapes, one after the other.
4. A table: TFLOP/s of every kernel and config per shape, and its ratio to cuDNN.

Causal FLOPs are counted as benchmarks/kernel_bench.py does: 4 * B * Hq * D * L^2 / 2.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from tinypaged.kernels import attention
from tinypaged.kernels.attention_gluon import CONFIG_KEYS, GLUON_CONFIGS, gluon_attention
from tinypaged.kernels.attention_hopper import hopper_attention_triton

# (batch, new tokens, query heads, KV heads)
SHAPES = [(4, 2048, 32, 8), (4, 2048, 32, 32), (1, 8192, 32, 8), "offline step"]
# name, q_lens, seq_lens: prefills, and chunks whose queries start inside a cached prefix (the
# prefixes not multiples of 16 or of a tile)
CASES = [
    ("prefill ragged", [1, 17, 300, 2048], [1, 17, 300, 2048]),
    ("chunked over prefix", [5, 100, 1, 700, 64], [300, 1000, 17, 2048, 64 + 129]),
]
HEADS = [(32, 8), (32, 32)]


def offline_step() -> tuple[list[int], list[int]]:
    """A mixed step of the offline workload (16,384 tokens: prompts of 100-1,024 tokens, one
    of them a chunk, beside 104 decodes of contexts 100-1,280), as `tinypaged bench throughput`
    schedules its fifth: many short programs, which the square shapes do not show."""
    rng = random.Random(0)
    q_lens, seq_lens = [1] * 104, [rng.randint(100, 1024) + rng.randint(1, 256) for _ in range(104)]
    budget = 16384 - 104
    while budget > 0:
        length = min(rng.randint(100, 1024), budget)
        q_lens.append(length)
        seq_lens.append(length)
        budget -= length
    return q_lens, seq_lens


def shape_batch(shape, poison=False):
    if shape == "offline step":
        return paged_batch(*offline_step(), 32, 8, torch.bfloat16, poison)
    batch, length, hq, hk = shape
    return paged_batch([length] * batch, [length] * batch, hq, hk, torch.bfloat16, poison)


def shape_name(shape) -> str:
    if shape == "offline step":
        return "offline step 32/8"
    batch, length, hq, hk = shape
    return f"B{batch} L{length} {hq}/{hk}"


def tflops(shape, ms: float) -> float:
    """Causal FLOPs (QK^T and PV over each query's visible keys) per second, in TFLOP/s."""
    if shape == "offline step":
        q_lens, seq_lens = offline_step()
        pairs = sum(q * (s - q) + q * q / 2 for q, s in zip(q_lens, seq_lens))
        return 4 * 32 * 128 * pairs / ms / 1e9
    batch, length, hq, _ = shape
    return 4 * batch * hq * 128 * length * length / 2 / ms / 1e9


def bench(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def paged_batch(q_lens, seq_lens, hq, hk, dtype, poison):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kernel_bench import PagedBatch

    return PagedBatch(q_lens, seq_lens, hq, hk, 128, dtype, block_size=16, poison=poison)


def launch_args(b):
    return (b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, b.scale,
            torch.empty_like(b.q))


def emit(kind: str, **fields) -> None:
    print(json.dumps({"kind": kind, **fields}), flush=True)


def check(config) -> bool:
    """Every case against paged_attention_ref; prints one line per case, True when all pass."""
    tag = ",".join(map(str, config))
    all_ok = True
    for dtype in (torch.bfloat16, torch.float16):
        tol = 1.6e-2 if dtype == torch.bfloat16 else 2e-3  # ~2 ulp at 1.0, as kernel_bench.py
        cases = [*CASES, ("offline step", *offline_step())]
        for (name, q_lens, seq_lens), (hq, hk) in [(c, h) for c in cases for h in HEADS]:
            b = paged_batch(q_lens, seq_lens, hq, hk, dtype, poison=True)
            try:
                got = gluon_attention(*launch_args(b), **dict(zip(CONFIG_KEYS, config)))
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 (a compile error: print it, go on)
                print(f"  FAIL {tag:18s} {name:20s} {hq}/{hk} {str(dtype)[6:]:9s} "
                      f"{type(e).__name__}: {str(e)[-1500:]}", flush=True)
                all_ok = False
                continue
            want = b.call(attention.paged_attention_ref)
            err = (got.float() - want.float()).abs()
            ok = bool(torch.isfinite(got).all()) and bool((err <= tol + tol * want.float().abs())
                                                          .all())
            all_ok &= ok
            print(f"  {'ok  ' if ok else 'FAIL'} {tag:18s} {name:20s} {hq}/{hk} "
                  f"{str(dtype)[6:]:9s} max err {err.max().item():.2e}", flush=True)
    return all_ok


def check_dispatch() -> None:
    """paged_attention with TINYPAGED_PREFILL_ATTENTION=gluon reaches the Gluon kernel."""
    calls = []
    real = attention.gluon_attention
    attention.gluon_attention = lambda *a, **k: calls.append(1) or real(*a, **k)
    os.environ["TINYPAGED_PREFILL_ATTENTION"] = "gluon"
    b = paged_batch([300, 2048], [300, 2048], 32, 8, torch.bfloat16, poison=True)
    got = b.call(attention.paged_attention)
    err = (got.float() - b.call(attention.paged_attention_ref).float()).abs().max().item()
    del os.environ["TINYPAGED_PREFILL_ATTENTION"]
    attention.gluon_attention = real
    print(f"  {'ok  ' if calls and err < 5e-2 else 'FAIL'} dispatch: paged_attention with "
          f"TINYPAGED_PREFILL_ATTENTION=gluon -> gluon calls {len(calls)}, max err {err:.2e}",
          flush=True)


def parse(text: str) -> tuple:
    block_m, block_n, stages, mode, head_group = text.split(",")
    return int(block_m), int(block_n), int(stages), mode, int(head_group)


def check_child(config) -> None:
    check(config)
    default = attention.GLUON_CONFIG
    if config == tuple(default[k] for k in CONFIG_KEYS):
        check_dispatch()


def time_child(configs) -> None:
    for shape in SHAPES:
        args = launch_args(shape_batch(shape))
        for config in map(dict, (zip(CONFIG_KEYS, c) for c in configs)):
            try:
                ms = bench(lambda args=args, config=config: gluon_attention(*args, **config))
            except Exception as e:  # noqa: BLE001 (print it, time the next config)
                print(f"  gluon {config} {shape_name(shape)}: {type(e).__name__}: "
                      f"{str(e)[-800:]}", flush=True)
                continue
            emit("time", impl="gluon {block_n} s{num_stages} {mode} hg{head_group}".format(
                **config), shape=shape_name(shape), ms=ms, tflops=tflops(shape, ms))


def run_children(args, configs, timed: bool) -> dict:
    """Start a child per config (checks, all at once) or one for every config (timings);
    returns {config text: its output, with a last line on a crash or timeout}."""
    script = os.path.abspath(__file__)
    if timed:
        jobs = {"timings": [sys.executable, script, "--time-child", *configs]}
    else:
        jobs = {c: [sys.executable, script, "--check-child", c] for c in configs}
    files = {name: (tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for name in jobs}
    procs = {name: subprocess.Popen(cmd, stdout=files[name][0], stderr=files[name][1],
                                    text=True) for name, cmd in jobs.items()}
    deadline = time.time() + args.child_timeout * (len(configs) if timed else 1)
    results = {}
    for name, proc in procs.items():
        try:
            proc.wait(timeout=max(deadline - time.time(), 1.0))
            failed = proc.returncode != 0 and f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            failed = f"TIMEOUT after {args.child_timeout:.0f} s (a hang: barrier phases?)"
        out, err = files[name]
        out.seek(0)
        err.seek(0)
        text = out.read()
        if failed:
            text += f"  child FAILED: {failed}: {err.read()[-2500:]}\n"
        results[name] = text
    return results


def baselines() -> list[dict]:
    rows = []
    for shape in SHAPES:
        args = launch_args(shape_batch(shape))
        first = len(rows)
        ms = bench(lambda args=args: hopper_attention_triton(*args, **attention.HOPPER_CONFIG))
        rows.append({"impl": "triton hopper", "shape": shape_name(shape), "ms": ms,
                     "tflops": tflops(shape, ms)})
        if shape == "offline step":  # ragged: no dense peer
            print(f"  {'triton hopper':22s} {shape_name(shape):16s} {ms * 1e3:9.1f} us "
                  f"{rows[-1]['tflops']:7.1f} TFLOP/s", flush=True)
            continue
        batch, length, hq, hk = shape
        q, k, v = (torch.randn(batch, hq, length, 128, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def cudnn(q=q, k=k, v=v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        try:
            ms = bench(cudnn)
            rows.append({"impl": "SDPA cudnn", "shape": shape_name(shape), "ms": ms,
                         "tflops": tflops(shape, ms)})
        except RuntimeError as e:
            print(f"  cuDNN {shape_name(shape)}: {e}")
        for row in rows[first:]:
            print(f"  {row['impl']:22s} {row['shape']:16s} {row['ms'] * 1e3:9.1f} us "
                  f"{row['tflops']:7.1f} TFLOP/s", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="*",
                        default=[",".join(map(str, c)) for c in GLUON_CONFIGS],
                        help="block_m,block_n,stages,mode,head_group of each Gluon config "
                             "(default: all)")
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--no-time", action="store_true")
    parser.add_argument("--child-timeout", type=float, default=60.0,
                        help="seconds a check child (or the timing child, per config) may take")
    parser.add_argument("--check-child", help=argparse.SUPPRESS)
    parser.add_argument("--time-child", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.check_child:
        check_child(parse(args.check_child))
        return 0
    if args.time_child:
        time_child([parse(c) for c in args.time_child])
        return 0
    for config in args.configs:
        parse(config)  # a typo stops here, not in a child
    start = time.time()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    rows = [] if args.no_time else baselines()
    timed = list(args.configs)
    if not args.no_check:
        print("checks (each config in its own process)", flush=True)
        for config, out in run_children(args, args.configs, timed=False).items():
            print(f"gluon config {config}\n{out}", end="", flush=True)
            if "child FAILED" in out:
                timed.remove(config)
    if not args.no_time and timed:
        print(f"timings of {' '.join(timed)}", flush=True)
        for line in run_children(args, timed, timed=True)["timings"].splitlines():
            if line.startswith('{"kind": "time"'):
                row = json.loads(line)
                rows.append(row)
                print(f"  {row['impl']:22s} {row['shape']:16s} {row['ms'] * 1e3:9.1f} us "
                      f"{row['tflops']:7.1f} TFLOP/s", flush=True)
            else:
                print(line, flush=True)
    cudnn = {r["shape"]: r["tflops"] for r in rows if r["impl"] == "SDPA cudnn"}
    print("\n| impl | " + " | ".join(shape_name(s) for s in SHAPES) + " |")
    print("|---|" + "---|" * len(SHAPES))
    for impl in dict.fromkeys(r["impl"] for r in rows):
        cells = []
        for shape in map(shape_name, SHAPES):
            hit = [r for r in rows if r["impl"] == impl and r["shape"] == shape]
            if not hit:
                cells.append("-")
            elif shape in cudnn:
                cells.append(f"{hit[0]['tflops']:.0f} ({hit[0]['tflops'] / cudnn[shape]:.2f}x)")
            else:  # the ragged step: microseconds too, no peer
                cells.append(f"{hit[0]['tflops']:.0f} ({hit[0]['ms'] * 1e3:.0f} us)")
        print(f"| {impl} | " + " | ".join(cells) + " |")
    print(f"(TFLOP/s, ratio to SDPA cuDNN; {time.time() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
