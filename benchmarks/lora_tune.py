"""Sweep the LoRA kernels' tiles (kernels/lora_shrink.py `LORA_TILES`) on the GPU, band by band.

    PYTHONPATH=benchmarks:. python benchmarks/lora_tune.py [--tokens 1 8 64 512 4096] [--quick]
    PYTHONPATH=benchmarks:. python benchmarks/lora_tune.py --layer [--tokens 1 8 64 512]

For each batch size T it times, in CUDA graphs over enough weight copies to spill L2 (as a
model's 32 layers would), the shrink for each candidate (BLOCK_M, shrink BLOCK_N, BLOCK_K,
program target) and the expand for each candidate (expand BLOCK_N, TILES) at the split count
that shrink leaves, over Llama-3-8B's four adapted linears (4 adapters, rank 16, round-robin).
It prints the current table row's total, then the best candidates by total (shrink + expand
over the four layers, one decoder layer's LoRA time), as LORA_TILES rows to paste.

`--layer` times instead one decoder layer's four linears as a step runs them, in one CUDA graph:
each base matmul (the engine's dense_linear: the split-K GEMV at decode sizes) then its shrink
and expand, against the matmuls alone, with programmatic dependent launch on and off
(TINYPAGED_LORA_PDL), and with the shrink on a side stream beside the matmul (the engine's
TINYPAGED_LORA_OVERLAP=1), and checks that the replayed graph's y equals x W^T plus the
references' delta.
"""

from __future__ import annotations

import argparse
import itertools
import os

import torch
from awq_gemv import graph_us
from lora_kernels import LAYERS, case

from tinypaged.kernels import lora_shrink
from tinypaged.kernels.dense_gemv import dense_linear
from tinypaged.kernels.lora_expand import lora_expand_ref, lora_expand_triton
from tinypaged.kernels.lora_shrink import lora_shrink_ref, lora_shrink_triton, shrink_splits
from tinypaged.lora.side_stream import SideStream

L2_BYTES = 120 << 20  # weight copies cycled per graph: twice the H200's L2


def copies_of(t: dict) -> int:
    a, b = t["a"], t["b"]
    return max(1, min(32, L2_BYTES // (a.numel() * 2 + b.numel() * 2)))


def build(t: int, layer: str) -> dict:
    x, a, b, y, meta, offsets = case(t, layer)
    d = {"x": x, "a": a, "b": b, "y": y, "meta": meta, "offsets": offsets}
    n = copies_of(d)
    d["as"] = [a] + [a.clone() for _ in range(n - 1)]
    d["bs"] = [b] + [b.clone() for _ in range(n - 1)]
    return d


def set_row(row: tuple) -> None:
    lora_shrink.LORA_TILES = ((1 << 62, *row[1:]),)


def time_shrink(d: dict, t: int) -> tuple[float, torch.Tensor]:
    k, n = d["x"].shape[1], d["a"].shape[1]
    h = torch.empty(shrink_splits(t, k), t, n, device="cuda")
    calls = [lambda a=a: lora_shrink_triton(d["x"], a, *d["meta"], h) for a in d["as"]]
    return graph_us(calls), h


def time_expand(d: dict, h: torch.Tensor) -> float:
    calls = [lambda b=b: lora_expand_triton(d["y"], h, b, *d["meta"], d["offsets"])
             for b in d["bs"]]
    return graph_us(calls)


def check(d: dict, h: torch.Tensor) -> bool:
    got = lora_expand_triton(d["y"].clone(), h, d["b"], *d["meta"], d["offsets"])
    want = lora_expand_ref(d["y"].clone(), h, d["b"], *d["meta"], d["offsets"])
    return torch.allclose(got.float(), want.float(), atol=5e-2, rtol=2e-2)


def candidates(t: int, quick: bool):
    """(BLOCK_Ms, shrink (BLOCK_N, BLOCK_K, programs), expand (BLOCK_N, TILES)) to try at T."""
    block_ms = [16] if t <= 16 else [16, 32] if t <= 64 else [32, 64] if t <= 512 else [64]
    if t <= 64:  # latency-bound: few row tiles, so `programs` is nearly the split count
        programs = (4, 8, 16, 32, 64, 128) if not quick else (8, 16, 32)
        shrinks = itertools.product((16, 64), (64, 128, 256), programs)
        expands = itertools.product((128, 256, 512), (1, 2, 4))
    else:
        programs = (128, 256, 512) if not quick else (256, 512)
        shrinks = itertools.product((16, 64), (64, 128), programs)
        expands = itertools.product((64, 128, 256), (1, 2, 4, 8))
    return block_ms, list(shrinks), list(expands)


def sweep(t: int, quick: bool, top: int) -> None:
    cases = {layer: build(t, layer) for layer in LAYERS}
    original = lora_shrink.LORA_TILES
    current = lora_shrink.lora_tiles(t)
    results = []
    block_ms, shrinks, expands = candidates(t, quick)
    for block_m in block_ms:
        shrink_us, planes = {}, {}
        for sn, sk, prog in shrinks:
            set_row((0, block_m, sn, sk, prog, 64, 1))
            for layer, d in cases.items():
                us, h = time_shrink(d, t)
                shrink_us[(sn, sk, prog, layer)] = us
                planes[(sn, sk, prog, layer)] = h
        expand_us = {}
        for (sn, sk, prog), (en, tiles) in itertools.product(shrinks, expands):
            if block_m * en > 8192:  # the [BM, BN] fp32 delta past 64 registers a thread
                continue
            total = 0.0
            set_row((0, block_m, sn, sk, prog, en, tiles))
            for layer, d in cases.items():
                h = planes[(sn, sk, prog, layer)]
                key = (h.shape[0], en, tiles, layer)
                if key not in expand_us:
                    if not check(d, h):
                        print(f"  MISMATCH T={t} {layer} BM{block_m} {en} x{tiles}")
                        expand_us[key] = float("inf")
                    else:
                        expand_us[key] = time_expand(d, h)
                total += shrink_us[(sn, sk, prog, layer)] + expand_us[key]
            results.append((total, (t, block_m, sn, sk, prog, en, tiles)))
    lora_shrink.LORA_TILES = original
    results.sort()
    now = next((r for r in results if r[1][1:] == current[1:]), None)
    print(f"T={t}: current row {current[1:]}: "
          f"{now[0]:.1f} us a layer" if now else f"T={t}: current row not in the sweep")
    for total, row in results[:top]:
        print(f"  {total:7.1f} us  {row},")


def layer_step(t: int, lora: bool, overlap: bool = False) -> tuple:
    """(fn running the four linears of one layer, their cases with base weights `w`); with
    `overlap` each shrink runs on the side stream beside its base matmul (lora/side_stream.py),
    as the engine's layers do under TINYPAGED_LORA_OVERLAP=1."""
    cases = []
    for layer in LAYERS:
        d = build(t, layer)
        d["w"] = torch.randn(d["offsets"][-1], d["x"].shape[1], device="cuda",
                             dtype=torch.bfloat16) * 0.01  # [out, in] base weight
        d["h"] = torch.empty(shrink_splits(t, d["x"].shape[1]), t, d["a"].shape[1], device="cuda")
        cases.append(d)
    side = SideStream(torch.device("cuda", torch.cuda.current_device())) if overlap else None

    def fn():
        for d in cases:
            if side is not None:
                with side.fork():
                    lora_shrink_triton(d["x"], d["a"], *d["meta"], d["h"])
            d["y"] = dense_linear(d["x"], d["w"])  # the engine's base matmul (a GEMV at decode)
            if side is not None:
                side.join()
            elif lora:
                lora_shrink_triton(d["x"], d["a"], *d["meta"], d["h"])
            if lora or side is not None:
                lora_expand_triton(d["y"], d["h"], d["b"], *d["meta"], d["offsets"])
    return fn, cases


def graph_correct(t: int, overlap: bool = False) -> bool:
    """Whether a replay of the layer's graph gives x W^T plus the references' delta."""
    fn, cases = layer_step(t, True, overlap)
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for d in cases:
        d["y"].fill_(7.0)  # the graph's own output buffer, rewritten by the replay
    g.replay()
    torch.cuda.synchronize()
    ok = True
    for d in cases:
        want = torch.mm(d["x"], d["w"].T)
        h = lora_shrink_ref(d["x"], d["a"], *d["meta"], torch.zeros(1, t, d["a"].shape[1],
                                                                    device="cuda"))
        lora_expand_ref(want, h, d["b"], *d["meta"], d["offsets"])
        ok &= torch.allclose(d["y"].float(), want.float(), atol=5e-2, rtol=2e-2)
    return ok


def layer_overhead(t: int) -> None:
    base = graph_us([layer_step(t, False)[0]], reps=6)
    line = f"T={t}: one layer's 4 base GEMMs {base:7.1f} us; LoRA adds"
    for pdl, overlap in (("0", False), ("1", False), ("0", True)):
        os.environ["TINYPAGED_LORA_PDL"] = pdl
        lora = graph_us([layer_step(t, True, overlap)[0]], reps=6)
        mode = "overlap" if overlap else f"PDL {pdl}"
        ok = "ok" if graph_correct(t, overlap) else "WRONG"
        line += f" {lora - base:6.1f} us ({mode}, graph {ok})"
    os.environ.pop("TINYPAGED_LORA_PDL")
    print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 512, 4096])
    parser.add_argument("--quick", action="store_true", help="fewer program targets")
    parser.add_argument("--top", type=int, default=6)
    parser.add_argument("--layer", action="store_true",
                        help="one layer's base GEMMs + LoRA in a graph: PDL on and off, overlap")
    args = parser.parse_args()
    for t in args.tokens:
        if args.layer:
            layer_overhead(t)
        else:
            sweep(t, args.quick, args.top)


if __name__ == "__main__":
    main()
