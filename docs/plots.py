"""Turn a `benchmarks/kernel_bench.py --json` run into one PNG per kernel family (matplotlib).

    PYTHONPATH=. python benchmarks/kernel_bench.py --awq --json docs/kernels/h200.json   # on a GPU
    python docs/plots.py docs/kernels/h200.json                                    # anywhere

writes docs/kernels/<family>.png beside the JSON (or into --out DIR), each titled with the run
(device, commit, date) its rows come from. Each figure has two panels:

- a roofline: x = arithmetic intensity I = FLOPs / bytes moved, y = achieved FLOP/s, under the
  ceiling min(peak FLOP/s, I * copy bandwidth) measured in the same run. A kernel left of the
  ridge point (peak / bandwidth, ~190 FLOP/byte on an H200) is memory-bound: the best it can do
  is to ride the slanted line. Rows with no arithmetic (a KV store) have no point here.
- bars of the achieved fraction of the ceiling that bounds the row: bandwidth for memory-bound
  rows (GB/s over copy GB/s), FLOP/s for compute-bound ones.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TITLES = {
    "norm_activation": "RMSNorm (+ residual) and SiLU-and-mul",
    "rotary": "Rotary embedding",
    "kv_cache": "KV-cache store",
    "prefill_attention": "Paged prefill attention (varlen)",
    "decode_attention": "Split-KV decode attention",
    "awq": "AWQ int4 GEMV / MMA / GEMM vs the bf16 linear",
    "gguf": "GGUF block formats (Q4_K, Q6_K, Q8_0) GEMV vs the bf16 linear",
    "gptq_int8": "GPTQ int8 GEMV / split-K GEMM vs the bf16 linear",
    "moe": "Fused MoE (Qwen3-30B-A3B layer): experts, routing, sort by expert",
    "fp8": "FP8 W8A8: quantize + GEMM vs torch._scaled_mm and the bf16 linear",
    "lora": "Multi-LoRA shrink / expand (Llama-3-8B linears, 4 adapters of rank 16)",
}


def load(path: Path) -> dict:
    run = json.loads(path.read_text())
    missing = {"ceilings", "rows"} - set(run)
    if missing:
        raise SystemExit(f"{path}: not a benchmarks/kernel_bench.py --json file "
                         f"(no {sorted(missing)})")
    return run


def plot_family(family: str, rows: list[dict], run: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    run = run.get("runs", {}).get(family, run)  # the run this family was measured in
    bw = run["ceilings"]["copy_GB_s"] * 1e9  # bytes/s
    peak = run["ceilings"]["matmul_TFLOP_s"] * 1e12  # FLOP/s
    timed = [r for r in rows if r["us"] is not None]
    height = max(5.0, 1.5 + 0.22 * len(timed))  # room for one bar label per row
    fig, (roof, bars) = plt.subplots(1, 2, figsize=(13, height),
                                     gridspec_kw={"width_ratios": [1, 1.3]})
    fig.suptitle(f"{TITLES.get(family, family)}: {run.get('device', '?')}, "
                 f"commit {run.get('commit', '?')}, {run.get('date', '?')}")

    points = [r for r in timed if r["flops"] and r["bytes"]]
    intensities = [r["flops"] / r["bytes"] for r in points] or [1.0]
    ridge = peak / bw
    lo = min(min(intensities), ridge) / 4
    hi = max(max(intensities), ridge) * 4
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    roof.plot(xs, [min(peak, x * bw) / 1e12 for x in xs], "k-", lw=1.5,
              label=f"ceiling: {bw / 1e9:,.4g} GB/s, {peak / 1e12:,.4g} TFLOP/s")
    for r in points:
        x, y = r["flops"] / r["bytes"], r["flops"] / (r["us"] * 1e-6) / 1e12
        roof.scatter([x], [y], s=30, label=f"{r['op']}, {r['impl']}: {r['shape']}")
    roof.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP / byte)",
             ylabel="achieved TFLOP/s", title="roofline")
    roof.grid(True, which="both", alpha=0.3)
    roof.legend(fontsize=6, loc="lower right")

    labels = [f"{r['op']} | {r['shape']} | {r['impl']}" for r in timed]
    fractions = [r["pct"] or 0.0 for r in timed]
    colors = ["tab:blue" if r["unit"] == "GB/s" else "tab:orange" for r in timed]
    bars.barh(range(len(timed)), fractions, color=colors)
    for i, r in enumerate(timed):
        bars.text(fractions[i] + 1, i, f"{r['achieved']:,.4g} {r['unit']}, {r['us']:,.4g} us",
                  va="center", fontsize=7)
    bars.set_yticks(range(len(timed)), labels, fontsize=7)
    bars.invert_yaxis()
    bars.set(xlim=(0, max([100.0, *fractions]) * 1.25), title="achieved fraction of the ceiling",
             xlabel="% of copy bandwidth (blue) or of matmul FLOP/s (orange)")
    bars.axvline(100, color="k", lw=0.8)
    fig.tight_layout()
    path = out / f"{family}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path,
                        help="a file written by benchmarks/kernel_bench.py --json")
    parser.add_argument("--out", type=Path, default=None, help="default: the JSON's folder")
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("docs/plots.py needs matplotlib: pip install matplotlib") from None
    run = load(args.json)
    out = args.out or args.json.parent
    out.mkdir(parents=True, exist_ok=True)
    families: dict[str, list[dict]] = {}
    for row in run["rows"]:
        if row.get("family"):  # tile sweeps (--tune) have none
            families.setdefault(row["family"], []).append(row)
    written = [plot_family(f, rows, run, out) for f, rows in families.items()]
    for path in written:
        print(f"wrote {path}")
    if not written:
        raise SystemExit(f"{args.json}: no rows with a kernel family to plot")
    return written


if __name__ == "__main__":
    main()
