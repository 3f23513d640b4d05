"""The LoRA shrink / expand kernels at Llama-3-8B sizes, for benchmarks/kernel_bench.py --lora
(checks on the GPU against the torch references, then timings in CUDA graphs).

Every adapted linear of a step runs one shrink (x [T, in] @ A [slot]^T -> h [T, S * R]) and one
expand (y [T, out] += h @ B [slot]^T). With 4 adapters of rank 16 spread over the T tokens, the
least traffic is the A and B matrices of the slots hit plus x, h and y; the FLOPs are
2 T (S R) in and 2 T out R: a few FLOPs per byte, memory-bound at every T.
"""

from __future__ import annotations

import torch

from tinypaged.kernels.lora_expand import lora_expand_ref, lora_expand_triton
from tinypaged.kernels.lora_shrink import (
    lora_segments,
    lora_shrink_ref,
    lora_shrink_triton,
    shrink_splits,
)

SLOTS, RANK = 4, 16
TOKENS = (1, 8, 64, 512, 4096)
# name: (in features, shard output sizes) of Llama-3-8B's adapted linears
LAYERS = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)),
          "gate_up": (4096, (14336, 14336)), "down": (14336, (4096,))}


def case(t: int, layer: str, dtype=torch.bfloat16, seed: int = 0):
    k, sizes = LAYERS[layer]
    g = torch.Generator(device="cuda").manual_seed(seed)
    slots = torch.arange(t, dtype=torch.int32) % SLOTS  # every adapter, round-robin
    meta = [m.cuda() for m in lora_segments(slots, SLOTS)]
    x = torch.randn(t, k, device="cuda", generator=g).to(dtype)
    a = (torch.randn(SLOTS, len(sizes) * RANK, k, device="cuda", generator=g) / k**0.5).to(dtype)
    b = (torch.randn(SLOTS, sum(sizes), RANK, device="cuda", generator=g) * 0.1).to(dtype)
    y = torch.randn(t, sum(sizes), device="cuda", generator=g).to(dtype)
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + s)
    return x, a, b, y, meta, tuple(offsets)


def check() -> bool:
    ok = True
    for t in (1, 37, 512):
        for layer in LAYERS:
            x, a, b, y, meta, offsets = case(t, layer)
            h = torch.zeros(shrink_splits(t, x.shape[1]), t, a.shape[1], device="cuda")
            got = lora_shrink_triton(x, a, *meta, h.clone())
            want = lora_shrink_ref(x, a, *meta, h.clone())
            ok &= torch.allclose(got.sum(0), want.sum(0), atol=3e-2, rtol=2e-2)
            got = lora_expand_triton(y.clone(), want, b, *meta, offsets)
            ok &= torch.allclose(got.float(), lora_expand_ref(y.clone(), want, b, *meta,
                                                             offsets).float(), atol=5e-2,
                                 rtol=2e-2)
            if not ok:
                print(f"  lora mismatch at T={t} {layer}")
                return False
    print("  lora shrink / expand: ok")
    return True


def time_all(record) -> None:
    """`record` is benchmarks/kernel_bench.py's: one row per (op, layer, T)."""
    for t in TOKENS:
        hit = min(SLOTS, t)
        for layer in LAYERS:
            x, a, b, y, meta, offsets = case(t, layer)
            k, n = x.shape[1], a.shape[1]
            out = offsets[-1]
            h = torch.empty(shrink_splits(t, k), t, n, device="cuda")
            shape = f"T{t} {layer} {SLOTS}x r{RANK}"
            record("lora_shrink", shape, "triton graph",
                   [lambda x=x, a=a, meta=meta, h=h: lora_shrink_triton(x, a, *meta, h)],
                   bytes_moved=hit * n * k * 2 + t * k * 2 + h.numel() * 4, flops=2 * t * n * k)
            record("lora_expand", shape, "triton graph",
                   [lambda y=y, h=h, b=b, meta=meta, o=offsets:
                    lora_expand_triton(y, h, b, *meta, o)],
                   bytes_moved=hit * out * RANK * 2 + 2 * t * out * 2 + h.numel() * 4,
                   flops=2 * t * out * RANK)
