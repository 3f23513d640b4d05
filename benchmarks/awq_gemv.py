"""AWQ int4 GEMV / GEMMs against the bf16 linear on the GPU: checks, then timings.

At M=1 a call takes 5-30 us, so `do_bench` (one launch per timing) mostly measures the Python
launch gap; decode replays CUDA graphs, so this times graphs of 50 calls. Each call in a graph
uses the next of several weight copies, together over 3x the 60 MB L2, so every call streams its
weights from HBM (one copy of a 4096x14336 AWQ weight, 30 MB, would otherwise stay in L2).

    PYTHONPATH=. python benchmarks/awq_gemv.py               # Llama-3-8B shapes, M = 1 and 8
    PYTHONPATH=. python benchmarks/awq_gemv.py --sweep     # also tile / split / stage sweeps
    PYTHONPATH=. python benchmarks/awq_gemv.py --layers    # awq_gemm's paths, M = 1 .. 2048
"""
import argparse
import itertools

import torch
import torch.nn.functional as F

from tinypaged.kernels import awq, awq_mma
from tinypaged.kernels._triton import cdiv, num_sms
from tinypaged.kernels.split_k import SPLIT_K_WORKSPACE

GROUP = 128
L2_BYTES = 60 << 20
SHAPES = [(4096, 6144, "qkv"), (4096, 4096, "o"), (4096, 28672, "gate_up"), (14336, 4096, "down"),
          (4096, 14336, "issue")]


def graph_us(calls, reps=50):
    """Median time of one call, from replays of a graph of `reps` calls (calls[i % len])."""
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            calls[i % len(calls)]()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(7):
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(times)[3]


def copy_bandwidth():
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    return 2 * a.numel() * 10 / (start.elapsed_time(end) * 1e-3)


def awq_weights(K, N, copies):
    out = []
    for _ in range(copies):
        qw = torch.randint(-2**31, 2**31 - 1, (K, N // 8), device="cuda", dtype=torch.int32)
        qz = torch.randint(-2**31, 2**31 - 1, (K // GROUP, N // 8), device="cuda",
                           dtype=torch.int32)
        s = (torch.rand(K // GROUP, N, device="cuda") * 0.02 + 0.001).half()  # as checkpoints
        out.append((qw, qz, s, awq.gemv_scales(s)))
    return out


def gemv(x, weights, **config):
    """The GEMVs (M = 1, or the batched one for 2..16 with the paired-PTX dequant), with the
    layer's scales_t."""
    qw, qz, s, s_t = weights
    if x.shape[0] == 1:
        return awq._awq_gemv1(x, qw, qz, s, GROUP, scales_t=s_t, **config)
    return awq._awq_gemv(x, qw, qz, s, GROUP, scales_t=s_t, asm=True, **config)


def check(x, weights, **config):
    """Error against the fp32 reference, on fresh outputs; workspace re-zeroed; repeatable."""
    qw, qz, s, _ = weights
    ref = awq.awq_gemm_reference(x.float(), qw, qz, s, GROUP)
    errs = []
    for _ in range(3):  # a moving error would be a race between the splits
        y = gemv(x, weights, **config)
        assert torch.isfinite(y).all(), config
        errs.append(((y.float() - ref).norm() / ref.norm()).item())
    partial, count = SPLIT_K_WORKSPACE[x.device]
    assert not partial.any() and not count.any(), "workspace not re-zeroed"
    assert max(errs) < 1e-2 and max(errs) - min(errs) < 1e-3, (config, errs)
    return max(errs)


def crossover(ms=(16, 32, 64, 128, 256)):
    """The batched GEMV, the tiled GEMM and dequantize-then-cuBLAS over M (awq_gemm's
    GEMV_MAX_M and DENSE_MIN_M)."""
    print("| layer | M | bf16 linear (us) | GEMV (us) | tiled GEMM (us) | dequant + cuBLAS (us) |")
    print("|---|---|---|---|---|---|")
    for K, N, name in SHAPES:
        awq_bytes = K * N // 2
        weights = awq_weights(K, N, max(2, cdiv(3 * L2_BYTES, awq_bytes)))
        dense = [torch.randn(N, K, device="cuda").bfloat16() for _ in range(2)]
        for M in ms:
            x = torch.randn(M, K, device="cuda").bfloat16()
            base = graph_us([lambda w=w, x=x: F.linear(x, w) for w in dense], reps=10)
            tiled = graph_us([lambda w=w, x=x: awq._awq_gemm(x, *w[:3], GROUP) for w in weights],
                             reps=10)
            deq = graph_us([lambda w=w, x=x: x @ awq.awq_dequantize(*w[:3], GROUP, dtype=x.dtype)
                            for w in weights], reps=10)
            gemv_t = "-"
            if M <= awq.GEMV_MAX_M:
                check(x, weights[0])
                gemv_t = f"{graph_us([lambda w=w, x=x: gemv(x, w) for w in weights], reps=10):.1f}"
            print(f"| {name} {K}x{N} | {M} | {base:.1f} | {gemv_t} | {tiled:.1f} | {deq:.1f} |",
                  flush=True)


LAYER_MS = (1, 2, 4, 8, 16, 64, 512, 2048)


def layer_paths(M):
    """name -> fn(x, (qweight, qzeros, scales, scales_t)): awq_gemm ("awq_gemm", the dispatch)
    and every path it could take at M rows, for the crossover tables (awq.DECODE_PATHS,
    DENSE_MIN_M, TILED_MIN_N_OVER_K)."""
    paths = {"awq_gemm": lambda x, w: awq.awq_gemm(x, *w[:3], GROUP, scales_t=w[3])}
    if M == 1:
        return paths
    if M <= awq.GEMV_MAX_M:
        paths["batched GEMV"] = lambda x, w: awq._awq_gemv(x, *w[:3], GROUP, scales_t=w[3],
                                                           asm=True)
        for _, _, name, config in awq.DECODE_PATHS:
            if name == "awq_mma":
                paths[f"awq_mma {config}"] = lambda x, w, c=config: awq_mma.awq_mma(
                    x, *w[:3], GROUP, scales_t=w[3], asm=True, **c)
        return paths
    if M < awq.DENSE_MIN_M:
        paths["tiled GEMM"] = lambda x, w: awq._awq_gemm(x, *w[:3], GROUP)
    paths["dequantize + cuBLAS"] = lambda x, w: x @ awq.awq_dequantize(*w[:3], GROUP,
                                                                       dtype=x.dtype)
    return paths


def layers():
    """awq_gemm and its alternatives against the bf16 linear, Llama-3-8B layers, M = 1 .. 2048:
    each checked against the fp32 reference (bf16 and fp16 x, three calls: repeatable, split-K
    workspace left zeroed), then timed in CUDA graphs over weight copies larger than L2."""
    print("| layer | M | bf16 linear (us) | awq_gemm (us) | vs bf16 | alternatives (us) |")
    print("|---|---|---|---|---|---|")
    for K, N, name in SHAPES[:4]:
        weights = awq_weights(K, N, max(2, cdiv(3 * L2_BYTES, K * N // 2)))
        dense = [torch.randn(N, K, device="cuda").bfloat16() for _ in range(2)]
        w_ref = awq.awq_dequantize_reference(*weights[0][:3], GROUP)  # fp32 [K, N]
        for M in LAYER_MS:
            paths = layer_paths(M)
            for dtype in (torch.float16, torch.bfloat16):
                x = torch.randn(M, K, device="cuda").to(dtype)
                ref = x.float() @ w_ref
                for path, fn in paths.items():
                    errs = [((fn(x, weights[0]).float() - ref).norm() / ref.norm()).item()
                            for _ in range(3)]
                    partial, count = SPLIT_K_WORKSPACE.get(x.device, (ref[:0], ref[:0]))
                    assert max(errs) < 1e-2 and max(errs) - min(errs) < 1e-3, (name, M, path, errs)
                    assert not partial.any() and not count.any(), (name, M, path)
            reps = 20 if M <= 64 else 5
            base = graph_us([lambda w=w, x=x: F.linear(x, w) for w in dense], reps=reps)
            t = {path: graph_us([lambda w=w, fn=fn, x=x: fn(x, w) for w in weights], reps=reps)
                 for path, fn in paths.items()}
            gemm = t.pop("awq_gemm")
            others = ", ".join(f"{path} {us:.1f}" for path, us in t.items())
            print(f"| {name} {K}x{N} | {M} | {base:.1f} | {gemm:.1f} | {base / gemm:.2f}x | "
                  f"{others} |", flush=True)
        del weights, dense, w_ref
        torch.cuda.empty_cache()


def race_check(repeats=20):
    """awq_gemm at 2..16 rows, `repeats` calls each on the Llama-3-8B layers: every call's error
    against the fp32 reference must be the same (a split-K race shows as a call off the others)."""
    for K, N, name in SHAPES[:4]:
        weights = awq_weights(K, N, 1)[0]
        ref_w = awq.awq_dequantize_reference(*weights[:3], GROUP)
        for M in (2, 8, 16):
            x = torch.randn(M, K, device="cuda").bfloat16()
            ref = x.float() @ ref_w
            errs = [((awq.awq_gemm(x, *weights[:3], GROUP, scales_t=weights[3]).float() - ref)
                     .norm() / ref.norm()).item() for _ in range(repeats)]
            ok = max(errs) < 1e-2 and max(errs) - min(errs) < 1e-4
            print(f"{'ok  ' if ok else 'FAIL'} awq_gemm {name} {K}x{N} M={M}: {repeats} calls, "
                  f"error {min(errs):.2e} .. {max(errs):.2e}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--race-check", action="store_true",
                        help="only repeat awq_gemm at 2..16 rows and compare the calls")
    parser.add_argument("--crossover", action="store_true",
                        help="only time the tiled GEMM against dequantize + cuBLAS")
    parser.add_argument("--layers", action="store_true",
                        help="only awq_gemm and its alternatives, M = 1 .. 2048 (~1 min)")
    parser.add_argument("--sweep", action="store_true", help="split / stage sweep at M = 1")
    parser.add_argument("--m", type=int, nargs="+", default=[1, 8], help="rows of x")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.race_check:
        return race_check()
    if args.crossover:
        return crossover()
    if args.layers:
        return layers()
    bw = copy_bandwidth()
    sms = num_sms(0)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, {sms} SMs")
    results = []
    for (K, N, name), M in itertools.product(SHAPES, args.m):
        awq_bytes = K * N // 2 + (K // GROUP) * N * 2 + (K // GROUP) * N // 2  # q, s, z
        dense_bytes = K * N * 2
        weights = awq_weights(K, N, max(2, cdiv(3 * L2_BYTES, awq_bytes)))
        dense = [torch.randn(N, K, device="cuda").bfloat16()
                 for _ in range(max(2, cdiv(3 * L2_BYTES, dense_bytes)))]
        x = torch.randn(M, K, device="cuda").bfloat16()
        base = graph_us([lambda w=w, x=x: F.linear(x, w) for w in dense])
        configs = [{}]
        if args.sweep and M == 1:
            for stages, per_sm in itertools.product((2, 3), (1, 2, 3, 4)):
                split = max(1, cdiv(per_sm * sms, cdiv(N, 256)))
                configs.append(dict(num_stages=stages, split_k=split))
        elif args.sweep:
            for block_n, block_k, stages, per_sm in itertools.product(
                    (128, 256), (32, 64, 128), (2, 3), (2, 4)):
                split = max(1, cdiv(per_sm * sms, cdiv(N, block_n)))
                configs.append(dict(block_n=block_n, block_k=block_k, num_stages=stages,
                                    split_k=split))
        for config in configs:
            err = check(x, weights[0], **config)
            t = graph_us([lambda w=w, c=config, x=x: gemv(x, w, **c) for w in weights])
            results.append((name, K, N, M, config or "default", base, t, err,
                            awq_bytes / t / 1e3, awq_bytes / t * 1e6 / bw))
            print(f"{name} {K}x{N} M={M} {config or 'default'}: bf16 {base:.1f} us "
                  f"({dense_bytes / base / 1e3:.0f} GB/s), AWQ {t:.1f} us, {base / t:.2f}x, "
                  f"err {err:.1e}", flush=True)
    print("\n| layer | K x N | M | bf16 linear (us) | AWQ (us) | speed-up | AWQ GB/s | "
          "% of copy BW | rel. error |")
    print("|---|---|---|---|---|---|---|---|---|")
    best = {}
    for name, K, N, M, config, base, t, err, gbs, frac in results:
        if name + str(M) not in best or t < best[name + str(M)][0]:
            best[name + str(M)] = (t, config)
        if config == "default":
            print(f"| {name} | {K}x{N} | {M} | {base:.1f} | {t:.1f} | {base / t:.2f}x | "
                  f"{gbs:.0f} | {100 * frac:.0f}% | {err:.1e} |")
    if args.sweep:
        for name, (t, config) in best.items():
            print(f"best {name}: {t:.1f} us {config}")


if __name__ == "__main__":
    main()
