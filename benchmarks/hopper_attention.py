"""Hopper prefill attention on one sm_90 GPU: correctness first, then TFLOP/s beside cuDNN.

    PYTHONPATH=. python benchmarks/hopper_attention.py           # checks, then the table
    PYTHONPATH=. python benchmarks/hopper_attention.py --sweep   # also tile configs (tuning)
    ... --keep-going   # time even after a mismatch (exit code 1 at the end)

1. The Hopper kernel (attention_hopper.py), reached through the public `paged_attention` so the
   dispatch is checked too, against the torch reference in bf16 and fp16: varlen prefill
   batches, chunks over a cached prefix (queries starting inside the sequence), partial last
   blocks, GQA groups 1/3/4/7, head_dim 64/128, cache blocks of 16 (pointer loads) and 128
   (TMA). Unowned cache slots hold NaN, so a stray read shows. Any mismatch exits 1 before a
   single timing.
2. TFLOP/s (causal FLOPs over the visible pairs) for B4 L2048, B1 L8192 and B4 L512 over a
   1536-token prefix, 32/8 heads, d128: SDPA cuDNN and flash (dense K/V, 32 heads), the portable
   varlen kernel at its config, the Hopper kernel at HOPPER_CONFIG and, with --sweep, variants.

Each check group and each variant compiles in its own process first (Triton caches the binaries
on disk), so the whole run takes about a minute instead of several.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import io
import itertools
import math
import multiprocessing
import sys

import torch
from kernels import FAILURES, ROWS, PagedBatch, compare, measure_ceilings, randn, record, sdpa

from tinypaged.kernels import attention
from tinypaged.kernels.attention_hopper import hopper_attention_triton, is_hopper
from tinypaged.kernels.attention_varlen import varlen_attention_triton

SHAPES = {  # name: (batch, new tokens, cached prefix)
    "B4 L2048": (4, 2048, 0),
    "B1 L8192": (1, 8192, 0),
    "B4 L512 +1536 cached": (4, 512, 1536),
}
SWEEP = [  # (block_m, block_n, num_warps, num_stages, maxnreg), on the default 16-token blocks;
    # a 128-register cap lets two 8-warp programs share an SM (one's softmax then overlaps the
    # other's MMA); 64-row tiles on 4 warps do the same with twice the K/V reads
    (128, 64, 8, 3, None), (128, 32, 8, 3, None), (128, 32, 8, 2, 128), (128, 32, 8, 3, 128),
    (128, 32, 8, 4, 128), (64, 64, 4, 3, None),
]
PORTABLE_VARIANT = {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3}
TMA_BLOCK_SIZE = 64  # cache blocks that hold whole 64-key tiles: K/V by TMA
TMA_SWEEP = [(128, 64, 8, 3, None), (128, 64, 8, 2, 128), (128, 32, 8, 3, 128),
             (128, 32, 8, 4, 128), (64, 64, 4, 3, None)]
CHECK_CASES = {  # name: (q_lens, seq_lens, kwargs); the last three run the portable kernels
    "varlen prefill": ([1, 17, 300, 129], [1, 17, 300, 129], {}),
    "chunks over a cached prefix": ([9, 200, 1, 77], [400, 1000, 33, 77], {}),
    "one long prefill, partial last block": ([1000], [1000], {}),
    "mixed with decodes": ([1, 300, 40, 1], [1000, 300, 700, 17], {}),
    "mixed, window 64 + softcap 50": ([1, 300, 40, 1], [1000, 300, 700, 17],
                                      {"sliding_window": 64, "softcap": 50.0}),
    "decode, split-KV": ([1] * 5, [1, 17, 100, 1000, 3000], {}),
    "decode, window 700": ([1] * 4, [1, 17, 1000, 3000], {"sliding_window": 700}),
}
CHECK_GROUPS = [  # (dtype, query heads, KV heads, head_dim, cache block size)
    (torch.bfloat16, *heads, block_size) for heads, block_size in itertools.product(
        ((32, 8, 128), (12, 4, 64), (16, 16, 128), (28, 4, 128)), (16, 128))
] + [(torch.float16, 32, 8, 128, 16), (torch.float16, 32, 8, 128, 128)]


def config_of(variant) -> dict:
    block_m, block_n, warps, stages, maxnreg = variant
    return {"block_m": block_m, "block_n": block_n, "num_warps": warps, "num_stages": stages,
            "maxnreg": maxnreg}


def batches(block_size: int) -> dict[str, tuple[PagedBatch, float]]:
    out = {}
    for name, (batch_size, new, prefix) in SHAPES.items():
        batch = PagedBatch([new] * batch_size, [prefix + new] * batch_size, 32, 8, 128,
                           torch.bfloat16, block_size=block_size)
        out[name] = (batch, 4 * batch_size * 32 * 128 * (new * prefix + new * new / 2))
    return out


def hopper(batch: PagedBatch, config: dict):
    full = {**attention.HOPPER_CONFIG, **config}
    return batch.call(lambda *a, max_query_len, max_seq_len: hopper_attention_triton(
        *a, torch.empty_like(batch.q), **full))


def portable(batch: PagedBatch, config: dict | None = None):
    config = {**attention._varlen_config(max(batch.q_lens), 4), **(config or {})}
    return batch.call(lambda *a, max_query_len, max_seq_len: varlen_attention_triton(
        *a, torch.empty_like(batch.q), **config))


def _job(job) -> tuple[str, list[str]]:
    """Worker: ("check", group) compares one group of cases and returns (its lines, failures);
    ("compile", variant, block_size) runs a variant once per shape, leaving it in the cache."""
    out = io.StringIO()
    FAILURES.clear()  # a worker runs several jobs
    torch.manual_seed(0)
    with contextlib.redirect_stdout(out):
        try:
            if job[0] == "check":
                dtype, hq, hk, d, block_size = job[1]
                for name, (q_lens, seq_lens, kwargs) in CHECK_CASES.items():
                    batch = PagedBatch(q_lens, seq_lens, hq, hk, d, dtype, block_size=block_size,
                                       poison=True)
                    compare(f"{name} {hq}/{hk} d{d} block {block_size}",
                            batch.call(attention.paged_attention, **kwargs),
                            batch.call(attention.paged_attention_ref, **kwargs), dtype)
            else:
                _, variant, block_size = job
                for batch, _ in batches(block_size).values():
                    if variant == "portable":  # at its config and at PORTABLE_VARIANT
                        portable(batch)
                        portable(batch, PORTABLE_VARIANT)
                    else:
                        hopper(batch, {**config_of(variant), "tma": block_size >= 64})
                if variant != "portable":  # each timed config is checked too
                    batch = PagedBatch([300, 9, 1, 77], [300, 1000, 33, 77], 32, 8, 128,
                                       torch.bfloat16, block_size=block_size, poison=True)
                    width = batch.block_tables.shape[1]  # as wide as the timed batches' tables,
                    batch.block_tables = torch.nn.functional.pad(  # so no new compile
                        batch.block_tables, (0, 2048 // block_size - width),
                        value=batch.k_cache.shape[0] - 1)
                    compare(f"{variant} block {block_size}: varlen + prefix",
                            hopper(batch, {**config_of(variant), "tma": block_size >= 64}),
                            batch.call(attention.paged_attention_ref), torch.bfloat16)
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported, and a failed check fails the run
            print(f"  {job}: {type(e).__name__}: {str(e)[:300]}")
            FAILURES.append(f"{job}: {type(e).__name__}")
    return out.getvalue(), list(FAILURES)


def run_jobs(jobs) -> None:
    """The jobs in 14 processes; in this one if the pool breaks (the checks must still run)."""
    ctx = multiprocessing.get_context("spawn")
    try:
        with concurrent.futures.ProcessPoolExecutor(14, mp_context=ctx) as pool:
            results = list(pool.map(_job, jobs))
    except concurrent.futures.process.BrokenProcessPool as e:
        print(f"  process pool broke ({e}); running the jobs here")
        results = [_job(job) for job in jobs]
    for text, failures in results:
        print(text, end="")
        FAILURES.extend(failures)


def timed(name: str, impl: str, fn, flops: float, batch: PagedBatch) -> None:
    try:
        record("prefill", name, impl, fn, bytes_moved=batch.kv_bytes(), flops=flops,
               compute_bound=True)
    except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result too
        print(f"  {name} {impl}: {type(e).__name__}: {str(e)[:200]}")


def time_all(sweep: bool) -> None:
    shapes = batches(16)
    batch = shapes["B4 L2048"][0]
    same = torch.equal(batch.call(attention.paged_attention), hopper(batch, {}))
    print(f"dispatch: paged_attention on sm_90 gives the Hopper kernel's bits: {same}")
    if not same:
        FAILURES.append("dispatch")
    print("timings: causal prefill attention, bf16, 32/8 heads, d128, cache block 16")
    for name, (batch, flops) in shapes.items():
        batch_size, new, prefix = SHAPES[name]
        if not prefix:
            q, k, v = (randn(batch_size, 32, new, 128) for _ in range(3))
            for backend in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
                timed(name, f"SDPA {backend.split('_')[0].lower()} (dense, 32/32)",
                      lambda q=q, k=k, v=v, be=backend: sdpa(q, k, v, be, is_causal=True),
                      flops, batch)
        timed(name, "portable varlen", lambda b=batch: portable(b), flops, batch)
        if sweep:
            timed(name, f"portable varlen {PORTABLE_VARIANT}",
                  lambda b=batch: portable(b, PORTABLE_VARIANT), flops, batch)
        timed(name, "hopper HOPPER_CONFIG", lambda b=batch: b.call(attention.paged_attention),
              flops, batch)
        for variant in SWEEP if sweep else ():
            config = config_of(variant)
            timed(name, f"hopper {variant}", lambda b=batch, c=config: hopper(b, c), flops, batch)
    if sweep:
        for name, (batch, flops) in batches(TMA_BLOCK_SIZE).items():
            timed(name, f"portable varlen, block {TMA_BLOCK_SIZE}", lambda b=batch: portable(b),
                  flops, batch)
            for variant in TMA_SWEEP:
                config = {**config_of(variant), "tma": True}
                timed(name, f"hopper TMA block {TMA_BLOCK_SIZE} {variant}",
                      lambda b=batch, c=config: hopper(b, c), flops, batch)


def time_decode() -> None:
    """Decode shares attention_tile with the portable prefill kernel: watch it for regressions."""
    print("timings: decode attention, bf16, 32/8 heads, d128, block 16 (GB/s of K/V read)")
    for batch_size, ctx in ((64, 2048), (256, 1024)):
        batch = PagedBatch([1] * batch_size, [ctx] * batch_size, 32, 8, 128, torch.bfloat16)
        record("decode", f"B{batch_size} ctx{ctx}", "triton split-KV",
               lambda b=batch: b.call(attention.paged_attention), bytes_moved=batch.kv_bytes())


def print_summary() -> None:
    """TFLOP/s per implementation and shape, and the ratio to cuDNN on that shape."""
    cudnn = {r["shape"]: r["achieved"] for r in ROWS if r["impl"].startswith("SDPA cudnn")}
    ROWS[:] = [r for r in ROWS if r["op"] == "prefill"]
    print(f"\n| impl | {' | '.join(SHAPES)} |\n|---|{'---|' * len(SHAPES)}")
    for impl in dict.fromkeys(r["impl"] for r in ROWS):
        cells = []
        for shape in SHAPES:
            row = next((r for r in ROWS if r["impl"] == impl and r["shape"] == shape), None)
            if row is None or math.isnan(row["achieved"]):
                cells.append("n/a")
                continue
            ratio = row["achieved"] / cudnn.get(shape, cudnn.get("B4 L2048", math.nan))
            cells.append(f"{row['achieved']:.0f} ({ratio:.2f}x)")
        print(f"| {impl} | {' | '.join(cells)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time tile variants")
    parser.add_argument("--keep-going", action="store_true", help="time even after a mismatch")
    args = parser.parse_args()
    if not torch.cuda.is_available() or not is_hopper(torch.cuda.current_device()):
        sys.exit("benchmarks/hopper_attention.py needs an sm_90 GPU (H100 / H200)")
    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__}")
    print("correctness: paged_attention on sm_90 vs the torch reference (parallel groups)")
    default = tuple(attention.HOPPER_CONFIG[key] for key in
                    ("block_m", "block_n", "num_warps", "num_stages", "maxnreg"))
    jobs = [("check", group) for group in CHECK_GROUPS] + [("compile", default, 16)]
    if args.sweep:
        jobs += [("compile", v, 16) for v in [*SWEEP, "portable"]]
        jobs += [("compile", v, TMA_BLOCK_SIZE) for v in [*TMA_SWEEP, "portable"]]
    run_jobs(jobs)
    if FAILURES and not args.keep_going:
        sys.exit(f"FAILED: {FAILURES}")
    torch.manual_seed(0)
    measure_ceilings()
    time_all(args.sweep)
    time_decode()
    print_summary()
    if FAILURES:
        sys.exit(f"FAILED: {FAILURES}")


if __name__ == "__main__":
    main()
