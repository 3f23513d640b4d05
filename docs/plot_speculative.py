"""Turn `tinypaged bench latency --speculative-config ... --json FILE` runs into one bar chart of
the speed-up over no speculation (matplotlib), for docs/speculative.md.

    tinypaged bench latency --model-shape llama3-8b --batch-sizes 1 8 \\
        --speculative-config '{"method": "oracle", "num_speculative_tokens": 4}' --json oracle.json
    python docs/plot_speculative.py oracle.json miss.json ngram.json --out docs/speculative.png

Each file becomes one group of bars (one bar per batch size it has), labelled with its file name
and its acceptance rate. `benchmarks/spec_decode_ngram.py --json FILE` writes the same keys
(`speedup_batch_<b>`, `spec_decode.acceptance_rate`). docs/speculative/*.json are the runs behind
docs/speculative.png (benchmarks/RESULTS.md, Speculative decoding, names their sittings).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("docs/speculative.png"))
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(path, json.loads(path.read_text())) for path in args.runs]
    keys = {path: sorted((k for k in run if k.startswith("speedup_batch_")),
                         key=lambda k: int(k.rsplit("_", 1)[1])) for path, run in runs}
    for path, _ in runs:
        if not keys[path]:
            raise SystemExit(f"{path}: no speedup_batch_* entries (run bench latency with "
                             f"--speculative-config and --json)")
    batches = sorted({int(k.rsplit("_", 1)[1]) for ks in keys.values() for k in ks})
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(runs)
    for i, (path, run) in enumerate(runs):  # a run without some batch size leaves its slot empty
        spec = run.get("spec_decode") or {}
        drafted = max(spec.get("num_draft_tokens", 0), 1)
        rate = spec.get("acceptance_rate", spec.get("num_accepted_tokens", 0) / drafted)
        xs = [batches.index(int(k.rsplit("_", 1)[1])) + i * width for k in keys[path]]
        ax.bar(xs, [run[k] for k in keys[path]], width,
               label=f"{path.stem} ({100 * rate:.0f}% accepted)")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(batches))])
    ax.set_xticklabels([f"batch {b}" for b in batches])
    ax.set_ylabel("tok/s over no speculation")
    ax.set_title("Speculative decoding speed-up")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    return args.out


if __name__ == "__main__":
    print(main())
