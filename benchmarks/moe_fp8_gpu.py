# ruff: noqa: B023  (each lambda is timed at once, in its own iteration)
"""FP8 fused MoE on a CUDA GPU, Qwen3-30B-A3B layer shape (hidden 2048, 128 experts, top-8,
moe_intermediate 768, bf16 activations): first the fused SiLU-and-mul + FP8 quantization
(kernels/fp8_act.py) against its reference, then `fused_experts_fp8` against its torch reference
for block-wise [128, 128] and per-channel expert scales (at decode sizes the W8A16 GEMVs, against
the bf16 path's reference on the dequantized weights, and timed beside the W8A8 kernels too), and
its time beside the bf16 `fused_experts` on the same (dequantized) weights. One JSON line per
measurement; exit code 1 if a check fails (MoE: relative L2 error over 3e-2; the same fp8
operands, the SiLU-and-mul output requantized after a bf16 rounding that may differ from the
reference's by one ulp).

    PYTHONPATH=. python benchmarks/moe_fp8_gpu.py [--quick]
    PYTHONPATH=. python benchmarks/moe_fp8_gpu.py --sweep --budget-s 150  # < 170 s, H200

--sweep: the grouped GEMM's FP8 tiles (moe_fp8_sweep.py): both launches over candidate tiles
at T = 16 ... 16384, per-channel and block-wise scales, the winners checked, the whole layer
beside bf16, and FP8_MOE_CONFIGS to paste (python3 .gpu/paste.py OUT.txt
tinypaged/kernels/moe_fp8.py FP8_MOE_CONFIGS). --dry-run: its tables on made-up timings.
"""

import argparse
import json
import os
import sys

import torch
from triton.testing import do_bench

from tinypaged.kernels import fp8_act, moe, moe_fp8, moe_gemv
from tinypaged.kernels.fp8 import FP8_MAX

dev = "cuda"
E, H, INTER, TOP_K = 128, 2048, 768, 8
GEN = None  # set by checks_and_timings (no CUDA work at import: the sweep's pool imports it)


def emit(**kw):
    print(json.dumps(kw), flush=True)


def weights(rows, cols, block):
    w = torch.randn(E, rows, cols, device=dev, generator=GEN) * 0.02
    if block:
        b = w.reshape(E, rows // 128, 128, cols // 128, 128)
        s = b.abs().amax((2, 4)) / FP8_MAX
        q = (b / s[:, :, None, :, None]).reshape(E, rows, cols).to(torch.float8_e4m3fn)
        deq = (q.float().reshape(b.shape) * s[:, :, None, :, None]).reshape(E, rows, cols)
    else:
        s = w.abs().amax(2, keepdim=True) / FP8_MAX
        q = (w / s).to(torch.float8_e4m3fn)
        deq = q.float() * s
    return q, s, deq.to(torch.bfloat16)


def checks_and_timings(tokens):
    """The checks and timings of the module docstring; -> the number of failed checks."""
    global GEN
    GEN = torch.Generator(device=dev).manual_seed(0)
    bad = 0
    # the fused SiLU-and-mul + FP8 quantization of the dense FP8 MLP (kernels/fp8_act.py)
    for M, inter, group in [(1, 14336, None), (37, 14336, None), (300, 768, 128)]:
        g = torch.randn(M, 2 * inter, device=dev, generator=GEN, dtype=torch.bfloat16) * 3
        q, s = fp8_act.silu_and_mul_quant_fp8(g, group)
        qr, sr = fp8_act.silu_and_mul_quant_fp8_reference(g, group)
        G = group or inter
        got = (q.float().reshape(M, -1, G) * s[..., None]).reshape(M, inter)
        want = (qr.float().reshape(M, -1, G) * sr[..., None]).reshape(M, inter)
        ok = bool(torch.allclose(s, sr, rtol=1e-5, atol=0)
                  and ((got - want).abs() <= want.abs() / 8 + 1e-6).all())
        bad += not ok
        emit(check="silu_and_mul_quant_fp8", M=M, I=inter, group=group, ok=ok,
             differing=round((q.float() != qr.float()).float().mean().item(), 5))
    for block in ((128, 128), None):
        w13, s13, d13 = weights(2 * INTER, H, block)
        w2, s2, d2 = weights(H, INTER, block)
        for T in tokens:
            x = torch.randn(T, H, device=dev, generator=GEN, dtype=torch.bfloat16)
            logits = torch.randn(T, E, device=dev, generator=GEN)
            topk_w, topk_ids = torch.topk(torch.softmax(logits, -1), TOP_K, dim=-1)
            topk_w, topk_ids = topk_w / topk_w.sum(-1, keepdim=True), topk_ids.to(torch.int32)
            args = (x, w13, w2, s13, s2, topk_w, topk_ids, block)
            got = moe_fp8.fused_experts_fp8(*args)
            w8a16 = moe_gemv.use_gemv(T, TOP_K, E)  # decode: the GEMVs, x unquantized
            ref = (moe.fused_experts_ref(x.float(), d13.float(), d2.float(), topk_w, topk_ids)
                   if w8a16 else moe_fp8.fused_experts_fp8_reference(*args))
            err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            ok = err < 3e-2
            bad += not ok
            fp8_ms = do_bench(lambda: moe_fp8.fused_experts_fp8(*args))
            bf16_ms = do_bench(lambda: moe.fused_experts(x, d13, d2, topk_w, topk_ids))
            w8a8 = {}
            if w8a16:  # the W8A8 grouped kernels it replaces, for the A/B
                os.environ["TINYPAGED_DENSE_GEMV"] = "0"
                w8a8["w8a8_us"] = round(do_bench(lambda: moe_fp8.fused_experts_fp8(*args)) * 1e3, 1)
                del os.environ["TINYPAGED_DENSE_GEMV"]
            emit(kernel="fused_experts_fp8", path="W8A16 GEMV" if w8a16 else "W8A8", T=T,
                 scales="block" if block else "channel", rel_err=round(err, 5), ok=ok,
                 fp8_us=round(fp8_ms * 1e3, 1), **w8a8, bf16_us=round(bf16_ms * 1e3, 1),
                 speedup=round(bf16_ms / fp8_ms, 2))
    return bad


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="T = 8 and 512 only")
    parser.add_argument("--sweep", action="store_true", help="the FP8 tile sweep (see above)")
    parser.add_argument("--budget-s", type=float, default=150.0, help="--sweep's time bound")
    parser.add_argument("--dry-run", action="store_true", help="--sweep's tables, no GPU")
    parser.add_argument("--json", default=None, help="--sweep: the launch timings to this file")
    args = parser.parse_args()
    if args.sweep or args.dry_run:
        import moe_fp8_sweep
        return moe_fp8_sweep.main(args.budget_s, args.dry_run, args.json)
    return checks_and_timings((8, 512) if args.quick else (1, 8, 64, 512, 4096))


if __name__ == "__main__":
    sys.exit(1 if main() else 0)
