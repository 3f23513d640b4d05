"""AWQ int4 GEMM / GEMV on one GPU: correctness of every path first, then speed beside bf16.

    PYTHONPATH=. python benchmarks/awq.py            # checks, timings, table (< 2 minutes)
    PYTHONPATH=. python benchmarks/awq.py --sweep    # also sweep launch parameters (~5 min)

1. Each path of `awq_gemm` (batch-1 GEMV, skinny split-K GEMV, tiled GEMM, dequantize + cuBLAS)
   against the fp32 torch reference, bf16 and fp16 activations, group 128, both weight shapes.
   Error = max |y - ref| / max |ref|; any path over its tolerance stops the script (exit 1).
2. Weights 4096x14336 (K x N, an up projection) and 14336x4096 (a down projection): M = 1 and
   16 (decode: memory-bound, reported as packed bytes read per second, timed as CUDA-graph
   replays over weight sets larger than L2) and M = 2048 (prefill: TFLOP/s), each beside a bf16
   `F.linear` with the dense weight; M = 32..512 the tiled kernel against dequantize + cuBLAS,
   which decides `DENSE_MIN_M`.
3. A markdown table closes the output (copy it into benchmarks/RESULTS.md with date and commit).
Targets (issue 7): M = 1 >= 3x faster than bf16; M = 2048 >= 70% of bf16 speed.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

from tinypaged.kernels import awq

DEV, GROUP = "cuda", 128
# decode timings cycle through this many weight sets per call: 4 x 29 MB of packed weights
# overflow the H200's 50 MB L2, as a real model's layers do (one set would be served from L2)
COPIES = 4
SHAPES = ((4096, 14336), (14336, 4096))  # (K, N)
ROWS: list[tuple] = []


def random_awq(K: int, N: int, dtype: torch.dtype):
    """Packed weights like a real checkpoint: zeros near 8, scales giving outputs of order 1."""
    q = torch.randint(0, 16, (K, N), device=DEV)
    z = torch.randint(6, 10, (K // GROUP, N), device=DEV)
    qweight, qzeros = awq.pack_awq(q, z)
    scales = (torch.rand(K // GROUP, N, device=DEV) + 0.5) / (4 * K**0.5)
    return qweight, qzeros, scales.to(torch.float16), dtype


def paths(M: int) -> dict:
    """The launchers that can run M rows: name -> fn(x, qweight, qzeros, scales, group)."""
    out = {"awq_gemm (dispatch)": awq.awq_gemm}
    if M == 1 and hasattr(awq, "_awq_gemv1"):
        out["batch-1 GEMV"] = awq._awq_gemv1
    if 1 < M <= awq.GEMV_MAX_M:  # M = 1 is the batch-1 GEMV's
        out["split-K GEMV"] = awq._awq_gemv
    if M > 1:
        out["tiled GEMM"] = awq._awq_gemm
    out["dequant + cuBLAS"] = dequant_matmul
    return out


def check() -> bool:
    ok = True
    for dtype, (K, N) in itertools.product((torch.bfloat16, torch.float16), SHAPES):
        qweight, qzeros, scales, _ = random_awq(K, N, dtype)
        for M in (1, 4, 16, 33, 300):
            x = torch.randn(M, K, device=DEV, dtype=dtype)
            ref = awq.awq_gemm_reference(x.float(), qweight, qzeros, scales, GROUP)
            for name, fn in paths(M).items():
                y = fn(x, qweight, qzeros, scales, GROUP)
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                # bf16 keeps 8 bits: the output rounding alone is 2^-9 of its size
                tol = 1.6e-2 if dtype == torch.bfloat16 else 2e-3
                good = y.dtype == dtype and y.shape == (M, N) and err <= tol
                ok &= good
                print(f"  {'ok  ' if good else 'FAIL'} {str(dtype)[6:]:8s} {K}x{N} M={M:<4d} "
                      f"{name:20s} rel err {err:.2e} (tol {tol:.0e})")
    return ok


def bench_us(fn, *args, **kwargs) -> float:
    """Median microseconds of fn(*args, **kwargs)."""
    return do_bench(lambda: fn(*args, **kwargs), warmup=25, rep=100, return_mode="median") * 1e3


def decode_us(fn, x, weight_sets) -> float:
    """Microseconds per call, replayed in a CUDA graph as decode runs (do_bench's one launch per
    timing would mostly measure the Python launch gap at these ~30 us sizes)."""
    ms = do_bench_cudagraph(lambda: [fn(x, *w) for w in weight_sets], rep=100,
                            return_mode="median")
    return ms * 1e3 / len(weight_sets)


def dequant_matmul(x, *weights):
    return x @ awq.awq_dequantize(*weights, dtype=x.dtype)


def record(shape: str, M: int, impl: str, us: float, value: float, unit: str, vs_bf16: float):
    print(f"  {shape:11s} M={M:<5d} {impl:22s} {us:9.1f} us {value:8.1f} {unit:7s} "
          f"{vs_bf16:5.2f}x bf16")
    ROWS.append((shape, M, impl, us, value, unit, vs_bf16))


def timings(sweep: bool) -> None:
    for K, N in SHAPES:
        awq_sets = [(*random_awq(K, N, torch.bfloat16)[:3], GROUP) for _ in range(COPIES)]
        dense_sets = [(torch.randn(N, K, device=DEV, dtype=torch.bfloat16),)
                      for _ in range(COPIES)]
        weights = awq_sets[0]
        packed_bytes = K * N // 2 + (K // GROUP) * N * (2 + 0.5)  # qweight, scales, qzeros
        shape = f"{K}x{N}"
        for M in (1, 16, 2048):
            x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
            memory_bound = M <= awq.GEMV_MAX_M
            if memory_bound:
                base = decode_us(F.linear, x, dense_sets)
            else:
                base = bench_us(F.linear, x, *dense_sets[0])
            for name, fn in [("bf16 F.linear", None), *paths(M).items()]:
                if fn is None:
                    us = base
                else:
                    us = decode_us(fn, x, awq_sets) if memory_bound else bench_us(fn, x, *weights)
                if memory_bound:  # bytes the kernel must read: the weights (dense: bf16)
                    value, unit = (2 * K * N if fn is None else packed_bytes) / us / 1e3, "GB/s"
                else:
                    value, unit = 2 * M * K * N / us / 1e6, "TFLOP/s"
                record(shape, M, name, us, value, unit, base / us)
        print(f"  {shape}: tiled GEMM vs dequantize + cuBLAS (decides DENSE_MIN_M = "
              f"{awq.DENSE_MIN_M})")
        for M in (32, 64, 128, 256, 512):
            x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
            tiled, dq = bench_us(awq._awq_gemm, x, *weights), bench_us(dequant_matmul, x, *weights)
            print(f"    M={M:<4d} tiled {tiled:8.1f} us   dequant + cuBLAS {dq:8.1f} us")
        if sweep:
            sweep_configs(K, N, weights)


def sweep_configs(K: int, N: int, weights) -> None:
    """The fastest launch parameters of the skinny GEMV (M = 16) and tiled GEMM (M = 128)."""
    for M, fn, grid in (
        (16, awq._awq_gemv, [dict(block_n=bn, split_k=sk, num_warps=w) for bn, sk, w in
                             itertools.product((64, 128, 256), (None, 2, 4, 8, 16), (4, 8))]),
        (128, awq._awq_gemm, [dict(block_m=bm, block_n=bn, block_k=bk, num_warps=w,
                                   num_stages=s) for bm, bn, bk, w, s in
                              itertools.product((64, 128), (64, 128, 256), (32, 64, 128), (4, 8),
                                                (3, 4))]),
    ):
        x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
        results = []
        for kwargs in grid:
            try:
                results.append((bench_us(fn, x, *weights, **kwargs), kwargs))
            except Exception as e:  # noqa: BLE001 (a config the compiler rejects: skip it)
                print(f"    {fn.__name__} {kwargs}: {type(e).__name__}")
        print(f"  {K}x{N} M={M} {fn.__name__}: fastest launch parameters")
        for us, kwargs in sorted(results, key=lambda r: r[0])[:5]:
            print(f"    {us:8.1f} us  {kwargs}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true", help="also sweep launch parameters")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: AWQ int4, group {GROUP}")
    print("correctness (every path vs the fp32 reference):")
    if not check():
        print("a path is over its tolerance: no timings")
        return 1
    print("timings (median of do_bench; bf16 activations):")
    timings(args.sweep)
    print("\n| shape (KxN) | M | impl | time (us) | achieved | vs bf16 F.linear |")
    print("|---|---|---|---|---|---|")
    for shape, M, impl, us, value, unit, vs in ROWS:
        print(f"| {shape} | {M} | {impl} | {us:.1f} | {value:.0f} {unit} | {vs:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
