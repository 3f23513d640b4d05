"""GPTQ linears on the GPU: correctness against the format's torch reference, then decode-sized
timings at the Llama-3-8B shapes beside AWQ (the same kernels after the load-time repack) and bf16.

    PYTHONPATH=. python benchmarks/gptq.py

End to end (dummy weights, the same harness as the AWQ row of RESULTS.md):
    PYTHONPATH=. python -m tinypaged bench latency --model-shape llama3-8b --batch-sizes 1 8
    PYTHONPATH=. python -m tinypaged bench latency --model-shape llama3-8b --batch-sizes 1 8 \
        --quantization awq
    PYTHONPATH=. python -m tinypaged bench latency --model-shape llama3-8b --batch-sizes 1 8 \
        --quantization gptq
"""

from __future__ import annotations

import copy
import json

import torch
from awq_gemv import L2_BYTES, SHAPES, graph_us
from torch import nn

from tinypaged.kernels._triton import cdiv
from tinypaged.kernels.gptq_format import gptq_dequantize_reference, pack_gptq
from tinypaged.models.gptq import GPTQConfig

VARIANTS = [("int4 g128", 4, 128, False), ("int4 g128 act-order", 4, 128, True),
            ("int4 per-channel", 4, -1, False), ("int8 g128", 8, 128, False)]


def gptq_layer(K, N, bits, group_size, act_order, seed=0):
    """(layer ready for GPTQConfig.apply, W [K, N] fp32 from the format's reference)."""
    gen = torch.Generator().manual_seed(seed)
    G = K if group_size == -1 else group_size
    order = torch.randperm(K, generator=gen) if act_order else torch.arange(K)
    g_idx = torch.empty(K, dtype=torch.int32)
    g_idx[order] = (torch.arange(K) // G).int()
    top = 2**bits - 1
    packed = pack_gptq(torch.randint(0, top + 1, (K, N), generator=gen),
                       torch.randint(0, top + 1, (K // G, N), generator=gen),
                       torch.rand(K // G, N, generator=gen) * 0.01 + 0.001, g_idx, bits, 1)
    method = GPTQConfig(bits, group_size, act_order, 1)
    layer = nn.Module()
    method.create_weights(layer, K, N, torch.bfloat16)
    for name, t in packed.items():
        getattr(layer, name).data.copy_(t)
    layer.cuda()
    method.process_weights_after_loading(layer)
    w = gptq_dequantize_reference(*packed.values(), bits, 1).cuda()
    return method, layer, w


def time_layer(method, layer, dense, bits) -> dict:
    """Graph-replayed microseconds per call at M = 1 and 8, cycling through enough copies of the
    weights that they come from HBM, not L2 (as benchmarks/awq_gemv.py)."""
    K, N = dense.shape
    copies = max(2, cdiv(3 * L2_BYTES, K * N * bits // 8))
    layers = [layer] + [copy.deepcopy(layer) for _ in range(copies - 1)]
    denses = [dense] + [dense.clone() for _ in range(max(2, cdiv(3 * L2_BYTES, 2 * K * N)) - 1)]
    out = {}
    for M in (1, 8):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        out[f"gptq M={M} us"] = round(graph_us(
            [lambda lay=lay, x=x: method.apply(lay, x, None) for lay in layers]), 1)
        out[f"bf16 M={M} us"] = round(graph_us([lambda d=d, x=x: x @ d for d in denses]), 1)
    return out


def main() -> None:
    rows = []
    for K, N, name in SHAPES:
        for label, bits, group_size, act_order in VARIANTS:
            method, layer, w = gptq_layer(K, N, bits, group_size, act_order)
            for M in (1, 8, 300):
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                y = method.apply(layer, x, None).float()
                ref = x.float() @ w
                err = (y - ref).abs().max().item() / ref.abs().max().item()
                assert err < 2e-2, f"{name} {label} M={M}: relative error {err:.3g}"
            timing = {"shape": f"{name} {K}x{N}", "variant": label,
                      **time_layer(method, layer, w.to(torch.bfloat16), bits)}
            rows.append(timing)
            print(json.dumps(timing), flush=True)
            del layer, w
            torch.cuda.empty_cache()
    print("all checks passed (M = 1, 8, 300 against the format's torch reference)")
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()
