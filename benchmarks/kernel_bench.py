"""Kernel benchmark on one GPU: correctness first, then speed beside ceilings and torch peers.

    PYTHONPATH=. python benchmarks/kernel_bench.py            # checks, then timings, then a table
    PYTHONPATH=. python benchmarks/kernel_bench.py --awq      # also the AWQ int4 GEMM / GEMV
    PYTHONPATH=. python benchmarks/kernel_bench.py --tune     # also sweep attention tiles (~2 min)
    PYTHONPATH=. python benchmarks/kernel_bench.py --moe --gguf --gptq   # MoE, GGUF, GPTQ int8
    PYTHONPATH=. python benchmarks/kernel_bench.py --only fp8 --json docs/kernels/h200.json --update
    PYTHONPATH=. python benchmarks/kernel_bench.py --all --json docs/kernels/h200.json  # the plots
    PYTHONPATH=. python benchmarks/kernel_bench.py --all --quick    # fewer checks and repeats
    PYTHONPATH=. python benchmarks/kernel_bench.py --only moe --json docs/kernels/h200.json --update

1. Every Triton kernel is compared with its torch reference in bf16 and fp16 (max error printed;
   --quick: bf16 only, the attention cases at one head shape) before its family is timed; a
   family with a mismatch is not timed (unless --keep-going) and the script ends with exit
   code 1.
2. Each op is timed with `triton.testing.do_bench` (median; it flushes L2 between runs), or,
   where one call takes a few microseconds (decode GEMVs, MoE routing), replayed from a CUDA
   graph over weight copies larger than L2 as decode runs it (`awq_gemv.graph_us`; the row's
   impl says "graph"), and reported as achieved GB/s (memory-bound ops: norm, rotary, SiLU,
   KV store, decode attention, decode-sized GEMVs) or TFLOP/s (prefill attention, large GEMMs),
   next to ceilings measured in the same run (a 1 GiB device copy, an 8192^3 bf16 matmul) and
   torch peers (the reference, F.rms_norm, SDPA cuDNN / flash, F.linear).
   The quantized and MoE families reuse their own benchmarks' inputs and checks
   (benchmarks/awq_gemv.py, gguf_gemv.py, gptq.py, moe.py).
3. A markdown table closes the output (benchmarks/RESULTS.md's kernel table). With `--json PATH`
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
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from tinypaged.kernels import activation, attention, dense_gemv, kv_cache, norm, rotary
from tinypaged.kernels._triton import cdiv, num_sms
from tinypaged.kernels.attention_decode import decode_num_splits
from tinypaged.kernels.attention_varlen import varlen_attention_triton

DEV = "cuda"
ROWS: list[dict] = []  # one per timing: op, shape, impl, us, bytes, flops, achieved, unit, pct
CEILING = {"GB/s": 0.0, "TFLOP/s": 0.0}
FAMILY = {  # op -> the docs page (docs/kernels/<family>.md) whose plot shows it
    "rms_norm": "norm_activation", "add+rms_norm": "norm_activation",
    "silu_and_mul": "norm_activation", "rotary (neox)": "rotary", "store_kv": "kv_cache",
    "decode paged": "decode_attention", "decode dense": "decode_attention",
    "prefill paged": "prefill_attention", "prefill dense": "prefill_attention",
    "prefill varlen": "prefill_attention",
    "awq_gemm": "awq", "bf16 linear": "awq", "awq_mma": "awq", "awq batched GEMV": "awq",
    "rotary_store_kv": "kv_cache", "rotary + store_kv": "kv_cache",
    "fused_experts": "moe", "moe dense bf16": "moe", "select_experts": "moe",
    "moe_align": "moe",
    "gguf_gemv": "gguf", "gptq_int8_gemm": "gptq_int8",
    "fp8 linear": "fp8", "fp8_gemm": "fp8", "torch._scaled_mm": "fp8", "quantize_fp8": "fp8",
    "lora_shrink": "lora", "lora_expand": "lora",
}
GROUPS = ["core", "awq", "gguf", "gptq", "moe", "fp8",  # what --only / --all pick (own plots)
          "lora"]
REPEATS = {"warmup": 25, "rep": 100}  # do_bench's milliseconds; --quick lowers them


def bench_ms(fn) -> float:
    return do_bench(fn, **REPEATS, return_mode="median")


def graph_ms(calls: list) -> float:
    """A CUDA graph of 50 calls cycling through `calls`, replayed (benchmarks/awq_gemv.py)."""
    from awq_gemv import graph_us

    return graph_us(calls) / 1e3


def record(op: str, shape: str, impl: str, fn, *, bytes_moved: float, flops: float = 0.0,
           compute_bound: bool = False, family: str | None = None) -> float:
    """Time fn and add a table row; returns milliseconds (nan when the impl cannot run).

    fn: a callable (timed by do_bench) or a list of callables (one CUDA graph over them).
    bytes_moved: the least DRAM traffic the op needs; flops: its arithmetic. The row reports
    TFLOP/s against the matmul ceiling when compute_bound, else GB/s against the copy ceiling."""
    row = {"op": op, "family": family or FAMILY.get(op), "shape": shape, "impl": impl,
           "bytes": bytes_moved, "flops": flops, "unit": "TFLOP/s" if compute_bound else "GB/s",
           "us": float("nan"), "achieved": float("nan"), "pct": float("nan")}
    ROWS.append(row)
    try:
        ms = graph_ms(fn) if isinstance(fn, list) else bench_ms(fn)
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


def check_all(dtypes=(torch.bfloat16, torch.float16), quick: bool = False) -> None:
    print("correctness: Triton vs torch reference")
    for dtype in dtypes:
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
            [(32, 8, 128)] if quick else [(32, 8, 128), (12, 4, 64), (16, 16, 128)],
            cases.items()
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
        if prefix == 0 and num_kv_heads == 8:  # the portable kernel the Hopper one replaces
            record("prefill varlen", shape, "triton varlen (no TMA)",
                   lambda b=batch: varlen_attention_triton(
                       b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc,
                       b.scale, torch.empty_like(b.q), **attention.VARLEN_CONFIG), **cost)
        if (batch_size, new, num_kv_heads) == (4, 2048, 32):
            record("prefill paged", shape, "torch reference",
                   lambda b=batch: b.call(attention.paged_attention_ref), **cost)
        if prefix == 0 and num_kv_heads == 32:
            q, k, v = (randn(batch_size, 32, new, 128) for _ in range(3))
            for backend in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
                record("prefill dense", shape, f"SDPA {backend.split('_')[0].lower()}",
                       lambda q=q, k=k, v=v, be=backend: sdpa(q, k, v, be, is_causal=True),
                       **cost)


# ----------------------------------------------------------------------------- fused KV store


FUSED_HQ, FUSED_HK, FUSED_D = 32, 8, 128  # Llama-3-8B's heads; block size 16
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def fused_kv_step(num_tokens: int, dtype: torch.dtype, seed: int = 0):
    """(positions, q, k, v, (k_cache, v_cache), slot_mapping, (q_norm, k_norm)) of one step:
    q, k, v views of one [T, (32 + 2 * 8) * 128] projection, as the model hands them over."""
    hq, hk, d, block = FUSED_HQ, FUSED_HK, FUSED_D, 16
    gen = torch.Generator(device=DEV).manual_seed(seed)
    qkv = torch.randn(num_tokens, (hq + 2 * hk) * d, device=DEV, generator=gen).to(dtype)
    q, k, v = (t.view(num_tokens, -1, d) for t in qkv.split([hq * d, hk * d, hk * d], dim=-1))
    num_blocks = num_tokens // block + 8
    caches = [torch.zeros(num_blocks, block, hk, d, device=DEV, dtype=dtype) for _ in range(2)]
    slots = torch.randperm(num_blocks * block, device=DEV, generator=gen)[:num_tokens]
    positions = torch.randint(0, 4096, (num_tokens,), device=DEV, generator=gen)
    weights = [torch.rand(d, device=DEV, generator=gen).to(dtype) + 0.5 for _ in range(2)]
    return positions, q, k, v, caches, slots, weights


def check_fused_kv() -> None:
    """rotary_store_kv against its reference in bf16 and fp16: neox and gptj pairs, partial
    rotary, with and without the q/k norm, a quarter of the rows padding (slot -1)."""
    from tinypaged.kernels.rotary_kv_cache import rotary_store_kv_ref, rotary_store_kv_triton
    from tinypaged.models.rope import RopeSpec

    print("correctness: rotary_store_kv (rotary + q/k norm + KV store in one launch)")
    for dtype in (torch.bfloat16, torch.float16):
        for interleaved, rotary_dim, with_norm in ((False, 128, True), (False, 128, False),
                                                   (True, 64, False), (False, 64, True)):
            positions, q, k, v, (kc, vc), slots, weights = fused_kv_step(96, dtype)
            slots[::4] = -1
            table = RopeSpec(500000.0, rotary_dim, 8192, scaling=LLAMA3_ROPE).cos_sin_cache()
            table = table.to(DEV)
            norms = weights if with_norm else (None, None)
            q_ref, kc_ref, vc_ref = q.clone(), kc.clone(), vc.clone()
            rotary_store_kv_triton(positions, q, k, v, kc, vc, slots, table, rotary_dim,
                                   interleaved, *norms)
            rotary_store_kv_ref(positions, q_ref, k, v, kc_ref, vc_ref, slots, table, rotary_dim,
                                interleaved, *norms)
            errs = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                    for a, b in ((q, q_ref), (kc, kc_ref), (vc, vc_ref))]
            good = max(errs) < (2e-2 if dtype == torch.bfloat16 else 5e-3)  # 1-2 ulp
            if not good and "rotary_store_kv" not in FAILURES:
                FAILURES.append("rotary_store_kv")
            print(f"  check {str(dtype):15s} {'gptj' if interleaved else 'neox'} "
                  f"rotary {rotary_dim:3d} norm {with_norm!s:5s}  max err q/k/v "
                  f"{errs[0]:.1e}/{errs[1]:.1e}/{errs[2]:.1e}  {'ok' if good else 'MISMATCH'}")


def time_fused_kv() -> None:
    """What the model runs: rotary (and Qwen3's q/k norm) + KV store in one launch, against the
    separate kernels, at a decode batch (T=64) and a prefill chunk (T=4096); CUDA graphs."""
    print("timings: fused rotary + KV store (bf16, 32/8 heads, d128)")
    for with_norm, t in itertools.product((False, True), (64, 4096)):
        time_fused_kv_step(t, with_norm)


def time_fused_kv_step(t: int, with_norm: bool) -> None:
    from tinypaged.kernels.rotary_kv_cache import rotary_store_kv
    from tinypaged.models.rope import RopeSpec

    hq, hk, d = FUSED_HQ, FUSED_HK, FUSED_D
    table = RopeSpec(500000.0, d, 8192).cos_sin_cache().to(DEV)
    positions, q, k, v, (kc, vc), slots, (wq, wk) = fused_kv_step(t, torch.bfloat16)
    norms = (wq, wk) if with_norm else (None, None)

    def fused():
        rotary_store_kv(positions, q, k, v, kc, vc, slots, table, d, False, *norms)

    def separate():
        qq, kk = (norm.rms_norm(q, wq, 1e-6), norm.rms_norm(k, wk, 1e-6)) if with_norm else (q, k)
        rotary.rotary_embedding(positions, qq, kk, table, d)
        kv_cache.store_kv(kk, v, kc, vc, slots)

    shape = f"T{t} {hq}/{hk} heads d{d}" + (" + q/k norm" if with_norm else "")
    cost = {"bytes_moved": t * 2 * (hq + 2 * hk) * d * 2}  # q, k, v read and written
    record("rotary_store_kv", shape, "triton graph (1 launch)", [fused], **cost)
    record("rotary + store_kv", shape, f"triton graph ({4 if with_norm else 2} launches)",
           [separate], **cost)


# ----------------------------------------------------------------------------- quantized linears
# Decode-sized rows (M <= 16) replay a CUDA graph over weight copies together larger than L2, as
# a captured decode step streams each layer's weights from HBM (a do_bench call of a 20 us GEMV
# mostly measures the Python launch). Bytes: the packed weights with their scales and zeros, x
# read and y written; FLOPs 2 M K N.

LINEAR = (4096, 14336)  # K, N: the Llama-3-8B MLP's up projection
AWQ_SHAPES = (LINEAR, (14336, 4096))  # and its down projection
GGUF_TYPES = {"Q4_K": 12, "Q6_K": 14, "Q8_0": 8}


def weight_copies(nbytes: int) -> int:
    from awq_gemv import L2_BYTES

    return max(2, cdiv(3 * L2_BYTES, nbytes))


def decode_rows(op: str, label: str, fn, weights: list, nbytes: int) -> None:
    """fn(x, w) at M = 1 and 8 rows of the LINEAR shape, one CUDA graph cycling through the
    weight copies `weights` (each `nbytes` with its scales and zeros)."""
    K, N = LINEAR
    for m in (1, 8):
        x = randn(m, K)
        record(op, f"M{m} {K}x{N} {label}", "triton graph",
               [lambda x=x, w=w: fn(x, w) for w in weights],
               bytes_moved=nbytes + 2 * m * (K + N), flops=2 * m * K * N)


def bf16_linear_rows(K: int, N: int, ms, family: str) -> None:
    """The bf16 F.linear with the unquantized weight [N, K]: the peer of every quantized row."""
    dense = [randn(N, K) for _ in range(weight_copies(2 * K * N))]
    for m in ms:
        x = randn(m, K)
        fn = [lambda x=x, w=w: F.linear(x, w) for w in dense] if m <= 16 else \
            (lambda x=x: F.linear(x, dense[0]))
        record("bf16 linear", f"M{m} {K}x{N} bf16", "F.linear (cuBLAS)" + " graph" * (m <= 16),
               fn, bytes_moved=2 * K * N + 2 * m * (K + N), flops=2 * m * K * N,
               compute_bound=m >= 256, family=family)


def check_awq(dtypes) -> None:
    """awq_gemm's every path: GEMV (M=1), awq_mma or the batched GEMV (M=8, 16, per
    DECODE_PATHS), tiled or dequantize + cuBLAS (M=300)."""
    from tinypaged.kernels import awq

    print("correctness: awq_gemm (int4, group 128)")
    group = 128
    for K, N in AWQ_SHAPES:
        qweight = torch.randint(-2**31, 2**31 - 1, (K, N // 8), device=DEV, dtype=torch.int32)
        qzeros = torch.randint(-2**31, 2**31 - 1, (K // group, N // 8), device=DEV,
                               dtype=torch.int32)
        for dtype in dtypes:
            scales = (torch.rand(K // group, N, device=DEV) * 0.01).to(dtype)
            for m in (1, 8, 16, 300):
                x = randn(m, K, dtype=dtype)
                want = awq.awq_gemm_reference(x, qweight, qzeros, scales, group)
                if m >= awq.DENSE_MIN_M:  # by definition x @ W with W materialized in x's dtype
                    w = awq.awq_dequantize_reference(qweight, qzeros, scales, group).to(dtype)
                    want = (x.float() @ w.float()).to(dtype)
                path = awq.decode_path(m, N, K)[0] if 1 < m <= awq.GEMV_MAX_M else ""
                compare(f"awq_gemm M={m} {K}x{N} {path}",
                        awq.awq_gemm(x, qweight, qzeros, scales, group), want, dtype, tol=2e-2)


def time_awq() -> None:
    """int4 AWQ (group 128) against the bf16 linear: at M=1 the GEMV reads ~4x fewer bytes; at
    M=8 the dispatch (awq_gemm) beside both decode kernels it chooses between (awq_mma with the
    weights in the MMA's M slot, the batched GEMV with x there); M=2048 is compute-bound."""
    from awq_gemv import GROUP, awq_weights, layer_paths

    from tinypaged.kernels import awq

    print("timings: AWQ int4 (bf16 activations, group 128)")
    for K, N in AWQ_SHAPES:
        packed_bytes = K * N // 2 + (K // GROUP) * N * 2 + (K // GROUP) * N // 2
        weights = awq_weights(K, N, weight_copies(packed_bytes))
        for m in (1, 8, 2048):
            x = randn(m, K)
            shape = f"M{m} {K}x{N} bf16"
            cost = {"bytes_moved": packed_bytes + 2 * m * (K + N), "flops": 2 * m * K * N}
            if m > awq.GEMV_MAX_M:
                record("awq_gemm", shape, "triton", lambda x=x, w=weights[0]: awq.awq_gemm(
                    x, *w[:3], GROUP), compute_bound=m >= 256, **cost)
                continue
            for name, fn in layer_paths(m).items():
                op = {"awq_gemm": "awq_gemm", "batched GEMV": "awq batched GEMV"}.get(
                    name, "awq_mma")
                impl = "triton graph" + (f" ({awq.decode_path(m, N, K)[0]})" if m > 1 else "")
                record(op, shape, impl if op == "awq_gemm" else "triton graph",
                       [lambda x=x, w=w, fn=fn: fn(x, w) for w in weights], **cost)
        del weights
        bf16_linear_rows(K, N, (1, 8, 2048), "awq")


def check_gguf() -> None:
    from gguf_gemv import checks  # benchmarks/gguf_gemv.py: 4096x4096 and a ragged 2048x1000

    print("correctness: gguf_gemv (bf16 x) against the block formats' torch reference")
    try:
        checks(list(GGUF_TYPES.items()), [1, 8])
    except AssertionError as e:
        print(f"  FAIL gguf_gemv {e}")
        FAILURES.append(f"gguf_gemv {e}")


def time_gguf() -> None:
    """GGUF block formats (llama.cpp's Q4_K, Q6_K, Q8_0) at decode sizes beside bf16."""
    from gguf_gemv import random_qweight, run

    from tinypaged.kernels.gguf_format import row_bytes

    print("timings: GGUF GEMV (bf16 activations)")
    K, N = LINEAR
    for name, type_id in GGUF_TYPES.items():
        nbytes = N * row_bytes(type_id, K)
        weights = [random_qweight(type_id, N, K) for _ in range(weight_copies(nbytes))]
        decode_rows("gguf_gemv", name, lambda x, w, t=type_id: run(x, w, t, {}), weights, nbytes)
        del weights
    bf16_linear_rows(K, N, (1, 8), "gguf")


def check_gptq() -> None:
    from gptq import (  # benchmarks/gptq.py: the layer as quantization/gptq.py builds it
        check,
        gptq_layer,
    )

    print("correctness: GPTQ int8 layers (M = 1, 8, 40, 300) against the format's reference")
    for act_order in (False, True):
        name = f"gptq int8 g128{' act-order' if act_order else ''} {LINEAR[0]}x{LINEAR[1]}"
        try:
            err = check(*gptq_layer(*LINEAR, 8, 128, act_order))
            print(f"  ok   {name:48s} bfloat16  max err / max |ref| {err:.2e}")
        except AssertionError as e:
            print(f"  FAIL {name}: {e}")
            FAILURES.append(f"{name}: {e}")


def time_gptq() -> None:
    """GPTQ int8 (group 128): 1 byte a weight, half the bf16 linear's bytes."""
    from gptq import int8_weights

    from tinypaged.kernels import gptq_int8

    print("timings: GPTQ int8 (bf16 activations, group 128)")
    K, N = LINEAR
    nbytes = K * N + (K // 128) * N * 3  # q, then one fp16 scale and one uint8 zero per group
    weights = int8_weights(K, N, weight_copies(nbytes))
    decode_rows("gptq_int8_gemm", "int8 g128",
                lambda x, w: gptq_int8.gptq_int8_gemm(x, *w[:3], scales_t=w[3]), weights, nbytes)
    del weights
    bf16_linear_rows(K, N, (1, 8), "gptq_int8")


# ----------------------------------------------------------------------------- FP8 (--fp8)


def fp8_weight(N: int, K: int, block: bool):
    """A random [N, K] weight as kernels/fp8.py stores it: (e4m3 weight, fp32 scales)."""
    from tinypaged.kernels.fp8 import FP8_MAX

    w = torch.randn(N, K, device=DEV)
    if block:
        s = w.reshape(N // 128, 128, K // 128, 128).abs().amax((1, 3)) / FP8_MAX
        w = (w.reshape(N // 128, 128, K // 128, 128) / s[:, None, :, None]).reshape(N, K)
        return w.to(torch.float8_e4m3fn), s
    s = w.abs().amax(1, keepdim=True) / FP8_MAX
    return (w / s).to(torch.float8_e4m3fn), s


def check_fp8() -> None:
    from tinypaged.kernels import fp8

    print("correctness: FP8 quantize and GEMM (per token x per channel, block-wise 128)")
    for M in (1, 8, 300):
        for block in (False, True):
            K, N = LINEAR
            w, ws = fp8_weight(N, K, block)
            x = randn(M, K)
            q, s = fp8.quantize_fp8(x, 128 if block else None)
            q_ref, s_ref = fp8.quantize_fp8_reference(x, 128 if block else None)
            b = (128, 128) if block else None
            name = f"fp8 {'block' if block else 'channel'} M{M} {K}x{N}"
            if not (torch.equal(q.float(), q_ref.float()) and torch.allclose(s, s_ref)):
                FAILURES.append(f"{name}: quantize_fp8 differs from its reference")
            compare(name, fp8.fp8_gemm(q, s, w, ws, torch.bfloat16, b),
                    fp8.fp8_gemm_reference(q, s, w, ws, torch.float32, b), torch.bfloat16)
            if M <= dense_gemv.GEMV_MAX_M:  # the decode path: W8A16, x as it is
                compare(f"{name} W8A16 GEMV", dense_gemv.dense_gemv(
                    x, w, None, ws, b, **dense_gemv.fp8_gemv_config(M, b)),
                    dense_gemv.dense_gemv_reference(x.float(), w, None, ws, b), torch.bfloat16)
    x, weight, res = randn(257, 4096), randn(4096), randn(257, 4096)
    for group in (None, 128):  # RMSNorm + residual, quantized in the same pass
        q, s, r = norm.rms_norm_quant_fp8(x, weight, 1e-6, res, group)
        q_ref, s_ref, r_ref = norm.rms_norm_quant_fp8_ref(x, weight, 1e-6, res, group)
        name = f"rms_norm_quant_fp8 group={group} [257, 4096]"
        compare(f"{name}: sum", r, r_ref, torch.bfloat16)
        compare(f"{name}: scales", s, s_ref, torch.bfloat16)
        # one bf16 ulp of the norm may move an e4m3 rounding: compare the dequantized rows
        compare(f"{name}: q * s", q.float() * s.repeat_interleave(4096 // s.shape[1], 1),
                q_ref.float() * s_ref.repeat_interleave(4096 // s.shape[1], 1), torch.bfloat16,
                tol=0.07)


def time_fp8() -> None:
    """FP8 W8A8: the decode rows (quantize + GEMM, 1 byte a weight) beside bf16, and the prefill
    GEMM beside torch._scaled_mm (cuBLASLt's FP8: the FP8 tensor-core peak) and bf16 cuBLAS."""
    from tinypaged.kernels import fp8

    print("timings: FP8 (e4m3 weights, per-channel scales; activations per token)")
    K, N = LINEAR
    nbytes = K * N + 4 * N
    weights = [fp8_weight(N, K, False) for _ in range(weight_copies(nbytes))]

    def linear(x, w):
        q, s = fp8.quantize_fp8(x)
        return fp8.fp8_gemm(q, s, w[0], w[1], x.dtype)

    decode_rows("fp8 linear", "fp8 channel", linear, weights, nbytes)
    decode_rows("fp8 linear", "fp8 channel W8A16 GEMV", lambda x, w: dense_gemv.dense_gemv(
        x, w[0], None, w[1], **dense_gemv.fp8_gemv_config(x.shape[0], None)), weights, nbytes)
    del weights
    bf16_linear_rows(K, N, (1, 8, 8192), "fp8")
    M = 8192
    x = randn(M, K)
    record("quantize_fp8", f"M{M} K{K} per token", "triton", lambda: fp8.quantize_fp8(x),
           bytes_moved=3 * M * K + 4 * M)
    for block in (False, True):
        w, ws = fp8_weight(N, K, block)
        q, s = fp8.quantize_fp8(x, 128 if block else None)
        b = (128, 128) if block else None
        record("fp8_gemm", f"M{M} {K}x{N} {'block 128' if block else 'token x channel'}",
               "triton", lambda q=q, s=s, w=w, ws=ws, b=b: fp8.fp8_gemm(q, s, w, ws,
                                                                      torch.bfloat16, b),
               bytes_moved=M * K + K * N + 2 * M * N, flops=2 * M * K * N, compute_bound=True)
    w, ws = fp8_weight(N, K, False)
    q, s = fp8.quantize_fp8(x)
    wt, wst = w.t(), ws.t().contiguous()
    record("torch._scaled_mm", f"M{M} {K}x{N} token x channel", "cuBLASLt",
           lambda: torch._scaled_mm(q, wt, scale_a=s, scale_b=wst, out_dtype=torch.bfloat16),
           bytes_moved=M * K + K * N + 2 * M * N, flops=2 * M * K * N, compute_bound=True)


# ----------------------------------------------------------------------------- MoE (--moe)

MOE_TOKENS = (1, 8, 512)


def check_moe() -> None:
    import moe as bench  # benchmarks/moe.py: Qwen3-30B-A3B layer, routing and align kernels too

    print("correctness: fused MoE (Qwen3-30B-A3B layer shape)")
    if not bench.check(MOE_TOKENS):
        FAILURES.append("fused MoE")


def time_moe() -> None:
    """Qwen3-30B-A3B's MoE layer (128 experts, top-8, H 2048, I 768): fused_experts as the engine
    calls it (GEMVs at few tokens, the grouped GEMM above), the grouped GEMM alone, a dense bf16
    GEMM of the same FLOPs, and the two small kernels before it (routing, sort by expert). Graphs
    replay 4 routings, so small T reads other experts call after call, not L2; the bytes are the
    weights of the experts hit (their mean over the routings), which bound a decode step."""
    import moe as bench

    print("timings: fused MoE (bf16, Qwen3-30B-A3B layer)")
    dense = [randn(bench.TOP_K * 3 * bench.INTER, bench.HIDDEN) * 0.02 for _ in range(2)]
    for t in MOE_TOKENS:
        time_moe_tokens(t, dense)


def time_moe_tokens(t: int, dense: list[torch.Tensor]) -> None:
    import moe as bench

    from tinypaged.kernels import moe, moe_align, moe_gemv, moe_routing

    H, E, k, inter = bench.HIDDEN, bench.EXPERTS, bench.TOP_K, bench.INTER
    x, w13, w2, logits, _, ids = bench.case(t, torch.bfloat16, seed=t)
    routes = bench.routings(t)
    hit = sum(i.unique().numel() for _, i in routes) / len(routes)
    flops = 2 * t * k * 3 * inter * H
    shape = f"T{t} E{E} top-{k} H{H} I{inter}"
    cost = {"bytes_moved": hit * 3 * inter * H * 2 + 2 * 2 * t * H, "flops": flops}
    path = "GEMV" if moe_gemv.use_gemv(t, k, E) else "grouped GEMM"
    record("fused_experts", shape, f"triton graph ({path})",
           [lambda w=w, i=i: moe.fused_experts(x, w13, w2, w, i) for w, i in routes], **cost)
    if path == "GEMV":
        record("fused_experts", shape, "triton graph (grouped GEMM)",
               [lambda w=w, i=i: moe.fused_experts_triton(x, w13, w2, w, i) for w, i in routes],
               **cost)
    record("moe dense bf16", shape, "F.linear graph, same FLOPs",
           [lambda w=w: F.linear(x, w) for w in dense],
           bytes_moved=2 * k * 3 * inter * H + 2 * t * (H + k * 3 * inter), flops=flops,
           compute_bound=t >= 256)  # one weight for every token: ~T FLOPs a byte
    for impl, fn in (("triton graph", moe_routing.select_experts_triton),
                     ("torch reference graph", moe_routing.select_experts_ref)):
        record("select_experts", f"T{t} E{E} top-{k}", impl,
               [lambda fn=fn: fn(logits, k, renormalize=True)],
               bytes_moved=t * E * 4 + t * k * 8, flops=5 * t * E)
    block_m = moe.get_config(t)["BLOCK_M"]
    padded = moe_align.max_padded_tokens(t * k, E, block_m)
    for impl, fn in (("triton graph", moe_align.moe_align_block_size_triton),
                     ("torch reference graph", moe_align.moe_align_block_size_ref)):
        record("moe_align", f"T{t} E{E} top-{k} block {block_m}", impl,
               [lambda fn=fn: fn(ids, block_m, E)],
               bytes_moved=t * k * 4 + padded * 4 + padded // block_m * 4 + 4)


def check_lora() -> None:
    import lora_kernels  # benchmarks/lora_kernels.py: Llama-3-8B linears, 4 adapters, rank 16

    if not lora_kernels.check():
        FAILURES.append("lora")


def time_lora() -> None:
    import lora_kernels

    print("timings: LoRA shrink / expand (bf16, Llama-3-8B linears)")
    lora_kernels.time_all(record)


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


def write_json(path: str, header: dict, update: bool = False) -> None:
    """The run as JSON for docs/plots.py (NaN, for what did not run, becomes null).

    Each plot family records the run it comes from (`runs`: date, commit, device, ceilings).
    With update, the rows of the families this run measured replace those in the file at
    `path`, and the file's other families stay as they were (a GPU run split in pieces)."""
    clean = [{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()}
             for r in ROWS]
    ceilings = {"copy_GB_s": CEILING["GB/s"], "matmul_TFLOP_s": CEILING["TFLOP/s"]}
    this_run = {**header, "ceilings": ceilings}
    runs = {r["family"]: this_run for r in clean if r["family"]}
    rows = clean
    if update and Path(path).exists():
        old = json.loads(Path(path).read_text())
        kept = [r for r in old["rows"] if r.get("family") and r["family"] not in runs]
        old_run = {k: old[k] for k in ("date", "device", "commit", "torch", "ceilings") if k in old}
        runs = {**{r["family"]: old.get("runs", {}).get(r["family"], old_run) for r in kept},
                **runs}
        rows = kept + clean
    tmp = Path(f"{path}.tmp")  # then renamed: a run killed mid-write leaves the old file whole
    tmp.write_text(json.dumps({**this_run, "runs": runs, "rows": rows}, indent=1))
    tmp.replace(path)
    print(f"wrote {len(clean)} rows ({len(rows)} in all) to {path}")


def run_timed(name: str, fn) -> None:
    start = time.perf_counter()
    fn()
    print(f"  ({name}: {time.perf_counter() - start:.1f} s)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--awq", action="store_true", help="also check and time awq_gemm")
    parser.add_argument("--moe", action="store_true", help="also the fused MoE kernels")
    parser.add_argument("--gguf", action="store_true", help="also the GGUF block-format GEMVs")
    parser.add_argument("--gptq", action="store_true", help="also the GPTQ int8 kernels")
    parser.add_argument("--fp8", action="store_true", help="also the FP8 quantize and GEMM")
    parser.add_argument("--lora", action="store_true", help="also the LoRA shrink / expand")
    parser.add_argument("--all", action="store_true", help="--awq --moe --gguf --gptq --fp8 --lora")
    parser.add_argument("--only", nargs="+", choices=GROUPS, metavar="GROUP",
                        help=f"only these groups of families, of {', '.join(GROUPS)}")
    parser.add_argument("--quick", action="store_true",
                        help="bf16 checks only, one attention head shape, fewer do_bench repeats")
    parser.add_argument("--tune", action="store_true", help="also sweep attention tile configs")
    parser.add_argument("--keep-going", action="store_true", help="time even after a mismatch")
    parser.add_argument("--awq-only", action="store_true", help="only the AWQ checks and timings")
    parser.add_argument("--json", metavar="PATH", help="also write the rows and ceilings here")
    parser.add_argument("--update", action="store_true",
                        help="replace only the measured families' rows in the --json file")
    parser.add_argument("--commit", help="the commit to record (default: git rev-parse HEAD)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernel_bench.py needs a CUDA GPU")
    torch.manual_seed(0)
    if args.quick:
        REPEATS.update(warmup=5, rep=25)
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                           capture_output=True, text=True,
                                           check=False).stdout.strip()
    header = {"date": str(datetime.date.today()), "device": torch.cuda.get_device_name(),
              "commit": commit or "?", "torch": torch.__version__}
    print(" ".join(f"{k} {v}" for k, v in header.items()))
    on = set(args.only or ["core", *(g for g in GROUPS[1:] if args.all or getattr(args, g))])
    if args.awq_only:
        on = {"awq"}
    dtypes = (torch.bfloat16,) if args.quick else (torch.bfloat16, torch.float16)
    families = [  # (group, check, timings, enabled)
        ("core", lambda: (check_all(dtypes, args.quick), check_fused_kv()),
         [time_elementwise, time_fused_kv, time_decode, time_prefill, time_windows],
         "core" in on),
        ("awq", lambda: check_awq(dtypes), [time_awq], "awq" in on),
        ("gguf", check_gguf, [time_gguf], "gguf" in on),
        ("gptq", check_gptq, [time_gptq], "gptq" in on),
        ("moe", check_moe, [time_moe], "moe" in on),
        ("fp8", check_fp8, [time_fp8], "fp8" in on),
        ("lora", check_lora, [time_lora], "lora" in on),
        ("tuning", lambda: None, [tune_prefill, tune_decode], args.tune),
    ]
    measure_ceilings()
    for name, check, timings, enabled in families:
        if not enabled:
            continue
        failures = len(FAILURES)
        run_timed(f"{name} checks", check)
        if len(FAILURES) > failures and not args.keep_going:
            print(f"  {name}: not timed, {len(FAILURES) - failures} check(s) failed")
            continue
        for fn in timings:
            run_timed(fn.__name__, fn)
        if args.json:  # after every family: a run cut short keeps what it measured
            write_json(args.json, header, args.update)
    print_table()
    if FAILURES:
        sys.exit(f"FAILED: {FAILURES}")


if __name__ == "__main__":
    main()
