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

    PYTHONPATH=. python benchmarks/moe_fp8_gpu.py --align  # < 60 s

--align: kernels/moe_align.py's two-launch sort by expert against the torch reference (equal
outputs) and timed beside the one-program kernel and the torch ops, T = 16 ... 2048; then the FP8
layer with TINYPAGED_MOE_ALIGN_PARALLEL=1 and 0 (the same output, and its time), JSON lines.
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
        # Triton's and torch's sigmoid may differ in the last fp32 bit, so a bf16 act may round
        # one step apart; when that act is its row's max, the scale moves by that step and the
        # row's e4m3 values with it (hence `differing`): each product stays within one e4m3 step.
        ok = bool(torch.allclose(s, sr, rtol=torch.finfo(g.dtype).eps, atol=0)
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


def align_check():
    """--align: the two-launch sort by expert (moe_align_block_size_parallel) against the torch
    reference (equal outputs) and its time beside the one-program kernel and the torch ops (CUDA
    graphs), then the FP8 layer with TINYPAGED_MOE_ALIGN_PARALLEL=1 and =0; -> failures."""
    from moe_fp8_sweep import Case, graph_us, make_weights

    from tinypaged.kernels import moe_align
    bad = 0
    for T in (16, 64, 128, 256, 512, 1024, 2048):
        ids = torch.topk(torch.rand(T, E, device=dev), TOP_K, dim=-1)[1].to(torch.int32)
        for block_m in (16, 64):
            ref = moe_align.moe_align_block_size_ref(ids, block_m, E)
            got = moe_align.moe_align_block_size_parallel(ids, block_m, E)
            ok = all(torch.equal(g, r) for g, r in zip(got, ref))
            bad += not ok
            us = {name: round(graph_us(lambda f=f: f(ids, block_m, E), 20), 1) for name, f in (
                ("parallel", moe_align.moe_align_block_size_parallel),
                ("one_program", moe_align.moe_align_block_size_triton),
                ("torch", moe_align.moe_align_block_size_ref))
                if name != "one_program" or T <= 512}
            emit(check="moe_align_block_size_parallel", T=T, block_m=block_m, equal=ok, **us)
    gen = torch.Generator(device=dev).manual_seed(0)
    for kind in ("channel", "block"):
        wts = make_weights(kind, gen=gen)
        for T in (16, 64, 128, 256, 512, 2048):
            case = Case(T, kind, wts, gen=gen)
            args = (case.x, wts["w13"], wts["w2"], wts["s13"], wts["s2"], case.topk_w, case.ids,
                    case.block)
            row = {}
            for flag in ("1", "0"):
                os.environ["TINYPAGED_MOE_ALIGN_PARALLEL"] = flag
                out = moe_fp8.fused_experts_fp8(*args)
                row[f"parallel={flag}_us"] = round(graph_us(
                    lambda: moe_fp8.fused_experts_fp8(*args), 10), 1)
                row[f"out{flag}"] = out
            same = torch.equal(row.pop("out1"), row.pop("out0"))  # one layout: the same sums
            bad += not same
            emit(layer="fused_experts_fp8", scales=kind, T=T, same_output=same, **row)
        os.environ.pop("TINYPAGED_MOE_ALIGN_PARALLEL")
    return bad


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="T = 8 and 512 only")
    parser.add_argument("--sweep", action="store_true", help="the FP8 tile sweep (see above)")
    parser.add_argument("--budget-s", type=float, default=150.0, help="--sweep's time bound")
    parser.add_argument("--dry-run", action="store_true", help="--sweep's tables, no GPU")
    parser.add_argument("--json", default=None, help="--sweep: the launch timings to this file")
    parser.add_argument("--align", action="store_true",
                        help="the two-launch sort by expert: checks, times, the layer A/B")
    args = parser.parse_args()
    if args.align:
        return align_check()
    if args.sweep or args.dry_run:
        import moe_fp8_sweep
        return moe_fp8_sweep.main(args.budget_s, args.dry_run, args.json)
    return checks_and_timings((8, 512) if args.quick else (1, 8, 64, 512, 4096))


if __name__ == "__main__":
    sys.exit(1 if main() else 0)
