"""What programmatic dependent launch (kernels/pdl.py) saves in a decode step: the Llama-3-8B
layer stack at decode batch sizes, attention left out, captured in a CUDA graph twice (PDL on,
PDL off via TINYPAGED_PDL=0) and replayed in turn.

    PYTHONPATH=. python benchmarks/pdl_step.py [--batch 256 64] [--layers 32]

Per layer, as the model runs it: rms_norm (+ residual) -> qkv GEMM -> rotary + KV store ->
o GEMM (on q, standing in for attention's output) -> rms_norm (+ residual) -> gate_up GEMM ->
SiLU-and-mul -> down GEMM. The GEMMs are cuBLAS (they launch as before); the four Triton kernels
after them wait on them through `griddepcontrol.wait` when PDL is on. 8 distinct sets of layer
weights are cycled, so weights come from HBM as in the model. Checks first that both graphs
give bit-identical outputs, then times 20 replays of each, interleaved.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from tinypaged import kernels
from tinypaged.kernels.rotary import build_cos_sin_cache
from tinypaged.model_shapes import SHAPES


def make_layers(cfg: dict, distinct: int) -> list[dict]:
    h, hd, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def w(n, k):
        return torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5

    return [{"qkv": w((nq + 2 * nkv) * hd, h), "o": w(h, nq * hd), "gate_up": w(2 * inter, h),
             "down": w(h, inter), "ln1": torch.ones(h, device="cuda", dtype=torch.bfloat16),
             "ln2": torch.ones(h, device="cuda", dtype=torch.bfloat16)} for _ in range(distinct)]


def layer_stack(x, residual, layers, num_layers, cfg, cache):
    nq, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    for i in range(num_layers):
        p = layers[i % len(layers)]
        h, residual = kernels.rms_norm(x, p["ln1"], eps, residual)
        qkv = F.linear(h, p["qkv"])
        q, k, v = qkv.split([nq * hd, nkv * hd, nkv * hd], dim=-1)
        q = kernels.rotary_store_kv(cache["positions"], q.view(-1, nq, hd), k.view(-1, nkv, hd),
                                    v.view(-1, nkv, hd), cache["k"], cache["v"], cache["slots"],
                                    cache["cos_sin"], hd)
        a = F.linear(q.reshape(q.shape[0], -1), p["o"])
        h, residual = kernels.rms_norm(a, p["ln2"], eps, residual)
        x = F.linear(kernels.silu_and_mul(F.linear(h, p["gate_up"])), p["down"])
    return x, residual


def capture(fn, pdl: bool) -> tuple[torch.cuda.CUDAGraph, tuple]:
    os.environ["TINYPAGED_PDL"] = "1" if pdl else "0"
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 64])
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args()
    cfg = SHAPES[args.model_shape]
    layers = make_layers(cfg, 8)
    h, hd, nkv = cfg["hidden_size"], cfg["head_dim"], cfg["num_key_value_heads"]
    print(f"{torch.cuda.get_device_name()}, {args.model_shape}, {args.layers} layers without "
          f"attention, CUDA graph")
    print("| batch | PDL off ms | PDL on ms | saved us per step | per Triton launch us | same |")
    print("|---|---|---|---|---|---|")
    for batch in args.batch:
        cache = {"positions": torch.arange(batch, device="cuda") + 500,
                 "slots": torch.arange(batch, device="cuda") * 3,
                 "k": torch.zeros(3 * batch // 16 + 1, 16, nkv, hd, device="cuda",
                                  dtype=torch.bfloat16),
                 "cos_sin": build_cos_sin_cache(hd, 2048, 500000.0).cuda()}
        cache["v"] = torch.zeros_like(cache["k"])
        x0 = torch.randn(batch, h, device="cuda", dtype=torch.bfloat16)
        r0 = torch.randn(batch, h, device="cuda", dtype=torch.bfloat16)

        def fn(x0=x0, r0=r0, cache=cache):
            return layer_stack(x0, r0, layers, args.layers, cfg, cache)

        graphs = {pdl: capture(fn, pdl) for pdl in (False, True)}
        for g, _ in graphs.values():
            g.replay()
        torch.cuda.synchronize()
        same = all(torch.equal(a, b) for a, b in zip(graphs[False][1], graphs[True][1]))
        ms = {False: 0.0, True: 0.0}
        for _ in range(20):
            for pdl, (g, _) in graphs.items():
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                g.replay()
                end.record()
                end.synchronize()
                ms[pdl] += start.elapsed_time(end) / 20
        saved = 1e3 * (ms[False] - ms[True])
        print(f"| {batch} | {ms[False]:.3f} | {ms[True]:.3f} | {saved:.1f} | "
              f"{saved / (4 * args.layers):.2f} | {same} |")
    os.environ.pop("TINYPAGED_PDL")


if __name__ == "__main__":
    main()
