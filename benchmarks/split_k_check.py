"""Every split-K decode kernel on the GPU (kernels/split_k.py's protocol): a race check, then
CUDA-graph timings.

1. Check: each kernel that finishes through split_k_finish (dense GEMV, AWQ batch-1 GEMV, AWQ
   batched GEMV, awq_mma, GGUF GEMV, gguf_mma, GPTQ int8 GEMV and GEMM) runs `--repeats` times at
   the launchers' default split of a 4096x4096 layer, against its fp32 torch reference. Every
   call's error must be the same (a split whose sums land late, or a zeroing that overtakes a
   read, shows as one call off the others) and the workspace must be left zeroed.
2. Time: each replayed in a CUDA graph over weight copies larger together than 3x the L2
   (awq_gemv.graph_us), so every call streams its weights from HBM as in a decode step.
   `--compare OTHER.json` prints another run's times beside these (an A/B of two checkouts on
   the same GPU: run each with --json, the second with --compare).

    PYTHONPATH=. python benchmarks/split_k_check.py                       # check, then time
    PYTHONPATH=. python benchmarks/split_k_check.py --no-time --dtypes bfloat16 float16
    PYTHONPATH=. python benchmarks/split_k_check.py --no-check --json b.json --compare a.json
"""
import argparse
import json

import torch
import torch.nn.functional as F
from awq_gemv import GROUP, L2_BYTES, awq_weights, graph_us, layer_paths
from gguf_gemv import random_qweight
from gptq import int8_weights

from tinypaged.kernels import awq, dense_gemv, gguf, gptq_int8
from tinypaged.kernels._triton import cdiv
from tinypaged.kernels.gguf_format import row_bytes

K = N = 4096  # the o projection of Llama-3-8B: few column blocks, so K is split


def workspaces():
    """The split-K workspaces (fp32 sums, counters) of every device."""
    try:
        from tinypaged.kernels.split_k import SPLIT_K_WORKSPACE
    except ImportError:  # a checkout from before split_k.py
        from tinypaged.kernels.awq_gemv import _SPLIT_K_WORKSPACE as SPLIT_K_WORKSPACE
    return SPLIT_K_WORKSPACE.values()


def dense(dtype):
    return [(torch.randn(N, K, device="cuda", dtype=dtype) * 0.02,
             torch.randn(N, device="cuda", dtype=dtype)) for _ in range(copies(2 * K * N))]


def dense_call(bias):
    def call(x, w):
        config = dense_gemv.gemv_config(x.shape[0], N, K)  # the engine's path
        return dense_gemv.dense_gemv(x, w[0], w[1] if bias else None, **config)

    def ref(x, w):
        return F.linear(x.float(), w[0].float(), w[1].float() if bias else None)

    return call, ref


def gguf_case(type_id):
    def make(dtype):
        return [random_qweight(type_id, N, K) for _ in range(copies(N * row_bytes(type_id, K)))]

    return make, (lambda x, w: gguf.gguf_linear(x, w, type_id),
                  lambda x, w: x.float() @ gguf.dequantize_reference(w, type_id, K).T)


def awq_case(path):
    return (lambda dtype: awq_weights(K, N, copies(K * N // 2)),
            (lambda x, w: layer_paths(x.shape[0])[path](x, w),
             lambda x, w: awq.awq_gemm_reference(x.float(), *w[:3], GROUP)))


def int8_case():
    return (lambda dtype: int8_weights(K, N, copies(K * N)),
            (lambda x, w: gptq_int8.gptq_int8_gemm(x, *w[:3], scales_t=w[3]),
             lambda x, w: gptq_int8.gptq_int8_gemm_reference(x.float(), *w[:3])))


def copies(nbytes):
    return max(2, cdiv(3 * L2_BYTES, nbytes))


def cases():
    """(name, M, make_weights(dtype) -> copies, (fn(x, w), fp32 reference(x, w)))."""
    awq_mma_path = next(p for p in layer_paths(8) if p.startswith("awq_mma"))
    return [
        ("dense GEMV", 1, dense, dense_call(False)),
        ("dense GEMV tensor cores + bias", 8, dense, dense_call(True)),
        ("dense GEMV tensor cores", 4, dense, dense_call(False)),
        ("AWQ batch-1 GEMV", 1, *awq_case("awq_gemm")),
        ("AWQ batched GEMV", 8, *awq_case("batched GEMV")),
        ("awq_mma", 8, *awq_case(awq_mma_path)),
        ("GGUF GEMV Q4_K", 1, *gguf_case(12)),
        ("GGUF GEMV Q6_K", 1, *gguf_case(14)),
        ("GGUF GEMV Q4_K", 4, *gguf_case(12)),
        ("gguf_mma Q4_K", 8, *gguf_case(12)),
        ("gguf_mma Q6_K", 8, *gguf_case(14)),
        ("GPTQ int8 GEMV", 1, *int8_case()),
        ("GPTQ int8 GEMM", 8, *int8_case()),
    ]


def check(name, M, weights, fn, ref, dtype, repeats):
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    want = ref(x, weights[0])
    errs = []
    for _ in range(repeats):
        y = fn(x, weights[0])
        errs.append(((y.float() - want).norm() / want.norm()).item())
    dirty = any(bool(p.any() or c.any()) for p, c in workspaces())
    ok = not dirty and max(errs) < 2e-2 and max(errs) - min(errs) < 1e-4
    print(f"{'ok  ' if ok else 'FAIL'} {name:32s} M={M:<2d} {str(dtype)[6:]:8s} {repeats} calls, "
          f"error {min(errs):.2e} .. {max(errs):.2e}{', workspace left dirty' if dirty else ''}",
          flush=True)
    if dirty:
        for p, c in workspaces():
            p.zero_()
            c.zero_()
    return ok


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--no-time", action="store_true")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"],
                        help="for the check (timings: bfloat16)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", help="write the timings here")
    parser.add_argument("--compare", help="a --json of another run, printed beside this one")
    args = parser.parse_args()
    torch.manual_seed(0)
    failures = 0
    times = {}
    dtypes = [] if args.no_check else [getattr(torch, d) for d in args.dtypes]
    for name, M, make, (fn, ref) in cases():
        for dtype in dtypes:
            failures += not check(name, M, make(dtype)[:1], fn, ref, dtype, args.repeats)
        if not args.no_time:
            weights = make(torch.bfloat16)
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            times[f"{name} M={M}"] = graph_us([lambda w=w, x=x, fn=fn: fn(x, w) for w in weights])
            del weights
    if times:
        other = json.load(open(args.compare)) if args.compare else {}
        print(f"\n{K}x{N}, bf16 x, us per call (CUDA graph, weights from HBM)")
        print("| kernel | us | other run us | this / other |\n|---|---|---|---|")
        for key, us in times.items():
            o = other.get(key)
            print(f"| {key} | {us:.2f} | {o or 0:.2f} | {us / o if o else 0:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(times, f, indent=1)
    if failures:
        raise SystemExit(f"{failures} check(s) failed")


if __name__ == "__main__":
    main()
