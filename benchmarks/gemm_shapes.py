"""cuBLAS on the GEMMs of the offline workload: how close each linear of a model shape gets to
the roofline at the row counts the engine sends, through cuBLAS and through cuBLASLt.

    PYTHONPATH=. python benchmarks/gemm_shapes.py [--model-shape llama3-8b] [--m 256 16384]

For each linear (qkv, o, gate_up, down, lm_head) and each M: y [M, N] = x [M, K] @ W [N, K]^T in
bf16, timed as the mean of CUDA-graph replays of 20 calls that cycle through enough copies of
W (>= 256 MB in all) that no call finds its weight in the 50 MB L2, as in a decode step where
every layer reads its own weights. The roofline of one call is max(2 M N K / 790 TFLOP/s,
(N K + M K + M N) * 2 bytes / 4.2 TB/s). `torch.backends.cuda.preferred_blas_library` selects
the library; the engine runs with torch's default (cuBLAS). The LM head is timed only at
decode-sized M (the engine computes logits for sampled rows only).
"""

from __future__ import annotations

import argparse
import json

import torch

from tinypaged.bench.model_shapes import SHAPES
from tinypaged.bench.offline import COPY_BW, PEAK_FLOPS


def linears(cfg: dict) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of the weights of one layer, plus the LM head."""
    h, hd, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    return {"qkv": ((nq + 2 * nkv) * hd, h), "o": (h, nq * hd), "gate_up": (2 * inter, h),
            "down": (h, inter), "lm_head": (cfg["vocab_size"], h)}


def time_linear(m: int, n: int, k: int, calls: int = 20) -> float:
    """Median us of one F.linear [m, k] x [n, k]^T from a CUDA graph of `calls` calls, W cycling
    through copies that defeat L2 (benchmarks/awq_gemv.py's graph_us)."""
    from awq_gemv import graph_us

    copies = max(1, -(-256 * 2**20 // (2 * n * k)))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    return graph_us([lambda w=w: torch.nn.functional.linear(x, w) for w in ws], reps=calls)


def roofline_us(m: int, n: int, k: int) -> float:
    flops = 2 * m * n * k / PEAK_FLOPS
    bytes_ = 2 * (n * k + m * k + m * n) / COPY_BW
    return 1e6 * max(flops, bytes_)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--m", type=int, nargs="+", default=[128, 256, 16384])
    parser.add_argument("--libraries", nargs="+", default=["cublas", "cublaslt"])
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args()
    cfg = SHAPES[args.model_shape]
    layers = cfg["num_hidden_layers"]
    results = []
    print(f"{torch.cuda.get_device_name()}, {args.model_shape}: us per call (TFLOP/s, fraction "
          f"of the roofline)")
    print("| linear | M | N x K | " + " | ".join(args.libraries) + " | roofline us |")
    print("|---|---|---|" + "---|" * len(args.libraries) + "---|")
    step_us: dict = {}
    for m in args.m:
        for name, (n, k) in linears(cfg).items():
            if name == "lm_head" and m > 1024:  # the engine computes it for sampled rows only
                continue
            row = {"linear": name, "m": m, "n": n, "k": k, "roofline_us": roofline_us(m, n, k)}
            cells = []
            for lib in args.libraries:
                torch.backends.cuda.preferred_blas_library(lib)
                us = time_linear(m, n, k)
                row[lib] = us
                times = 1 if name == "lm_head" else layers
                step_us[m, lib] = step_us.get((m, lib), 0.0) + times * us
                cells.append(f"{us:.1f} ({2 * m * n * k / us / 1e6:.0f}, "
                             f"{row['roofline_us'] / us:.2f})")
            results.append(row)
            print(f"| {name} | {m} | {n} x {k} | " + " | ".join(cells)
                  + f" | {row['roofline_us']:.1f} |")
    torch.backends.cuda.preferred_blas_library("cublas")
    for (m, lib), us in step_us.items():
        print(f"M={m}, {lib}: all {layers} layers + LM head = {us / 1e3:.2f} ms per step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "step_ms": {f"{m}|{lib}": us / 1e3
                                                       for (m, lib), us in step_us.items()}}, f)


if __name__ == "__main__":
    main()
