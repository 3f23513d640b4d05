"""Host (Python) time of one eager mixed step, per launcher, with every Triton launch stubbed out.

A step that carries a prompt chunk runs eagerly, and on the H200 its host time (~16 ms at ~300
prompt tokens + ~12 decodes, Llama-3-8B shape) exceeds its GPU time (RESULTS.md, session 6). This
script shows where that host time goes outside Triton's own launch path: a 32-layer decoder with
Llama-3-8B's attention shape (32 query / 8 KV heads, head_dim 128) but a tiny hidden size, on the
CPU, under `kernel_choice("triton")` so that every launcher takes its Triton path, and with each
`kernel[grid](...)` replaced by a no-op. What is timed is what our launchers do around the launch
(argument checks, strides, config dicts, allocations) plus the torch ops of the glue; F.linear
is stubbed the same way (it returns an empty output; on the GPU its host cost is a cuBLAS launch,
~5-10 us, not measured here). Not measured here either:
Triton's own `JITFunction.run` (binding, specialization key, driver launch; on the GPU a few tens
of us per launch) and, on Hopper, the TMA descriptor encode per launch (driver.make_tensordesc_arg);
the TensorDescriptor objects the Hopper launcher builds are timed apart.

    PYTHONPATH=. python benchmarks/mixed_host.py [--prompt 300] [--decodes 12] [--repeats 20]

Prints us per step for the step's metadata, per layer per launcher, and the forward's total.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from types import SimpleNamespace

import torch
from transformers import LlamaConfig

from tinypaged import kernels
from tinypaged.kernels import _triton, dense_gemv
from tinypaged.kernels.attention_hopper import _kv_operand
from tinypaged.models import decoder
from tinypaged.models.attention_metadata import AttentionMetadata
from tinypaged.models.llama import LlamaForCausalLM
from tinypaged.scheduler import ScheduledSequence, Sequence
from tinypaged.worker.input_batch import HostBlockTables, build_step

NUM_LAYERS, BLOCK_SIZE = 32, 16
LAUNCHERS = ("rms_norm", "rotary_store_kv", "paged_attention", "silu_and_mul")


def tiny_llama3_8b_attention() -> LlamaForCausalLM:
    """Llama-3-8B's layer count and attention heads; hidden 64 keeps the weights tiny."""
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=NUM_LAYERS,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         vocab_size=256, max_position_embeddings=4096)
    return LlamaForCausalLM(config).eval()


def mixed_batch(prompt: int, decodes: int, context: int) -> list[ScheduledSequence]:
    """`decodes` sequences with `context` cached tokens each plus one new prompt chunk."""
    scheduled, next_block = [], 0
    for i in range(decodes + 1):
        cached, new = (context, 1) if i < decodes else (0, prompt)
        seq = Sequence(f"r{i}", [7] * (cached + new))
        blocks = -(-(cached + new) // BLOCK_SIZE)
        seq.block_table = list(range(next_block, next_block + blocks))
        next_block += blocks
        scheduled.append(ScheduledSequence(seq, new, cached, sample=True))
    return scheduled


def timed(name: str, fn, totals: dict, calls: dict):
    def wrapper(*args, **kwargs):
        start = time.perf_counter_ns()
        out = fn(*args, **kwargs)
        totals[name] += time.perf_counter_ns() - start
        calls[name] += 1
        return out
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=300)
    parser.add_argument("--decodes", type=int, default=12)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from triton.runtime.interpreter import InterpretedFunction

    totals: dict[str, int] = defaultdict(int)
    calls: dict[str, int] = defaultdict(int)

    def no_launch(*args, **kwargs) -> None:
        calls["Triton launches (stubbed)"] += 1

    InterpretedFunction.__getitem__ = lambda self, grid: no_launch
    for name in LAUNCHERS:
        setattr(kernels, name, timed(name, getattr(kernels, name), totals, calls))
    dense_gemv.dense_linear = timed("linear (dense_linear)", dense_gemv.dense_linear, totals,
                                   calls)
    # the GEMM itself stubbed too: an output of the right shape, as a launched cuBLAS call gives
    dense_gemv.F = SimpleNamespace(linear=lambda x, w, b=None: x.new_empty(x.shape[0], w.shape[0]))
    decoder.ACTIVATIONS["silu"] = kernels.silu_and_mul
    model = tiny_llama3_8b_attention()
    scheduled = mixed_batch(args.prompt, args.decodes, args.context)
    num_blocks = sum(len(s.seq.block_table) for s in scheduled)
    for layer in model.modules():
        if isinstance(layer, decoder.Attention):
            shape = (num_blocks, BLOCK_SIZE, layer.num_kv_heads, layer.head_dim)
            layer.k_cache, layer.v_cache = torch.zeros(shape), torch.zeros(shape)
    tables = HostBlockTables(len(scheduled), 64)

    def one_step() -> None:
        start = time.perf_counter_ns()
        step = build_step(scheduled, BLOCK_SIZE, tables)
        to = torch.from_numpy
        md = AttentionMetadata(to(step.slot_mapping), to(step.query_start_loc),
                               to(step.seq_lens), to(step.block_tables), step.max_query_len,
                               step.max_seq_len)
        totals["step metadata (build_step + tensors)"] += time.perf_counter_ns() - start
        start = time.perf_counter_ns()
        model(to(step.input_ids), to(step.positions), md)
        totals["forward"] += time.perf_counter_ns() - start

    with torch.inference_mode(), _triton.kernel_choice("triton"):
        one_step()  # warm-up
        totals.clear()
        calls.clear()
        for _ in range(args.repeats):
            one_step()
        cache = model.model.layers[0].self_attn.attn.k_cache.to(torch.float16)
        start = time.perf_counter_ns()
        for _ in range(args.repeats * NUM_LAYERS):
            _kv_operand(cache, True, 64)
            _kv_operand(cache, True, 64)
        totals["TensorDescriptor x2 (Hopper, not in forward)"] = time.perf_counter_ns() - start

    launches = calls["Triton launches (stubbed)"] / args.repeats
    if launches != 5 * NUM_LAYERS + 1:  # 2 norms, rotary + store, attention, SiLU; final norm
        raise SystemExit(f"expected {5 * NUM_LAYERS + 1} Triton launches a step, saw {launches}: "
                         "a launcher took its torch reference, the timings would not be theirs")
    per_step = {k: v / args.repeats / 1e3 for k, v in totals.items()}
    launched = sum(per_step[k] for k in (*LAUNCHERS, "linear (dense_linear)"))
    per_step["glue (forward - launchers)"] = per_step["forward"] - launched
    print(f"mixed step: {args.prompt} prompt tokens + {args.decodes} decodes, {NUM_LAYERS} "
          "layers, Triton launches stubbed, CPU")
    print(f"{'what':46s} {'us/step':>9s} {'us/layer':>9s} {'calls/layer':>11s} {'us/call':>8s}")
    for name, us in per_step.items():
        n = calls.get(name, 0) / args.repeats / NUM_LAYERS
        per_call = f"{us / NUM_LAYERS / n:8.2f}" if n else ""
        print(f"{name:46s} {us:9.1f} {us / NUM_LAYERS:9.2f} {n or '':>11} {per_call}")
    print(json.dumps({k: round(v, 1) for k, v in per_step.items()}))


if __name__ == "__main__":
    main()
