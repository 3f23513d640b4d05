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

from tinypaged.bench import COPY_BW, SHAPES, sample_requests
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
    """Tile configurations compared at the focus cells (attention.DECODE_CONFIG's keys)."""
    def config(block_n, warps, stages, prefetch=0, use_dot=True, head_first=False, maxnreg=None):
        return {"block_n": block_n, "num_warps": warps, "num_stages": stages,
                "prefetch": prefetch, "use_dot": use_dot, "head_first": head_first,
                "maxnreg": maxnreg}

    grid = itertools.product
    out = [config(n, w, s) for n, w, s in grid((32, 64, 128), (2, 4, 8), (1, 2, 3))]
    out += [config(n, 4, s, 1) for n, s in grid((32, 64, 128), (1, 3))]
    out += [config(n, w, s, 2) for n, w, s in grid((32, 64, 128), (4, 8), (1, 2))]
    out += [config(n, 4, s, 3) for n, s in grid((32, 64, 128), (1, 2))]
    out += [config(n, w, 1, p, False) for n, w, p in grid((16, 32, 64), (4, 8), (2, 3))]
    out += [config(n, w, s, head_first=True) for n, w, s in grid((32, 64, 128), (4, 8), (1, 3))]
    out += [config(n, 4, 1, 2, head_first=True) for n in (32, 64)]
    out += [config(32, w, 1, 3, False, True) for w in (4, 8)]
    out += [config(16, w, 1) for w in (2, 4)]
    out += [config(64, 4, s, p, maxnreg=r) for s, p, r in grid((1, 3), (0, 2), (96, 128))]
    return out


def name(config: dict) -> str:
    return (f"n{config['block_n']} w{config['num_warps']} s{config['num_stages']} "
            f"p{config['prefetch']}" + ("" if config["use_dot"] else " sum")
            + (" hf" if config["head_first"] else "")
            + (f" r{config['maxnreg']}" if config["maxnreg"] else ""))


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
    """Mean time of one call from replays of a graph of calls cycling through the copies."""
    calls = max(batch.copies, 4)
    for i in range(batch.copies):
        batch.call(paged_attention_triton, i, **kwargs)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            batch.call(paged_attention_triton, i % batch.copies, **kwargs)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(3):
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[1]


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
    tasks = sorted(set((lay, tuple(sorted(c.items())), s) for lay, c, s in tasks))
    tasks = [(lay, dict(c), s) for lay, c, s in tasks]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--budget-s", type=float, default=55.0)
    args = parser.parse_args()
    results: dict = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
                     "rows": []}
    default = dict(attention.DECODE_CONFIG)
    configs = variants()
    focus = [("llama3-8b", 64, 1024), ("llama3-8b", 64, 512), ("qwen3-0.6b", 96, "mix"),
             ("llama3-8b", 96, "mix"), ("llama3-8b", 64, 2048), ("llama3-8b", 256, 1024),
             ("qwen3-0.6b", 256, "mix")]
    split_cells = [("llama3-8b", 1, 1024), ("llama3-8b", 8, 1024), ("llama3-8b", 32, 1024),
                   ("llama3-8b", 64, 1024), ("qwen3-0.6b", 32, "mix"), ("qwen3-0.6b", 96, "mix"),
                   ("qwen3-0.6b", 128, "mix")]
    split_counts = (1, 2, 3, 4, 8, 16)

    def heuristic(layout, batch_size, ctx):
        return decode_num_splits(batch_size, LAYOUTS[layout][1], max(contexts(batch_size, ctx)),
                                 SMS)

    tasks = [(lay, default, heuristic(lay, b, c)) for lay in LAYOUTS for b in BATCHES
             for c in CONTEXTS]
    tasks += [(lay, c, heuristic(lay, b, ctx)) for lay, b, ctx in focus for c in configs]
    tasks += [(lay, default, s) for lay, _, _ in split_cells for s in split_counts]
    print(precompile(tasks), flush=True)

    def over_budget() -> bool:
        return time.perf_counter() - T0 > args.budget_s

    print("correctness: bf16 vs the torch reference, B8 mix, every variant", flush=True)
    for layout, heads in LAYOUTS.items():
        batch = DecodeBatch(contexts(8, "mix"), *heads, copies=1)
        want = batch.call(paged_attention_ref).float()
        worst = 0.0
        for config in [default, *configs]:  # 3 splits: compiled for the default only
            for splits in (1, 3) if config is default else (1,):
                try:
                    got = batch.call(paged_attention_triton, config=config,
                                     num_splits=splits).float()
                    err = (got - want).abs().max().item()
                except Exception as e:  # noqa: BLE001
                    print(f"  {layout} {name(config)}: {str(e)[:120]}")
                    continue
                worst = max(worst, err)
                if not err < 3e-2:
                    print(f"  FAIL {layout} {name(config)} {splits} splits: max err {err:.2e}")
        print(f"  {layout}: worst max err {worst:.2e}", flush=True)

    def cell(layout, batch_size, ctx, config, splits, tag, batch=None):
        batch = batch or DecodeBatch(contexts(batch_size, ctx), *LAYOUTS[layout])
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

    print("\nfocus cells, every variant (graph us, % of copy bw)", flush=True)
    for layout, batch_size, ctx in focus:
        if over_budget():
            break
        batch = DecodeBatch(contexts(batch_size, ctx), *LAYOUTS[layout])
        splits = heuristic(layout, batch_size, ctx)
        rows = [cell(layout, batch_size, ctx, c, splits, "variant", batch) for c in configs]
        base = cell(layout, batch_size, ctx, default, splits, "variant", batch)
        rows.sort(key=lambda r: r["graph_us"])
        best = ", ".join(f"{r['config']} {r['graph_us']:.1f} ({r['pct']:.0f}%)" for r in rows[:8])
        print(f"{layout} B{batch_size} ctx{ctx} {splits} splits: default {base['graph_us']:.1f} "
              f"({base['pct']:.0f}%); best: {best}; worst: {rows[-1]['config']} "
              f"{rows[-1]['graph_us']:.1f}", flush=True)

    print("\nlaunch-free kernel time (torch.profiler), us", flush=True)
    fastest = min((r for r in results["rows"] if r["tag"] == "variant" and r["batch"] == 64
                   and r["ctx"] == 1024), key=lambda r: r["graph_us"], default=None)
    best_config = next((c for c in configs if fastest and name(c) == fastest["config"]), default)
    for layout, batch_size, ctx, config, splits in (
            ("llama3-8b", 64, 1024, default, 1), ("llama3-8b", 64, 1024, default, 2),
            ("llama3-8b", 64, 1024, best_config, 1), ("qwen3-0.6b", 96, "mix", default, 1)):
        if over_budget():
            break
        batch = DecodeBatch(contexts(batch_size, ctx), *LAYOUTS[layout])
        k = kernel_us(batch, config=config, num_splits=splits)
        total = sum(v for key, v in k.items() if key != "eager (not summed)")
        results["rows"].append({"tag": "profiler", "layout": layout, "batch": batch_size,
                                "ctx": ctx, "config": name(config), "splits": splits,
                                "kernel_us": k, "pct": round(pct(batch.kv_bytes, total), 1)})
        print(f"  {layout} B{batch_size} ctx{ctx} {name(config)} {splits} splits: "
              + ", ".join(f"{key} {v:.1f}" for key, v in k.items())
              + f" = {total:.1f} us ({pct(batch.kv_bytes, total):.0f}%)", flush=True)

    print("\nsplit counts, default config (graph us, % of copy bw)", flush=True)
    for layout, batch_size, ctx in split_cells:
        if over_budget():
            break
        batch = DecodeBatch(contexts(batch_size, ctx), *LAYOUTS[layout])
        rows = [cell(layout, batch_size, ctx, default, s, "splits", batch) for s in split_counts]
        print(f"  {layout} B{batch_size} ctx{ctx} (heuristic {heuristic(layout, batch_size, ctx)}"
              "): " + ", ".join(f"{r['splits']}: {r['graph_us']:.1f} ({r['pct']:.0f}%)"
                                for r in rows), flush=True)

    print(f"\nsweep, default config {name(default)}, heuristic splits: us (% of copy bw)")
    print("| heads | ctx | " + " | ".join(f"B{b}" for b in BATCHES) + " |")
    for layout in LAYOUTS:
        for ctx in CONTEXTS:
            cells = []
            for batch_size in BATCHES:
                if over_budget():
                    cells.append("-")
                    continue
                r = cell(layout, batch_size, ctx, default, heuristic(layout, batch_size, ctx),
                         "sweep")
                cells.append(f"{r['graph_us']:.1f} ({r['pct']:.0f}%, {r['splits']}s)")
            print(f"| {layout} | {ctx} | " + " | ".join(cells) + " |", flush=True)
    print(f"total {time.perf_counter() - T0:.1f} s")
    path = args.json or (os.path.join(os.environ["OUT"], "decattn", "sweep.json")
                         if os.environ.get("OUT") else None)
    if path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
