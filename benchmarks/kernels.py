"""Kernel benchmark on one GPU: correctness first, then speed beside ceilings and torch peers.

    PYTHONPATH=. python benchmarks/kernels.py            # checks, then timings, then a table
    PYTHONPATH=. python benchmarks/kernels.py --awq      # also the AWQ int4 GEMM / GEMV
    PYTHONPATH=. python benchmarks/kernels.py --tune     # also sweep attention tiles (~2 min)
    PYTHONPATH=. python benchmarks/kernels.py --awq --json docs/kernels/h200.json   # for the plots

1. Every Triton kernel is compared with its torch reference in bf16 and fp16 (max error printed);
   any mismatch stops the script with exit code 1 before a single timing.
2. Each op is timed with `triton.testing.do_bench` (median; it flushes L2 between runs) and
   reported as achieved GB/s (memory-bound ops: norm, rotary, SiLU, KV store, decode attention)
   or TFLOP/s (prefill attention), next to ceilings measured in the same run (a 1 GiB device copy,
   an 8192^3 bf16 matmul) and torch peers (the reference, F.rms_norm, SDPA cuDNN / flash).
3. A markdown table closes the output; copy it into benchmarks/RESULTS.md. With `--json PATH`
   every row (with its bytes and FLOPs, so a roofline can place it) and the ceilings go to a JSON
   file, which `docs/plots.py` turns into one PNG per kernel family.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import subprocess
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from tinypaged.kernels import activation, attention, kv_cache, norm, rotary
from tinypaged.kernels._triton import cdiv, num_sms
from tinypaged.kernels.attention_decode import decode_num_splits

DEV = "cuda"
ROWS: list[dict] = []  # one per timing: op, shape, impl, us, bytes, flops, achieved, unit, pct
CEILING = {"GB/s": 0.0, "TFLOP/s": 0.0}
FAMILY = {  # op -> the docs page (docs/kernels/<family>.md) whose plot shows it
    "rms_norm": "norm_activation", "add+rms_norm": "norm_activation",
    "silu_and_mul": "norm_activation", "rotary (neox)": "rotary", "store_kv": "kv_cache",
    "decode paged": "decode_attention", "decode dense": "decode_attention",
    "prefill paged": "prefill_attention", "prefill dense": "prefill_attention",
    "awq_gemm": "awq", "bf16 linear": "awq",
}


def bench_ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def record(op: str, shape: str, impl: str, fn, *, bytes_moved: float, flops: float = 0.0,
           compute_bound: bool = False) -> float:
    """Time fn and add a table row; returns milliseconds (nan when the impl cannot run).

    bytes_moved: the least DRAM traffic the op needs; flops: its arithmetic. The row reports
    TFLOP/s against the matmul ceiling when compute_bound, else GB/s against the copy ceiling."""
    row = {"op": op, "family": FAMILY.get(op), "shape": shape, "impl": impl,
           "bytes": bytes_moved, "flops": flops, "unit": "TFLOP/s" if compute_bound else "GB/s",
           "us": float("nan"), "achieved": float("nan"), "pct": float("nan")}
    ROWS.append(row)
    try:
        ms = bench_ms(fn)
    except (RuntimeError, NotImplementedError, ValueError) as e:  # a peer without this shape
        print(f"  {op:18s} {shape:28s} {impl:22s} n/a ({type(e).__name__}: {str(e)[:60]})")
        return float("nan")
    value = flops / ms / 1e9 if compute_bound else bytes_moved / ms / 1e6
    pct = 100 * value / CEILING[row["unit"]] if CEILING[row["unit"]] else float("nan")
    unit = row["unit"]
    print(f"  {op:18s} {shape:28s} {impl:22s} {ms * 1e3:9.1f} us {value:8.1f} {unit} {pct:5.1f}%")
    row.update(us=ms * 1e3, achieved=value, pct=pct)
    return ms


# ----------------------------------------------------------------------------- inputs


def randn(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device=DEV, dtype=dtype)


class PagedBatch:
    """Sequences with q_lens new tokens at the end of seq_lens contexts, K/V in permuted blocks.

    With poison=True every slot no sequence owns holds NaN, so a kernel that reads one unmasked
    returns NaN instead of a quietly wrong number.
    """

    def __init__(self, q_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, dtype,
                 block_size=16, poison=False):
        self.q_lens, self.seq_lens_list = list(q_lens), list(seq_lens)
        blocks = [cdiv(s, block_size) for s in seq_lens]
        num_blocks = sum(blocks) + 1
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        if poison:
            self.k_cache = torch.full(shape, float("nan"), device=DEV, dtype=dtype)
            self.v_cache = self.k_cache.clone()
        else:
            self.k_cache, self.v_cache = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype)
        perm = torch.randperm(num_blocks - 1, device=DEV).to(torch.int32)
        self.block_tables = torch.full((len(seq_lens), max(blocks)), num_blocks - 1,
                                       device=DEV, dtype=torch.int32)
        start = 0
        for b, n in enumerate(blocks):
            self.block_tables[b, :n] = perm[start:start + n]
            start += n
        self.seq_lens = torch.tensor(seq_lens, device=DEV, dtype=torch.int32)
        self.query_start_loc = torch.tensor([0, *itertools.accumulate(q_lens)], device=DEV,
                                            dtype=torch.int32)
        if poison:  # write every owned slot
            seq = torch.repeat_interleave(torch.arange(len(seq_lens), device=DEV), self.seq_lens)
            pos = torch.cat([torch.arange(s, device=DEV) for s in seq_lens])
            slots = (self.block_tables[seq, pos // block_size].long() * block_size
                     + pos % block_size)
            for cache in (self.k_cache, self.v_cache):
                cache.view(-1, num_kv_heads, head_dim)[slots] = randn(
                    len(slots), num_kv_heads, head_dim, dtype=dtype)
        self.q = randn(sum(q_lens), num_q_heads, head_dim, dtype=dtype)
        self.scale = head_dim**-0.5

    def call(self, fn, **kwargs):
        return fn(self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                  self.query_start_loc, self.scale, max_query_len=max(self.q_lens),
                  max_seq_len=max(self.seq_lens_list), **kwargs)

    def kv_bytes(self):
        row = self.k_cache.shape[2] * self.k_cache.shape[3] * self.k_cache.element_size()
        return 2 * row * sum(self.seq_lens_list) + 2 * self.q.numel() * self.q.element_size()


# ----------------------------------------------------------------------------- correctness

FAILURES: list[str] = []


def compare(name: str, got, want, dtype, tol: float | None = None) -> None:
    if tol is None:
        tol = 1.6e-2 if dtype == torch.bfloat16 else 2e-3  # ~2 ulp of bf16 / fp16 at 1.0
    got, want = got.float(), want.float()
    err = (got - want).abs()
    bad = not torch.isfinite(got).all() or bool((err > tol + tol * want.abs()).any())
    print(f"  {'FAIL' if bad else 'ok  '} {name:48s} {str(dtype)[6:]:9s} max err {err.max():.2e}")
    if bad:
        FAILURES.append(f"{name} {dtype}")


def check_all() -> None:
    print("correctness: Triton vs torch reference")
    for dtype in (torch.bfloat16, torch.float16):
        x, w, res = randn(257, 4096, dtype=dtype), randn(4096, dtype=dtype), randn(257, 4096,
                                                                                   dtype=dtype)
        compare("rms_norm [257, 4096]", norm.rms_norm(x, w, 1e-6), norm.rms_norm_ref(x, w, 1e-6),
                dtype)
        got, want = norm.rms_norm(x, w, 1e-6, res), norm.rms_norm_ref(x, w, 1e-6, res)
        compare("rms_norm + residual: normed", got[0], want[0], dtype)
        compare("rms_norm + residual: sum", got[1], want[1], dtype)
        xh = randn(33, 8, 128, dtype=dtype)
        wh = randn(128, dtype=dtype)
        compare("rms_norm per head [33, 8, 128]", norm.rms_norm(xh, wh, 1e-6),
                norm.rms_norm_ref(xh, wh, 1e-6), dtype)
        y = randn(129, 2 * 1000, dtype=dtype)
        compare("silu_and_mul [129, 2000]", activation.silu_and_mul(y),
                activation.silu_and_mul_ref(y), dtype)
        compare("gelu_tanh_and_mul [129, 2000]", activation.gelu_tanh_and_mul(y),
                activation.gelu_tanh_and_mul_ref(y), dtype)
        for head_dim, rotary_dim, interleaved in ((128, 128, False), (128, 64, True)):
            cache = rotary.build_cos_sin_cache(rotary_dim, 8192, 500000.0, device=DEV)
            pos = torch.randint(0, 8192, (77,), device=DEV)
            qkv = randn(77, 48 * head_dim, dtype=dtype)  # q, k: strided views of a fused output
            q, k, _ = qkv.split([32 * head_dim, 8 * head_dim, 8 * head_dim], dim=-1)
            q, k = q.view(77, 32, head_dim), k.view(77, 8, head_dim)
            q2, k2 = q.clone(), k.clone()
            rotary.rotary_embedding(pos, q, k, cache, rotary_dim, interleaved)
            rotary.rotary_embedding_ref(pos, q2, k2, cache, rotary_dim, interleaved)
            style = "glm partial" if interleaved else "neox"
            compare(f"rotary {style} q", q, q2, dtype)
            compare(f"rotary {style} k", k, k2, dtype)
        k, v = randn(300, 8, 128, dtype=dtype), randn(300, 8, 128, dtype=dtype)
        slots = torch.randperm(64 * 16, device=DEV)[:300]
        slots[::7] = -1
        caches = [randn(64, 16, 8, 128, dtype=dtype) for _ in range(2)]
        copies = [c.clone() for c in caches]
        kv_cache.store_kv(k, v, *caches, slots)
        kv_cache.store_kv_ref(k, v, *copies, slots)
        compare("store_kv (slot -1 skipped)", torch.stack(caches), torch.stack(copies), dtype)
        cases = {
            "prefill": ([1, 17, 300, 129], [1, 17, 300, 129], {}),
            "chunked prefill over a prefix": ([9, 200, 1], [400, 1000, 33], {}),
            "decode, split-KV": ([1] * 9, [1, 15, 16, 17, 100, 1000, 2048, 3000, 5000], {}),
            "decode, 1 split": ([1] * 5, [1, 17, 100, 1000, 3000], {"num_splits": 1}),
            "decode, 32 fixed splits": ([1] * 4, [1, 40, 700, 3000], {"num_splits": 32}),
            "mixed batch": ([1, 300, 40, 1], [1000, 300, 700, 17], {}),
            "mixed, window 64": ([1, 300, 40, 1], [1000, 300, 700, 17], {"sliding_window": 64}),
            "decode, window 700": ([1] * 5, [1, 17, 700, 1000, 3000], {"sliding_window": 700}),
            "mixed, softcap 50 + window 128": ([1, 300, 40, 1], [1000, 300, 700, 17],
                                               {"sliding_window": 128, "softcap": 50.0}),
            "decode, softcap 50": ([1] * 4, [1, 40, 700, 3000], {"softcap": 50.0}),
        }
        for (hq, hk, head_dim), (case, (q_lens, seq_lens, kw)) in itertools.product(
            [(32, 8, 128), (12, 4, 64), (16, 16, 128)], cases.items()
        ):
            batch = PagedBatch(q_lens, seq_lens, hq, hk, head_dim, dtype, poison=True)
            window = {k: v for k, v in kw.items() if k != "num_splits"}
            compare(f"attention {case} {hq}/{hk} d{head_dim}",
                    batch.call(attention.paged_attention, **kw),
                    batch.call(attention.paged_attention_ref, **window), dtype)


# ----------------------------------------------------------------------------- ceilings


def measure_ceilings() -> None:
    src = torch.empty(2**29, device=DEV, dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    CEILING["GB/s"] = 2 * src.numel() * 2 / ms / 1e6
    a, b = randn(8192, 8192), randn(8192, 8192)
    ms = bench_ms(lambda: a @ b)
    CEILING["TFLOP/s"] = 2 * 8192**3 / ms / 1e9
    print(f"ceilings: copy {CEILING['GB/s']:.0f} GB/s (read + write), "
          f"bf16 matmul {CEILING['TFLOP/s']:.0f} TFLOP/s")


# ----------------------------------------------------------------------------- timings


def time_elementwise() -> None:
    print("timings: elementwise (bf16)")
    T, H = 8192, 4096
    x, w, res = randn(T, H), randn(H), randn(T, H)
    shape = f"{T}x{H}"
    norm_cost = {"bytes_moved": 4 * T * H, "flops": 4 * T * H}  # x^2, sum, * rsqrt, * w
    record("rms_norm", shape, "triton", lambda: norm.rms_norm(x, w, 1e-6), **norm_cost)
    record("rms_norm", shape, "torch reference", lambda: norm.rms_norm_ref(x, w, 1e-6),
           **norm_cost)
    record("rms_norm", shape, "F.rms_norm", lambda: F.rms_norm(x, (H,), w, 1e-6), **norm_cost)
    add_cost = {"bytes_moved": 8 * T * H, "flops": 5 * T * H}
    record("add+rms_norm", shape, "triton", lambda: norm.rms_norm(x, w, 1e-6, res), **add_cost)
    record("add+rms_norm", shape, "torch reference", lambda: norm.rms_norm_ref(x, w, 1e-6, res),
           **add_cost)

    T, inter = 4096, 14336
    y = randn(T, 2 * inter)
    shape = f"{T}x{2 * inter}"
    cost = {"bytes_moved": 2 * 3 * T * inter, "flops": 5 * T * inter}  # exp, add, div, 2 mul
    record("silu_and_mul", shape, "triton", lambda: activation.silu_and_mul(y), **cost)
    record("silu_and_mul", shape, "torch reference", lambda: activation.silu_and_mul_ref(y),
           **cost)
    record("silu_and_mul", shape, "torch eager bf16",
           lambda: F.silu(y[:, :inter]) * y[:, inter:], **cost)
    record("gelu_tanh_and_mul", shape, "triton", lambda: activation.gelu_tanh_and_mul(y), **cost)

    T, D = 8192, 128
    cache = rotary.build_cos_sin_cache(D, 8192, 500000.0, device=DEV)
    pos = torch.randint(0, 8192, (T,), device=DEV)
    qkv = randn(T, 48 * D)
    q, k, _ = qkv.split([32 * D, 8 * D, 8 * D], dim=-1)
    q, k = q.view(T, 32, D), k.view(T, 8, D)
    shape = f"T{T} 32/8 heads d{D}"
    cost = {"bytes_moved": 2 * 2 * T * 40 * D + 4 * T * D, "flops": 3 * T * 40 * D}
    record("rotary (neox)", shape, "triton",
           lambda: rotary.rotary_embedding(pos, q, k, cache, D), **cost)
    record("rotary (neox)", shape, "torch reference",
           lambda: rotary.rotary_embedding_ref(pos, q, k, cache, D), **cost)

    T = 16384
    kv = randn(T, 16 * D)
    k, v = kv[:, : 8 * D].view(T, 8, D), kv[:, 8 * D:].view(T, 8, D)
    caches = [randn(T // 16 + 64, 16, 8, D) for _ in range(2)]
    slots = torch.randperm(len(caches[0]) * 16, device=DEV)[:T]
    moved, shape = 2 * 2 * 2 * T * 8 * D, f"T{T} 8 heads d{D}"
    record("store_kv", shape, "triton", lambda: kv_cache.store_kv(k, v, *caches, slots),
           bytes_moved=moved)
    record("store_kv", shape, "torch reference",
           lambda: kv_cache.store_kv_ref(k, v, *caches, slots), bytes_moved=moved)


def sdpa(q, k, v, backend, **kwargs):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(getattr(SDPBackend, backend)):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def time_decode() -> None:
    print("timings: decode attention (bf16, 32 query / 8 KV heads, d128, block 16)")
    for batch_size, ctx in ((64, 1024), (64, 2048), (64, 8192), (256, 1024), (256, 2048)):
        batch = PagedBatch([1] * batch_size, [ctx] * batch_size, 32, 8, 128, torch.bfloat16)
        splits = decode_num_splits(batch_size, 8, ctx, num_sms(torch.cuda.current_device()))
        shape = f"B{batch_size} ctx{ctx}"
        cost = {"bytes_moved": batch.kv_bytes(), "flops": 4 * batch_size * 32 * 128 * ctx}
        record("decode paged", shape, f"triton ({splits} splits)",
               lambda b=batch: b.call(attention.paged_attention), **cost)
        if (batch_size, ctx) in ((64, 2048), (256, 1024)):
            q = randn(batch_size, 32, 1, 128)
            k, v = randn(batch_size, 8, ctx, 128), randn(batch_size, 8, ctx, 128)
            for backend in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
                record("decode dense", shape, f"SDPA {backend.split('_')[0].lower()}",
                       lambda q=q, k=k, v=v, be=backend: sdpa(q, k, v, be, enable_gqa=True),
                       **cost)
        if (batch_size, ctx) == (64, 2048):
            record("decode paged", shape, "torch reference",
                   lambda b=batch: b.call(attention.paged_attention_ref), **cost)


def time_windows() -> None:
    """Sliding windows and soft-capping (Gemma 2's local layers: window 4096, cap 50): a window
    of W keys costs ~W keys, whatever the context; the bytes and FLOPs count the visible keys."""
    print("timings: sliding window / soft-cap attention (bf16, 32/8 heads, d128, block 16)")
    for batch_size, ctx, window, softcap in ((64, 8192, 1024, None), (64, 8192, 1024, 50.0),
                                             (64, 2048, None, 50.0)):
        batch = PagedBatch([1] * batch_size, [ctx] * batch_size, 32, 8, 128, torch.bfloat16)
        kw = {"sliding_window": window, "softcap": softcap}
        visible = min(ctx, window or ctx)
        row = 2 * 8 * 128 * 2  # K and V bytes of one position
        shape = f"B{batch_size} ctx{ctx} window {window} cap {softcap}"
        record("decode paged", shape, "triton", lambda b=batch, kw=kw: b.call(
            attention.paged_attention, **kw), bytes_moved=row * visible * batch_size)
    for new, window, softcap in ((8192, 4096, None), (8192, 4096, 50.0), (8192, None, 50.0)):
        batch = PagedBatch([new], [new], 32, 8, 128, torch.bfloat16)
        kw = {"sliding_window": window, "softcap": softcap}
        w = window or new  # visible (query, key) pairs: a triangle, then a band of width w
        pairs = w * (w + 1) / 2 + (new - w) * w
        shape = f"B1 L{new} window {window} cap {softcap} 32/8"
        record("prefill paged", shape, "triton", lambda b=batch, kw=kw: b.call(
            attention.paged_attention, **kw), bytes_moved=batch.kv_bytes(),
            flops=4 * 32 * 128 * pairs, compute_bound=True)


def time_prefill() -> None:
    print("timings: prefill attention (bf16, causal, d128, block 16)")
    for (batch_size, new, prefix), num_kv_heads in itertools.product(
        ((4, 2048, 0), (1, 8192, 0), (4, 512, 1536)), (32, 8)
    ):
        seq = prefix + new
        batch = PagedBatch([new] * batch_size, [seq] * batch_size, 32, num_kv_heads, 128,
                           torch.bfloat16)
        # causal FLOPs: QK^T and PV over the visible keys, 2 * 2 * D per (query, key) pair
        flops = 4 * batch_size * 32 * 128 * (new * prefix + new * new / 2)
        cost = {"bytes_moved": batch.kv_bytes(), "flops": flops, "compute_bound": True}
        shape = f"B{batch_size} L{new}" + (f" +{prefix} cached" if prefix else "") + (
            f" {32}/{num_kv_heads}")
        record("prefill paged", shape, "triton", lambda b=batch: b.call(attention.paged_attention),
               **cost)
        if (batch_size, new, num_kv_heads) == (4, 2048, 32):
            record("prefill paged", shape, "torch reference",
                   lambda b=batch: b.call(attention.paged_attention_ref), **cost)
        if prefix == 0 and num_kv_heads == 32:
            q, k, v = (randn(batch_size, 32, new, 128) for _ in range(3))
            for backend in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
                record("prefill dense", shape, f"SDPA {backend.split('_')[0].lower()}",
                       lambda q=q, k=k, v=v, be=backend: sdpa(q, k, v, be, is_causal=True),
                       **cost)


# ----------------------------------------------------------------------------- AWQ (--awq)
# Owned with tinypaged/kernels/awq.py: extend here (shapes, GEMM tile sweeps) as that kernel grows.


def time_awq() -> None:
    """int4 AWQ (group 128) against the bf16 linear with the unquantized weight: the GEMV path
    at M=1 reads ~4x fewer bytes, the GEMM path at M=2048 is compute-bound."""
    from tinypaged.kernels import awq

    group = 128
    for K, N in ((4096, 14336), (14336, 4096)):
        qweight = torch.randint(-2**31, 2**31 - 1, (K, N // 8), device=DEV, dtype=torch.int32)
        qzeros = torch.randint(-2**31, 2**31 - 1, (K // group, N // 8), device=DEV,
                               dtype=torch.int32)
        for dtype in (torch.bfloat16, torch.float16):
            scales = (torch.rand(K // group, N, device=DEV) * 0.01).to(dtype)
            for m in (1, 16, 300):
                x = randn(m, K, dtype=dtype)
                want = awq.awq_gemm_reference(x, qweight, qzeros, scales, group)
                if m >= awq.DENSE_MIN_M:  # by definition x @ W with W materialized in x's dtype
                    w = awq.awq_dequantize_reference(qweight, qzeros, scales, group).to(dtype)
                    want = (x.float() @ w.float()).to(dtype)
                compare(f"awq_gemm M={m} {K}x{N}", awq.awq_gemm(x, qweight, qzeros, scales, group),
                        want, dtype, tol=2e-2)
        scales = (torch.rand(K // group, N, device=DEV) * 0.01).to(torch.bfloat16)
        dense = randn(N, K, dtype=torch.bfloat16)
        packed_bytes = K * N // 2 + (K // group) * N * 2 + (K // group) * N // 2
        for m in (1, 8, 2048):
            x = randn(m, K, dtype=torch.bfloat16)
            shape = f"M{m} {K}x{N} bf16"
            io = 2 * m * (K + N)  # x read, y written (bf16)
            kind = {"flops": 2 * m * K * N, "compute_bound": m >= 256}
            record("awq_gemm", shape, "triton", lambda x=x, s=scales, q=qweight, z=qzeros:
                   awq.awq_gemm(x, q, z, s, group), bytes_moved=packed_bytes + io, **kind)
            record("bf16 linear", shape, "F.linear (cuBLAS)", lambda x=x, w=dense: F.linear(x, w),
                   bytes_moved=2 * K * N + io, **kind)


# ----------------------------------------------------------------------------- tuning (--tune)


def keep_fastest(start: int, count: int = 5) -> None:
    """Keep only the `count` fastest of the table rows added since `start`."""
    ROWS[start:] = sorted(ROWS[start:], key=lambda row: row["us"])[:count]


def tune_prefill() -> None:
    print("tuning: attention tile configs (bf16, 32/8 heads, d128)")
    start = len(ROWS)
    prefill = PagedBatch([2048] * 4, [2048] * 4, 32, 8, 128, torch.bfloat16)
    flops = 4 * 4 * 32 * 128 * 2048 * 2048 / 2
    for block_m, block_n, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8),
                                                             (2, 3)):
        config = {"block_m": block_m, "block_n": block_n, "num_warps": warps, "num_stages": stages}
        record("prefill tune", "B4 L2048 32/8", str(config),
               lambda c=config: prefill.call(attention.paged_attention, config=c),
               bytes_moved=prefill.kv_bytes(), flops=flops, compute_bound=True)
    keep_fastest(start)


def tune_decode() -> None:
    for ctx in (1024, 2048):
        start = len(ROWS)
        decode = PagedBatch([1] * 64, [ctx] * 64, 32, 8, 128, torch.bfloat16)
        for block_n, warps, stages, splits in itertools.product((32, 64, 128), (4, 8), (2, 3),
                                                                (1, 2, 4, 8)):
            config = {"block_n": block_n, "num_warps": warps, "num_stages": stages}
            record("decode tune", f"B64 ctx{ctx} {splits} splits", str(config),
                   lambda c=config, s=splits, d=decode: d.call(attention.paged_attention,
                                                               config=c, num_splits=s),
                   bytes_moved=decode.kv_bytes())
        keep_fastest(start)


# ----------------------------------------------------------------------------- main


def print_table() -> None:
    print(f"\n| kernel | shape | impl | time (us) | achieved | % of ceiling |\n|{'---|' * 6}")
    for r in ROWS:
        if math.isnan(r["us"]):  # did not run
            print(f"| {r['op']} | {r['shape']} | {r['impl']} | n/a | | |")
        else:
            print(f"| {r['op']} | {r['shape']} | {r['impl']} | {r['us']:.1f} | "
                  f"{r['achieved']:.0f} {r['unit']} | {r['pct']:.0f}% |")


def write_json(path: str, header: dict) -> None:
    """The run as JSON for docs/plots.py (NaN, for what did not run, becomes null)."""
    clean = [{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()}
             for r in ROWS]
    ceilings = {"copy_GB_s": CEILING["GB/s"], "matmul_TFLOP_s": CEILING["TFLOP/s"]}
    with open(path, "w") as f:
        json.dump({**header, "ceilings": ceilings, "rows": clean}, f, indent=1)
    print(f"wrote {len(clean)} rows to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--awq", action="store_true", help="also check and time awq_gemm")
    parser.add_argument("--tune", action="store_true", help="also sweep attention tile configs")
    parser.add_argument("--keep-going", action="store_true", help="time even after a mismatch")
    parser.add_argument("--awq-only", action="store_true", help="only the AWQ checks and timings")
    parser.add_argument("--json", metavar="PATH", help="also write the rows and ceilings here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs a CUDA GPU")
    torch.manual_seed(0)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False).stdout.strip()
    except OSError:
        commit = "?"
    header = {"date": str(datetime.date.today()), "device": torch.cuda.get_device_name(),
              "commit": commit or "?", "torch": torch.__version__}
    print(" ".join(f"{k} {v}" for k, v in header.items()))
    if not args.awq_only:
        check_all()
        if FAILURES and not args.keep_going:
            sys.exit(f"FAILED: {len(FAILURES)} kernel(s) disagree with their reference: {FAILURES}")
    measure_ceilings()
    if not args.awq_only:
        time_elementwise()
        time_decode()
        time_prefill()
        time_windows()
    if args.awq or args.awq_only:
        time_awq()
    if args.tune:
        tune_prefill()
        tune_decode()
    print_table()
    if args.json:
        write_json(args.json, header)
    if FAILURES:
        sys.exit(f"FAILED: {FAILURES}")


if __name__ == "__main__":
    main()
