# ruff: noqa: B023  (each lambda is timed at once, in its own iteration)
"""benchmarks/moe_fp8_gpu.py --sweep: the FP8 fused MoE's tiles (kernels/moe_fp8.py,
FP8_MOE_CONFIGS) on one H200, Qwen3-30B-A3B layer shape (hidden 2048, 128 experts, top-8,
moe_intermediate 768, bf16 x), in one command of under ~170 s (--budget-s bounds it).

1. Compiles: every candidate tile (CANDIDATES, the table's own first) of both launches (the
   gated gate-up w13 [E, 1536, 2048] and the down w2 [E, 2048, 768]) for both scale kinds
   (per channel, what quantization="fp8" makes at load; block-wise [128, 128], the Qwen3-FP8
   checkpoints), in a pool of processes that fill Triton's cache (compiles are most of a
   sweep's time); a tile that does not compile or fit in shared memory is dropped.
2. Timings: each launch alone (x already quantized, the sort by expert made once per BLOCK_M),
   CUDA-graph replays, at T in FP8_MOE_TOKENS (16 ... 16384; at most 8 tokens the engine takes
   the GEMVs, moe_gemv.use_gemv, so those T are not swept), candidate after candidate until the
   budget; at each T only the BLOCK_M that suit it (block_ms).
3. The best (gate-up, down) pair per T and scale kind sharing one BLOCK_M, each checked once
   against fused_experts_fp8_reference (relative L2 error under 3e-2); then the whole layer
   (quantize, sort, two launches, SiLU-and-mul quantization, top-k sum) with the table's
   tiles and with the best, beside the bf16 fused_experts on the dequantized weights; and the
   table to paste:

    python3 .gpu/paste.py OUT.txt tinypaged/kernels/moe_fp8.py FP8_MOE_CONFIGS
"""
import itertools
import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor, wait

import torch

from tinypaged.kernels import moe, moe_fp8, moe_gemv
from tinypaged.kernels.fp8 import FP8_MAX, quantize_fp8
from tinypaged.kernels.moe_align import moe_align_block_size

DEV = "cuda"
E, H, INTER, TOP_K = 128, 2048, 768, 8
KINDS = {"channel": None, "block": (128, 128)}
LAUNCHES = ("gate_up", "down")
KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
SMEM = 227 * 1024  # sm_90's shared memory for one block
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), most promising first after the table's
# own (a budget cut short still times those); block-wise BLOCK_K divides 128 (256 -> dropped)
CANDIDATES = [
    (16, 128, 128, 4, 3), (16, 128, 128, 4, 4), (16, 64, 128, 4, 4), (16, 128, 128, 4, 5),
    (16, 64, 256, 4, 3), (16, 128, 256, 4, 3), (16, 256, 128, 4, 3), (16, 64, 128, 4, 6),
    (16, 256, 128, 4, 4), (16, 128, 128, 8, 4), (16, 64, 256, 4, 4),
    (32, 128, 128, 4, 3), (32, 128, 128, 4, 4), (32, 64, 128, 4, 4), (32, 128, 256, 4, 3),
    (32, 256, 128, 4, 3), (32, 64, 128, 4, 6),
    (64, 128, 128, 4, 4), (64, 128, 128, 8, 4), (64, 64, 128, 4, 4), (64, 256, 128, 8, 3),
    (64, 128, 256, 4, 3), (64, 128, 64, 4, 5), (64, 256, 128, 4, 3), (64, 64, 256, 4, 3),
    (64, 128, 128, 4, 5),
    (128, 128, 128, 8, 4), (128, 128, 128, 4, 3), (128, 256, 128, 8, 3), (128, 64, 128, 4, 4),
    (128, 128, 64, 8, 5), (128, 256, 64, 8, 4), (128, 128, 256, 8, 3), (128, 64, 256, 4, 3),
]


def candidates(kind):
    """[config dict]: the table's tiles first, then CANDIDATES, deduplicated."""
    block = KINDS[kind]
    out = []
    for launch, t in itertools.product(LAUNCHES, moe_fp8.FP8_MOE_TOKENS):
        suffix = "" if block is None else "_block"
        out.append(dict(moe_fp8.FP8_MOE_CONFIGS[f"{launch}_t{t}{suffix}"]))
    out += [dict(zip(KEYS, c)) for c in CANDIDATES]
    seen, unique = set(), []
    for c in out:
        key = tuple(c[k] for k in KEYS)
        if key not in seen and (block is None or block[1] % c["BLOCK_K"] == 0):
            seen.add(key)
            unique.append(c)
    return unique


def fits(launch, c):
    """Whether the pipeline's buffers (each an A tile and one or, gated, two B tiles of e4m3)
    fit: num_stages of them for wgmma (BLOCK_M >= 64), one fewer for mma.sync (as Triton 3.6
    builds them for sm_90)."""
    b_tiles = 2 if launch == "gate_up" else 1
    stage = c["BLOCK_K"] * (c["BLOCK_M"] + b_tiles * c["BLOCK_N"])
    return (c["num_stages"] - (c["BLOCK_M"] < 64)) * stage <= SMEM - 4 * 1024


def block_ms(t):
    """The BLOCK_M timed at T: up to ~T k / E / 2 rows of an expert's run (at least 16), and
    past T 2048 none under ~T k / E / 16 (small blocks re-read the expert's weights)."""
    return [bm for bm in (16, 32, 64, 128) if min(64, max(16, t // 128)) <= bm <= max(16, t // 8)]


def make_weights(kind, experts=E, gen=None):
    """{"w13", "w2", "s13", "s2", "d13", "d2"}: e4m3 experts, fp32 scales, bf16 dequantized."""
    block = KINDS[kind]
    out = {}
    for name, rows, cols in (("13", 2 * INTER, H), ("2", H, INTER)):
        w = torch.randn(experts, rows, cols, device=DEV, generator=gen) * 0.02
        if block:
            b = w.reshape(experts, rows // 128, 128, cols // 128, 128)
            s = b.abs().amax((2, 4)) / FP8_MAX
            q = (b / s[:, :, None, :, None]).reshape(experts, rows, cols).to(torch.float8_e4m3fn)
            deq = (q.float().reshape(b.shape) * s[:, :, None, :, None]).reshape(w.shape)
        else:
            s = w.abs().amax(2, keepdim=True) / FP8_MAX
            q = (w / s).to(torch.float8_e4m3fn)
            deq = q.float() * s
        del w
        out["w" + name], out["s" + name], out["d" + name] = q, s, deq.to(torch.bfloat16)
    return out


def routing(t, experts=E, gen=None):
    logits = torch.randn(t, experts, device=DEV, generator=gen)
    w, ids = torch.topk(torch.softmax(logits, -1), TOP_K, dim=-1)
    return w / w.sum(-1, keepdim=True), ids.to(torch.int32)


class Case:
    """One T and scale kind: x, its quantization, a SiLU-and-mul output and its quantization,
    the sorts by expert (per BLOCK_M) and the outputs; launch(launch, config) runs one GEMM."""

    def __init__(self, t, kind, wts, experts=E, gen=None):
        self.block, self.w = KINDS[kind], wts
        group = None if self.block is None else self.block[1]
        self.x = torch.randn(t, H, device=DEV, generator=gen, dtype=torch.bfloat16)
        self.topk_w, self.ids = routing(t, experts, gen)
        self.weights = self.topk_w.reshape(-1).float()
        self.pairs = t * TOP_K
        self.xq, self.xs = quantize_fp8(self.x, group=group)
        act = torch.randn(self.pairs, INTER, device=DEV, generator=gen, dtype=torch.bfloat16)
        self.aq, self.as_ = quantize_fp8(act, group=group)
        self.act = torch.empty_like(act)
        self.y = torch.empty(self.pairs, H, device=DEV, dtype=torch.bfloat16)
        self.experts, self.aligns = experts, {}

    def launch(self, launch, c):
        bm = c["BLOCK_M"]
        if bm not in self.aligns:
            self.aligns[bm] = moe_align_block_size(self.ids, bm, self.experts)
        if launch == "gate_up":
            moe_fp8._launch(self.xq, self.xs, self.w["w13"], self.w["s13"], self.act,
                            self.aligns[bm], self.weights, self.pairs, self.block,
                            a_row_div=TOP_K, gated=True, mul_weight=False, config=c)
        else:
            moe_fp8._launch(self.aq, self.as_, self.w["w2"], self.w["s2"], self.y,
                            self.aligns[bm], self.weights, self.pairs, self.block,
                            a_row_div=1, gated=False, mul_weight=True, config=c)


def graph_us(fn, reps):
    """Median us of one call, from replays of a CUDA graph of `reps` calls."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(times)[2]


def reps_for(t):
    return 20 if t <= 512 else 8 if t <= 4096 else 3


def zero_weights(kind, bf16=False):
    """make_weights' layout (the bf16 ones only with `bf16`), all zeros: enough for a compile
    (the pool's processes)."""
    block = KINDS[kind]
    out = {}
    for name, rows, cols in (("13", 2 * INTER, H), ("2", H, INTER)):
        out["w" + name] = torch.zeros(E, rows, cols, device=DEV, dtype=torch.float8_e4m3fn)
        out["s" + name] = torch.ones((E, rows, 1) if block is None else
                                     (E, rows // 128, cols // 128), device=DEV)
        if bf16:
            out["d" + name] = torch.zeros(E, rows, cols, device=DEV, dtype=torch.bfloat16)
    return out


def compile_task(kind, config):
    """In a pool process: compile (and run once) both launches of `config` at T = 16, which
    fills Triton's cache for every T (no launch argument specializes on T; the sort's kernel,
    run up to T = 128, does on E, so all 128 experts). -> (launch, error) pairs, error None
    when it compiled."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    case = Case(16, kind, zero_weights(kind), gen=gen)
    out = []
    for launch in LAUNCHES:
        if not fits(launch, config):
            out.append((launch, "shared memory"))
            continue
        try:
            case.launch(launch, config)
            sync()
            out.append((launch, None))
        except Exception as e:  # noqa: BLE001  (a tile that does not compile or fit)
            out.append((launch, f"{type(e).__name__}: {str(e)[:80]}"))
    return out


def bf16_task():
    """In a pool process: the bf16 fused_experts at every swept T (its kernels' compiles)."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    wts = zero_weights("channel", bf16=True)
    for t in moe_fp8.FP8_MOE_TOKENS:
        w, ids = routing(t, E, gen)
        x = torch.randn(t, H, device=DEV, dtype=torch.bfloat16, generator=gen)
        moe.fused_experts(x, wts["d13"], wts["d2"], w, ids)
    sync()
    return []


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def precompile(cands, deadline):
    """Fill Triton's cache in a pool of processes; -> {(kind, launch, key)}: tiles that failed.
    Tasks still running at `deadline` are left (the timing loop compiles what it meets)."""
    failed = set()
    workers = max(1, min(16, (os.cpu_count() or 2) - 1))
    ctx = multiprocessing.get_context("spawn")
    try:
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx)
        futures = {pool.submit(bf16_task): None}
        for kind, cs in cands.items():
            for c in cs:
                futures[pool.submit(compile_task, kind, c)] = (kind, c)
        done, pending = wait(futures, timeout=max(1.0, deadline - time.time()))
        for f in done:
            if futures[f] is None:
                continue
            kind, c = futures[f]
            try:
                for launch, err in f.result():
                    if err:
                        failed.add((kind, launch, key_of(c)))
                        print(f"  ({kind} {launch} {key_of(c)}: {err})", flush=True)
            except Exception as e:  # noqa: BLE001  (a worker that died: time it in-process)
                print(f"  (compile task {kind} {key_of(c)}: {type(e).__name__})", flush=True)
        print(f"  compiled {len(done)} of {len(futures)} tasks in {workers} processes "
              f"({len(pending)} left to the timing loop)", flush=True)
        for f in pending:
            f.cancel()
        # compiles still running would share the GPU and CPUs with the timings: end the pool's
        # own processes
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.terminate()
        pool.shutdown(wait=False, cancel_futures=True)
    except Exception as e:  # noqa: BLE001  (no pool: compiles happen as the loop meets them)
        print(f"  (no compile pool: {type(e).__name__}: {str(e)[:80]})", flush=True)
    return failed


def key_of(c):
    return tuple(c[k] for k in KEYS)


def time_candidates(cands, failed, deadline, wts):
    """{kind: {t: {launch: {key: us}}}} for the candidates in turn until `deadline`."""
    times = {kind: {t: {launch: {} for launch in LAUNCHES} for t in moe_fp8.FP8_MOE_TOKENS}
             for kind in KINDS}
    gen = torch.Generator(device=DEV).manual_seed(1)
    cases = {(kind, t): Case(t, kind, wts[kind], gen=gen)
             for kind in KINDS for t in moe_fp8.FP8_MOE_TOKENS}
    order = [(kind, c) for pair in itertools.zip_longest(*cands.values()) for kind, c in
             zip(KINDS, pair) if c is not None]
    for i, (kind, c) in enumerate(order):
        if time.time() > deadline:
            print(f"  budget spent after {i} of {len(order)} candidates", flush=True)
            break
        for launch in LAUNCHES:
            if (kind, launch, key_of(c)) in failed or not fits(launch, c):
                continue
            try:
                for t in moe_fp8.FP8_MOE_TOKENS:
                    if c["BLOCK_M"] in block_ms(t):
                        case = cases[kind, t]
                        times[kind][t][launch][key_of(c)] = graph_us(
                            lambda: case.launch(launch, c), reps_for(t))
            except Exception as e:  # noqa: BLE001  (a tile that does not compile or fit)
                print(f"  ({kind} {launch} {key_of(c)}: {type(e).__name__}: {str(e)[:80]})",
                      flush=True)
                for by_launch in times[kind].values():
                    by_launch[launch].pop(key_of(c), None)
    return times, cases


def best_pair(by_launch):
    """(us, gate-up key, down key): the fastest pair sharing a BLOCK_M, or None."""
    options = []
    for bm in (16, 32, 64, 128):
        gu = [(us, k) for k, us in by_launch["gate_up"].items() if k[0] == bm]
        dn = [(us, k) for k, us in by_launch["down"].items() if k[0] == bm]
        if gu and dn:
            (gu_us, gu_k), (dn_us, dn_k) = min(gu), min(dn)
            options.append((gu_us + dn_us, gu_k, dn_k))
    return min(options) if options else None


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def summary(times, cases, wts, check=True):
    """The per-T table (whole layers: bf16, FP8 with the table's tiles, FP8 with the best) and
    FP8_MOE_CONFIGS with the best pairs; -> the number of failed checks."""
    bad, entries, checked = 0, {}, {}
    print("\nus per layer call (CUDA-graph replays): bf16 fused_experts on the dequantized "
          "weights, FP8 with FP8_MOE_CONFIGS' tiles and with the best; GEMMs: the two grouped "
          "launches alone (table tiles, best pair); x faster = time ratio")
    print("| scales | T | bf16 | fp8 table | fp8 best | best vs table | best vs bf16 | "
          "GEMMs table | GEMMs best | gate_up | down |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for kind, by_t in times.items():
        block = KINDS[kind]
        suffix = "" if block is None else "_block"
        for t, by_launch in by_t.items():
            table = moe_fp8.fp8_moe_config(t, block)
            table_launch = [by_launch[launch].get(key_of(c)) for launch, c in
                            zip(LAUNCHES, table)]
            found = best_pair(by_launch)
            if found is None:
                print(f"| {kind} | {t} | (no timings) |")
                continue
            us, gu_k, dn_k = found
            gu, dn = dict(zip(KEYS, gu_k)), dict(zip(KEYS, dn_k))
            case = cases[kind, t] if cases else None
            row = {}
            if case is not None:
                args = (case.x, wts[kind]["w13"], wts[kind]["w2"], wts[kind]["s13"],
                        wts[kind]["s2"], case.topk_w, case.ids, block)
                if check and (kind, gu_k, dn_k) not in checked:
                    got = moe_fp8.fused_experts_fp8_triton(*args, config=gu, down_config=dn)
                    err = rel_err(got, moe_fp8.fused_experts_fp8_reference(*args))
                    checked[kind, gu_k, dn_k] = err
                    bad += not err < 3e-2
                    print(f"  {'ok  ' if err < 3e-2 else 'FAIL'} {kind} T={t} {gu_k} {dn_k}: "
                          f"rel err {err:.1e}", flush=True)
                reps = reps_for(t)
                row["bf16"] = graph_us(lambda: moe.fused_experts(
                    case.x, wts[kind]["d13"], wts[kind]["d2"], case.topk_w, case.ids), reps)
                row["table"] = graph_us(lambda: moe_fp8.fused_experts_fp8_triton(*args), reps)
                row["best"] = graph_us(lambda: moe_fp8.fused_experts_fp8_triton(
                    *args, config=gu, down_config=dn), reps)
            else:  # the dry run
                row = {"bf16": 2 * us, "table": 1.2 * us, "best": us}
            launches = ("n/a" if None in table_launch else f"{sum(table_launch):.1f}")
            print(f"| {kind} | {t} | {row['bf16']:.1f} | {row['table']:.1f} | "
                  f"{row['best']:.1f} | {row['table'] / row['best']:.2f}x | "
                  f"{row['bf16'] / row['best']:.2f}x | {launches} | "
                  f"{us:.1f} | {gu_k} | {dn_k} |", flush=True)
            entries[f"gate_up_t{t}{suffix}"] = gu
            entries[f"down_t{t}{suffix}"] = dn
    from fp8_rows_sweep import print_table
    print("\n# FP8 fused-MoE tiles from this sweep (kernels/moe_fp8.py)")
    print_table("FP8_MOE_CONFIGS", {k: entries.get(k, v)
                                    for k, v in moe_fp8.FP8_MOE_CONFIGS.items()})
    return bad


def dry_run():
    """The tables on made-up timings (no GPU): the printing and the paste format."""
    times = {}
    for kind in KINDS:
        cs = candidates(kind)
        times[kind] = {t: {launch: {key_of(c): 10.0 + (i * 7 + t) % 13
                                    for i, c in enumerate(cs)
                                    if c["BLOCK_M"] in block_ms(t) and fits(launch, c)}
                           for launch in LAUNCHES} for t in moe_fp8.FP8_MOE_TOKENS}
    summary(times, None, None, check=False)


def main(budget_s: float, dry: bool = False, json_path: str | None = None) -> int:
    """--sweep: compiles, timings until budget_s from the start, checks, tables; -> failures."""
    if dry:
        dry_run()
        return 0
    start = time.time()
    cands = {kind: candidates(kind) for kind in KINDS}
    print(f"T <= {max(t for t in range(1, 64) if moe_gemv.use_gemv(t, TOP_K, E))} take the "
          "sort-free GEMVs (moe_gemv.use_gemv), not these tiles; swept T: "
          f"{moe_fp8.FP8_MOE_TOKENS}", flush=True)
    print(f"compiling {sum(map(len, cands.values()))} candidates x 2 launches", flush=True)
    failed = precompile(cands, start + budget_s * 0.45)
    gen = torch.Generator(device=DEV).manual_seed(0)
    wts = {kind: make_weights(kind, gen=gen) for kind in KINDS}
    # the checks and whole-layer timings of the summary take ~15% of the budget
    times, cases = time_candidates(cands, failed, start + budget_s * 0.8, wts)
    bad = summary(times, cases, wts)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({kind: {str(t): {launch: {str(k): us for k, us in v.items()}
                                       for launch, v in by_l.items()}
                              for t, by_l in by_t.items()} for kind, by_t in times.items()},
                      f, indent=1)
    print(f"\n{bad} failed checks; total {time.time() - start:.0f} s")
    return bad
