"""Batch-1 AWQ GEMV against the bf16 linear, timed as CUDA-graph replays.

At M=1 both kernels run in ~30 us, so `do_bench` (one launch per timing) mostly measures the
Python launch gap; decode runs under CUDA graphs, so this replays 50 calls per graph instead.

    PYTHONPATH=. python benchmarks/awq_gemv.py
"""
import torch
import torch.nn.functional as F

from tinypaged.kernels import awq


def graph_us(fn, reps=50):
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


g = 128
for K, N in ((4096, 14336), (14336, 4096)):
    qw = torch.randint(-2**31, 2**31 - 1, (K, N // 8), device="cuda", dtype=torch.int32)
    qz = torch.randint(-2**31, 2**31 - 1, (K // g, N // 8), device="cuda", dtype=torch.int32)
    s = (torch.rand(K // g, N, device="cuda") * 0.01).bfloat16()
    x = torch.randn(1, K, device="cuda").bfloat16()
    dense = torch.randn(N, K, device="cuda").bfloat16()
    base = graph_us(lambda x=x, dense=dense: F.linear(x, dense))
    for bn, bk, w in ((256, 16, 8), (128, 32, 4), (512, 32, 4)):
        def gemv(bn=bn, bk=bk, w=w, x=x, qw=qw, qz=qz, s=s):
            return awq._awq_gemv1(x, qw, qz, s, g, block_n=bn, block_k=bk, num_warps=w)

        t = graph_us(gemv)
        gbs = (K * N // 2 + (K // g) * N * 2.5) / t / 1e3
        print(f"{K}x{N} M=1 graph replay: bf16 linear {base:.1f} us, AWQ {t:.1f} us "
              f"({gbs:.0f} GB/s, {base / t:.2f}x) block_n={bn} block_k={bk} warps={w}")
