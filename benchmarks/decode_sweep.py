"""Decode attention over batch x context x head layout, and tile variants, timed launch-free.

    PYTHONPATH=. python benchmarks/decode_sweep.py [--json PATH] [--budget-s 55]

Correctness first (every variant against the torch reference, bf16), then CUDA-graph timings:
each cell is a graph of calls cycling through copies of the batch whose K/V together exceed the
L2 cache, so a call streams its K/V from HBM as a model's layer does, and the host's launch cost
is gone. A few cells are also timed under torch.profiler: the kernels' own time, without even
the gaps between graph nodes. % = K/V bytes / time against the 4.2 TB/s copy ceiling.

Shapes: Llama-3-8B heads (32 query / 8 KV) and Qwen3-0.6B heads (16 / 8), d128, bf16, 16-token
KV blocks; uniform contexts of 512, 1024, 2048 keys and the offline workload's decode contexts
("mix": prompts 100-1024 plus 0-255 generated tokens, as benchmarks/decode_splits.py).
The variants compile first in parallel worker processes (Triton's cache is on disk), so that the
GPU script stays within its time slot.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import multiprocessing
import os
import sys
import time

import torch

from tinypaged.bench.offline import COPY_BW, SHAPES, sample_requests
from tinypaged.kernels import attention
from tinypaged.kernels.attention import paged_attention_ref, paged_attention_triton
from tinypaged.kernels.attention_decode import decode_num_splits

LAYOUTS = {"llama3-8b": (32, 8), "qwen3-0.6b": (16, 8)}
BATCHES = (1, 8, 32, 64, 96, 128, 256)
CONTEXTS = (512, 1024, 2048, "mix")
HEAD_DIM, BLOCK_SIZE, SMS = 128, 16, 132
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the interpreter, a smoke test
L2_BYTES = 192e6  # the copies of a cell's K/V together stream from HBM, not L2 (H200: 60 MB)
T0 = time.perf_counter()


def variants() -> list[dict]:
    """Tile configurations compared at the focus cells (attention.DECODE_CONFIG's keys).

    Measured on 2026-12-01 besides these (RESULTS.md), and dropped: the next tile's block ids or
    K/V prefetched, the products as sums instead of tl.dot, a register cap."""
    grid = itertools.product
    out = [{"block_n": n, "num_warps": w, "num_stages": s}
           for n, w, s in grid((32, 64, 128), (4, 8), (1, 2, 3))]
    return out + [{"block_n": n, "num_warps": 2, "num_stages": 1} for n in (32, 64)]


def name(config: dict) -> str:
    return f"n{config['block_n']} w{config['num_warps']} s{config['num_stages']}"


@functools.cache
def mix_contexts() -> tuple[int, ...]:
    """The 256 decode contexts of decode_splits.py (its Qwen3-0.6B prompts), for both layouts."""
    lens = [len(p) for p in sample_requests(256, 100, 1024, SHAPES["qwen3-0.6b"]["vocab_size"])]
    return tuple(n + (i * 37) % 256 for i, n in enumerate(lens))


def contexts(batch_size: int, ctx) -> list[int]:
    return list(mix_contexts()[:batch_size]) if ctx == "mix" else [ctx] * batch_size


class DecodeBatch:
    """One query per sequence over paged K/V; `copies` block tables into one cache, disjoint, so
    a graph cycling through them reads `copies` times the K/V of one call from HBM."""

    def __init__(self, seq_lens: list[int], num_q_heads: int, num_kv_heads: int,
                 table_width: int | None = None, copies: int | None = None):
        self.seq_lens_list = seq_lens
        blocks = [math.ceil(s / BLOCK_SIZE) for s in seq_lens]
        self.kv_bytes = 2 * 2 * num_kv_heads * HEAD_DIM * sum(seq_lens)
        if copies is None:
            copies = min(64, max(1, math.ceil(L2_BYTES / self.kv_bytes)))
        self.copies = copies
        num_blocks = copies * sum(blocks) + 1
        shape = (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
        self.k_cache = torch.randn(shape, device=DEV, dtype=torch.bfloat16)
        self.v_cache = torch.randn(shape, device=DEV, dtype=torch.bfloat16)
        perm = torch.randperm(num_blocks - 1).to(torch.int32)
        width = table_width or 16 * math.ceil(max(blocks) / 16)  # one compile for all (16 | it)
        self.tables = []
        start = 0
        for _ in range(copies):
            table = torch.zeros((len(seq_lens), width), dtype=torch.int32)
            for b, n in enumerate(blocks):
                table[b, :n] = perm[start:start + n]
                start += n
            self.tables.append(table.to(DEV))
        self.seq_lens = torch.tensor(seq_lens, device=DEV, dtype=torch.int32)
        self.query_start_loc = torch.arange(len(seq_lens) + 1, device=DEV, dtype=torch.int32)
        self.q = [torch.randn(len(seq_lens), num_q_heads, HEAD_DIM, device=DEV,
                              dtype=torch.bfloat16) for _ in range(copies)]
        self.out = [torch.empty_like(q) for q in self.q]

    def call(self, fn, i: int = 0, **kwargs) -> torch.Tensor:
        if fn is paged_attention_triton:
            kwargs["out"] = self.out[i]
        return fn(self.q[i], self.k_cache, self.v_cache, self.tables[i], self.seq_lens,
                  self.query_start_loc, HEAD_DIM**-0.5, max_query_len=1,
                  max_seq_len=max(self.seq_lens_list), **kwargs)


def graph_us(batch: DecodeBatch, **kwargs) -> float:
    """Median time of one call from replays of a graph of calls cycling through the copies
    (benchmarks/awq_gemv.py's graph_us)."""
    from awq_gemv import graph_us as graph_us_of

    calls = [functools.partial(batch.call, paged_attention_triton, i, **kwargs)
             for i in range(batch.copies)]
    return graph_us_of(calls, reps=max(batch.copies, 4))


def kernel_us(batch: DecodeBatch, **kwargs) -> dict:
    """The decode kernels' own time per call (torch.profiler, eager calls): split pass, merge."""
    from torch.profiler import ProfilerActivity, profile

    reps = 8
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for r in range(4 * reps):  # eager launches, as do_bench times them: host cost included
        batch.call(paged_attention_triton, r % batch.copies, **kwargs)
    end.record()
    torch.cuda.synchronize()
    out = {"eager (not summed)": start.elapsed_time(end) * 1e3 / (4 * reps)}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for r in range(reps):
            batch.call(paged_attention_triton, r % batch.copies, **kwargs)
        torch.cuda.synchronize()
    for evt in prof.key_averages():
        if "_decode_" in evt.key:
            kind = "merge" if "merge" in evt.key else "split"
            out[kind] = out.get(kind, 0.0) + getattr(
                evt, "device_time_total", getattr(evt, "cuda_time_total", 0.0)) / reps
    return out


def pct(kv_bytes: float, us: float) -> float:
    return 100 * kv_bytes / (us * 1e-6) / COPY_BW


def _compile(tasks: list) -> int:
    """Worker: run each (layout, config, splits, table width) once on a 2-sequence batch, which
    compiles the same specializations as the timed cells (strides differ only in multiples of
    16)."""
    batches = {}
    for layout, config, splits in tasks:
        if layout not in batches:
            batches[layout] = DecodeBatch([700, 1000], *LAYOUTS[layout], table_width=64, copies=1)
        try:
            batches[layout].call(paged_attention_triton, config=config, num_splits=splits)
        except Exception as e:  # noqa: BLE001 (the main process reports it per cell)
            print(f"compile failed: {layout} {name(config)} {splits}: {str(e)[:200]}")
    return len(tasks)


def precompile(tasks: list, workers: int = 15, timeout_s: float = 30.0) -> str:
    unique = {}
    for lay, c, s in tasks:
        unique.setdefault(repr((lay, sorted(c.items()), s)), (lay, c, s))
    tasks = list(unique.values())
    chunks = [tasks[i::workers] for i in range(workers)]
    ctx = multiprocessing.get_context("spawn")
    start = time.perf_counter()
    with ctx.Pool(workers) as pool:
        try:
            done = sum(pool.map_async(_compile, chunks).get(timeout=timeout_s))
            pool.close()
        except multiprocessing.TimeoutError:
            done = -1
    return f"precompile: {len(tasks)} kernels, {done} done, {time.perf_counter() - start:.1f} s"


FOCUS = {  # per layout: the target cell first; the configuration chosen must not slow the others
    "llama3-8b": [(64, 1024), (64, 512), (64, 2048), (96, "mix"), (256, 1024), (8, 1024)],
    "qwen3-0.6b": [(96, "mix"), (256, "mix"), (64, 1024), (32, "mix")],
}
TOLERANCE = 1.02  # a chosen configuration may be at most 2% slower than today's on a focus cell


def heuristic(layout: str, batch_size: int, ctx) -> int:
    return decode_num_splits(batch_size, LAYOUTS[layout][1], max(contexts(batch_size, ctx)), SMS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--budget-s", type=float, default=55.0)
    args = parser.parse_args()
    path = args.json or (os.path.join(os.environ["OUT"], "decattn", "sweep.json")
                         if os.environ.get("OUT") else None)
    results: dict = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
                     "rows": [], "chosen": {}}

    def save() -> None:
        if path:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                json.dump(results, f, indent=1)

    def elapsed() -> str:
        return f"[{time.perf_counter() - T0:.0f} s]"

    def over_budget() -> bool:
        return time.perf_counter() - T0 > args.budget_s

    default = dict(attention.DECODE_CONFIG)
    configs = [default] + [c for c in variants() if name(c) != name(default)]
    tasks = [(lay, c, s) for c in configs for lay in LAYOUTS for s in (1, 4)]
    tasks += [(lay, default, s) for lay in LAYOUTS for s in (2, 3, 5, 8, 16)]
    print(precompile(tasks), elapsed(), flush=True)

    print(f"correctness: bf16 vs the torch reference, B8 mix, 1 and 4 splits {elapsed()}")
    failed = set()
    for layout, heads in LAYOUTS.items():
        batch = DecodeBatch(contexts(8, "mix"), *heads, copies=1)
        want = batch.call(paged_attention_ref).float()
        worst = 0.0
        for config in configs:
            for splits in (1, 4):
                try:
                    got = batch.call(paged_attention_triton, config=config,
                                     num_splits=splits).float()
                    err = (got - want).abs().max().item()
                except Exception as e:  # noqa: BLE001 (a variant that does not compile)
                    print(f"  {layout} {name(config)}: {str(e)[:120]}")
                    err = float("inf")
                worst = max(worst, err if err < float("inf") else 0.0)
                if not err < 3e-2:
                    failed.add((layout, name(config)))
                    print(f"  FAIL {layout} {name(config)} {splits} splits: max err {err:.2e}")
        print(f"  {layout}: worst max err {worst:.2e}", flush=True)

    def cell(batch, layout, batch_size, ctx, config, splits, tag):
        try:
            us = graph_us(batch, config=config, num_splits=splits)
        except Exception as e:  # noqa: BLE001 (a variant that does not compile or run)
            print(f"  {layout} B{batch_size} ctx{ctx} {name(config)}: {str(e)[:120]}")
            us = float("inf")
        row = {"tag": tag, "layout": layout, "batch": batch_size, "ctx": ctx,
               "config": name(config), "splits": splits, "graph_us": round(us, 2),
               "pct": round(pct(batch.kv_bytes, us), 1)}
        results["rows"].append(row)
        return row

    print(f"\nfocus cells, every variant: graph us (% of copy bw) {elapsed()}", flush=True)
    chosen = {}
    for layout, cells in FOCUS.items():
        times = {name(c): [] for c in configs}
        for batch_size, ctx in cells:
            if over_budget():
                break
            batch = DecodeBatch(contexts(batch_size, ctx), *LAYOUTS[layout])
            splits = heuristic(layout, batch_size, ctx)
            for c in configs:
                times[name(c)].append(
                    cell(batch, layout, batch_size, ctx, c, splits, "variant")["graph_us"])
            del batch
        base = times[name(default)]
        ok = [c for c in configs if (layout, name(c)) not in failed and len(times[name(c)])
              == len(base) and all(t <= TOLERANCE * b for t, b in zip(times[name(c)][1:],
                                                                       base[1:]))]
        chosen[layout] = min(ok, key=lambda c: times[name(c)][0], default=default)
        results["chosen"][layout] = chosen[layout]
        ranked = sorted(configs, key=lambda c: times[name(c)][0] if times[name(c)] else 1e9)
        print(f"{layout}: " + ", ".join(f"B{b} ctx{x} ({heuristic(layout, b, x)}s)"
                                        for b, x in cells[:len(base)]))
        for c in ranked[:12] + ([default] if default not in ranked[:12] else []):
            mark = "*" if c is chosen[layout] else ("=" if c is default else " ")
            print(f" {mark}{name(c):26s} " + " ".join(
                f"{t:7.1f} ({pct_of(layout, b, x, t):3.0f}%)"
                for t, (b, x) in zip(times[name(c)], cells)), flush=True)
        print(f"  chosen for {layout}: {name(chosen[layout])}", flush=True)
        save()

    print(f"\nsweep, heuristic splits: us (% of copy bw), today {name(default)} -> chosen "
          f"{elapsed()}")
    print("| heads | ctx | " + " | ".join(f"B{b}" for b in BATCHES) + " |")
    for layout in LAYOUTS:
        for ctx in CONTEXTS:
            row = []
            for batch_size in BATCHES:
                if over_budget():
                    row.append("-")
                    continue
                batch = DecodeBatch(contexts(batch_size, ctx), *LAYOUTS[layout])
                splits = heuristic(layout, batch_size, ctx)
                before = cell(batch, layout, batch_size, ctx, default, splits, "before")
                after = cell(batch, layout, batch_size, ctx, chosen[layout], splits, "after")
                row.append(f"{before['graph_us']:.1f} ({before['pct']:.0f}%) -> "
                           f"{after['graph_us']:.1f} ({after['pct']:.0f}%) {splits}s")
                del batch
            print(f"| {layout} | {ctx} | " + " | ".join(row) + " |", flush=True)
    save()

    print(f"\nlaunch-free kernel time (torch.profiler) and eager time, us {elapsed()}")
    for layout, (batch_size, ctx) in ((lay, cells[0]) for lay, cells in FOCUS.items()):
        batch = DecodeBatch(contexts(batch_size, ctx), *LAYOUTS[layout])
        for config, splits in ((default, 1), (default, 2), (chosen[layout], 1),
                               (chosen[layout], 2)):
            if over_budget():
                break
            k = kernel_us(batch, config=config, num_splits=splits)
            total = sum(v for key, v in k.items() if key != "eager (not summed)")
            results["rows"].append({"tag": "profiler", "layout": layout, "batch": batch_size,
                                    "ctx": ctx, "config": name(config), "splits": splits,
                                    "kernel_us": k, "pct": round(pct(batch.kv_bytes, total), 1)})
            print(f"  {layout} B{batch_size} ctx{ctx} {name(config)} {splits} splits: "
                  + ", ".join(f"{key} {v:.1f}" for key, v in k.items())
                  + f"; kernels {total:.1f} us ({pct(batch.kv_bytes, total):.0f}%)", flush=True)
        del batch
    save()

    print(f"\nsplit counts, today's config / chosen: graph us (% of copy bw) {elapsed()}")
    for layout, batch_size, ctx in (("llama3-8b", 1, 1024), ("llama3-8b", 8, 1024),
                                    ("llama3-8b", 32, 1024), ("llama3-8b", 64, 1024),
                                    ("qwen3-0.6b", 32, "mix"), ("qwen3-0.6b", 96, "mix")):
        if over_budget():
            break
        batch = DecodeBatch(contexts(batch_size, ctx), *LAYOUTS[layout])
        out = []
        for splits in (1, 2, 3, 4, 8):
            a = cell(batch, layout, batch_size, ctx, default, splits, "splits")
            b = cell(batch, layout, batch_size, ctx, chosen[layout], splits, "splits chosen")
            out.append(f"{splits}: {a['graph_us']:.1f} / {b['graph_us']:.1f} ({b['pct']:.0f}%)")
        print(f"  {layout} B{batch_size} ctx{ctx} (heuristic {heuristic(layout, batch_size, ctx)}"
              "): " + ", ".join(out), flush=True)
        del batch
    save()
    print(f"total {time.perf_counter() - T0:.1f} s")


def pct_of(layout: str, batch_size: int, ctx, us: float) -> float:
    kv_bytes = 2 * 2 * LAYOUTS[layout][1] * HEAD_DIM * sum(contexts(batch_size, ctx))
    return pct(kv_bytes, us)


if __name__ == "__main__":
    sys.exit(main())
