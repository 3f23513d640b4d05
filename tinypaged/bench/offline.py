"""`tinypaged bench throughput | latency | serve`: the project's benchmarks.

throughput  The offline workload of the design notes: N requests (default 256), prompt lengths
            uniform in [100, 1024] from `random.Random(0)` (length drawn with randint, then that
            many ids with randrange(1000, vocab - 1000)), 256 greedy output tokens each, EOS
            ignored, bf16, random weights in a named shape (or a real checkpoint). Reports output
            and total tok/s and the fraction of the roofline bound:

                t_bound = prefill FLOPs / peak_flops
                        + sum over decode steps (weight bytes + live KV bytes) / copy_bandwidth

            The warm-up runs 8 prompts of their own (seed 1), so no measured prompt is in the
            prefix cache when the timed run starts (`cached_prompt_tokens` in the result says).
            `--baseline hf` runs transformers' paged `generate_batch` on the same requests in the
            same process and prints the ratio.
latency     Decode speed of 1 and 8 concurrent requests through the EngineClient (AsyncLLM, as
            the server sees the engine): tok/s per sequence and achieved GB/s.
serve       Poisson arrivals against any OpenAI-compatible server (`vllm serve` too): TTFT, TPOT,
            ITL, request and token throughput (serve.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tinypaged.bench import serve as bench_serve
from tinypaged.bench.model_shapes import DUMMY_QUANT_CONFIGS, SHAPES, shape_dir
from tinypaged.config import CUDAGRAPH_MODES
from tinypaged.quantization.registry import QUANTIZATION_FORMATS

if TYPE_CHECKING:
    from tinypaged.engine.client import EngineClient

PEAK_FLOPS = 790e12  # bf16 matmul measured on the H200
COPY_BW = 4.2e12  # device-to-device copy, bytes read + written, measured on the H200


def sample_requests(num: int, min_len: int, max_len: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        length = rng.randint(min_len, max_len)
        out.append([rng.randrange(1000, vocab - 1000) for _ in range(length)])
    return out


def warmup_requests(min_len: int, max_len: int, vocab: int) -> list[list[int]]:
    """8 warm-up prompts drawn with seed 1, as the vLLM anchor kit does: none is a measured
    prompt (seed 0), so no measured prompt finds its blocks in the prefix cache."""
    return sample_requests(8, min_len, max_len, vocab, seed=1)


def experts_hit(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Expected distinct experts a batch of `num_tokens` tokens routes to (uniform routing)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** num_tokens)


def _mlp_params(cfg: dict, num_tokens: int) -> tuple[float, float]:
    """(weights each token multiplies by, weights a step of `num_tokens` tokens reads) of one
    layer's MLP: all of a dense MLP; for a MoE layer the router plus k experts per token, and
    the experts the batch hits (every MoE layer is taken sparse, as in Qwen3-MoE)."""
    h = cfg["hidden_size"]
    num_experts = cfg.get("num_experts", 0)
    if not num_experts:
        dense = 3 * h * cfg["intermediate_size"]
        return dense, dense
    per_expert, top_k = 3 * h * cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
    router = h * num_experts
    read = experts_hit(num_experts, top_k, num_tokens) * per_expert
    return router + top_k * per_expert, router + read


# Bytes per weight of an int4 linear, group 128: 4 bits, plus an fp16 scale and a 4-bit zero point
# per group. Embeddings, the LM head and norms stay in 16 bits.
INT4_G128_BYTES = 0.5 + (2 + 0.5) / 128


def _attn_params(cfg: dict) -> int:
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    return h * hd * (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) + (
        cfg["num_attention_heads"] * hd * h
    )


def weight_bytes(cfg: dict, num_tokens: int, quantization: str | None = None,
                 model_dir: str | None = None) -> float:
    """Bytes of weights a decode step of `num_tokens` tokens reads: every linear of every layer
    (of a MoE layer only the experts the batch hits), the LM head and, untied, the embedding
    table; 2 bytes per weight, or INT4_G128_BYTES for the linears of an AWQ / GPTQ checkpoint.
    A GGUF model (model_dir converted from a .gguf) reads its tensors' packed bytes."""
    if model_dir is not None:
        from tinypaged.models.gguf_file import packed_weight_bytes

        packed = packed_weight_bytes(model_dir)
        if packed is not None:
            return packed
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    linear = cfg["num_hidden_layers"] * (_attn_params(cfg) + _mlp_params(cfg, num_tokens)[1])
    per_linear = INT4_G128_BYTES if quantization in DUMMY_QUANT_CONFIGS else 2
    per_linear = 1 if quantization == "fp8" else per_linear  # FP8 weights: one byte each
    tables = vocab * h * (1 if cfg["tie_word_embeddings"] else 2)
    return linear * per_linear + 2 * tables


def roofline_seconds(
    cfg: dict, prompt_lens: list[int], output_len: int, quantization: str | None = None
) -> float:
    """Lower bound on the run: compute-bound prefill plus bandwidth-bound decode steps (all
    sequences decoding together; a MoE step reads only the experts its batch routes to)."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    hd, vocab, nq = cfg["head_dim"], cfg["vocab_size"], cfg["num_attention_heads"]
    mlp_flop_params = _mlp_params(cfg, len(prompt_lens))[0]
    params = layers * (_attn_params(cfg) + mlp_flop_params) + vocab * h  # embedding: lookups
    step_bytes = weight_bytes(cfg, len(prompt_lens), quantization)
    kv_token_bytes = 2 * layers * cfg["num_key_value_heads"] * hd * 2
    prefill_flops = sum(2 * params * n + 2 * layers * nq * hd * n * n for n in prompt_lens)
    decode_bytes = sum(
        step_bytes + kv_token_bytes * sum(n + t for n in prompt_lens) for t in range(output_len)
    )
    return prefill_flops / PEAK_FLOPS + decode_bytes / COPY_BW


def _model_args(args) -> tuple[str, dict, dict]:
    if args.model_shape in SHAPES:
        cfg = SHAPES[args.model_shape]
        path = str(shape_dir(args.model_shape, args.quantization))
        extra = dict(load_format="dummy", skip_tokenizer_init=True)
    else:
        path = args.model_shape
        if path.endswith(".gguf"):  # its converted directory (made once, cached)
            from tinypaged.models.loader import resolve_model

            path = str(resolve_model(path))
        cfg = json.loads((Path(path) / "config.json").read_text())
        cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
        cfg.setdefault("tie_word_embeddings", False)
        cfg.setdefault("num_experts", cfg.get("n_routed_experts", 0))  # GLM-4.5 names it so
        extra = dict(skip_tokenizer_init=True)
    engine = dict(
        dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager,
        cudagraph_mode=args.cudagraph_mode, async_scheduling=args.async_scheduling,
        gpu_memory_utilization=args.gpu_memory_utilization, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
        disable_custom_all_reduce=args.disable_custom_all_reduce, cpu_threads=args.cpu_threads,
        **extra,
    )
    return path, cfg, engine


def throughput(args) -> dict:
    from tinypaged import LLM, SamplingParams

    path, cfg, engine_args = _model_args(args)
    prompts = sample_requests(
        args.num_prompts, args.min_input_len, args.max_input_len, cfg["vocab_size"]
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm = LLM(path, **engine_args)
    # Warm up (compile the kernels, capture the graphs) on prompts of their own: warming up on
    # measured ones would leave them in the prefix cache and flatter the timed run.
    warmup = warmup_requests(args.min_input_len, args.max_input_len, cfg["vocab_size"])
    llm.generate([{"prompt_token_ids": p} for p in warmup], params, use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs)
    in_tokens = sum(map(len, prompts))
    llm.shutdown()  # tensor-parallel workers free their GPUs now
    # N GPUs at best split every FLOP and every byte N ways.
    gpus = args.tensor_parallel_size
    bound = roofline_seconds(cfg, [len(p) for p in prompts], args.output_len,
                             args.quantization) / gpus
    result = {
        "requests": len(prompts), "tensor_parallel_size": gpus, "elapsed_s": elapsed,
        "output_tokens": out_tokens, "cached_prompt_tokens": cached,
        "output_tok_s": out_tokens / elapsed, "total_tok_s": (in_tokens + out_tokens) / elapsed,
        "roofline_output_tok_s": out_tokens / bound, "roofline_fraction": bound / elapsed,
    }
    print(f"tinypaged: {result['output_tok_s']:,.0f} output tok/s, {result['total_tok_s']:,.0f} "
          f"total tok/s in {elapsed:.2f} s; roofline bound {result['roofline_output_tok_s']:,.0f} "
          f"output tok/s ({100 * result['roofline_fraction']:.1f}% of it"
          f"{f' for {gpus} GPUs' if gpus > 1 else ''})")
    if args.baseline == "hf":
        del llm
        result["hf_output_tok_s"] = hf_generate_batch(path, cfg, prompts, args.output_len)
        ratio = result["output_tok_s"] / result["hf_output_tok_s"]
        result["ratio_vs_hf"] = ratio
        print(f"HF generate_batch: {result['hf_output_tok_s']:,.0f} output tok/s; "
              f"tinypaged is {ratio:.1f}x")
    return result


def hf_generate_batch(path: str, cfg: dict, prompts: list[list[int]], output_len: int) -> float:
    """transformers' paged continuous batching on the same requests, random weights, bf16."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    hf_cfg = AutoConfig.from_pretrained(path)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            hf_cfg, torch_dtype=torch.bfloat16, attn_implementation="paged|sdpa"
        ).eval()
    gen = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=None,
                           pad_token_id=0, use_cuda_graph=False)
    warmup = warmup_requests(100, 1024, cfg["vocab_size"])
    model.generate_batch(inputs=warmup, generation_config=gen)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = model.generate_batch(inputs=prompts, generation_config=gen)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return sum(len(o.generated_tokens) for o in outs.values()) / elapsed


def latency(args) -> dict:
    """Decode speed of `batch` concurrent requests, measured through the EngineClient (the
    server's view of the engine): per request, the tokens after its first output over the time
    they took to arrive."""
    from tinypaged import AsyncLLM

    if args.output_len < 2:
        raise ValueError(f"--output-len must be >= 2 to time decode steps, got {args.output_len}")
    path, cfg, engine_args = _model_args(args)
    spec = getattr(args, "speculative_config", None)
    if spec is not None:
        return _spec_latency(args, path, cfg, engine_args, json.loads(spec))
    engine = AsyncLLM(path, **engine_args)
    try:
        return asyncio.run(_latency(engine, cfg, args, path))
    finally:
        asyncio.run(engine.shutdown())  # tensor-parallel workers free their GPUs now


def _spec_latency(args, path: str, cfg: dict, engine_args: dict, spec: dict) -> dict:
    """`latency --speculative-config JSON`: the engine without speculation first (its greedy
    continuations become the table of the "oracle" / "oracle_miss" proposers), then with it;
    prints the speed-up per batch size."""
    from tinypaged import AsyncLLM

    engine = AsyncLLM(path, **engine_args)
    try:
        base = asyncio.run(_latency(engine, cfg, args, path))
        if spec.get("method", "").startswith("oracle"):
            prompts = [p for b in args.batch_sizes
                       for p in sample_requests(b, args.input_len, args.input_len,
                                                cfg["vocab_size"], seed=1)]
            spans = asyncio.run(_record(engine, prompts, args.output_len))
            spec = {**spec, "oracle_token_ids": [[p, c] for p, c in zip(prompts, spans)]}
    finally:
        asyncio.run(engine.shutdown())
        del engine
    engine = AsyncLLM(path, **{**engine_args, "speculative_config": spec})
    try:
        print(f"speculative decoding: {spec.get('method')}, k={spec['num_speculative_tokens']}")
        ours = asyncio.run(_latency(engine, cfg, args, path))
        stats = engine.get_stats().get("spec_decode") or {}
    finally:
        asyncio.run(engine.shutdown())
    result = {"baseline": base, "speculative": ours, "spec_decode": stats}
    for b in args.batch_sizes:
        ratio = ours[b]["tok_s_per_seq"] / base[b]["tok_s_per_seq"]
        print(f"batch {b}: {ratio:.2f}x the tok/s of no speculation")
        result[f"speedup_batch_{b}"] = ratio
    rate = stats.get("num_accepted_tokens", 0) / max(stats.get("num_draft_tokens", 0), 1)
    print(f"acceptance rate {100 * rate:.1f}% over {stats.get('num_draft_tokens', 0)} drafts")
    return result


async def _record(engine: EngineClient, prompts: list[list[int]], output_len: int):
    """The greedy continuation (output_len tokens, EOS ignored) of each prompt."""
    from tinypaged import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> list[int]:
        last = None
        async for out in engine.generate({"prompt_token_ids": prompt}, params, f"rec-{i}"):
            last = out
        return list(last.outputs[0].token_ids)

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


async def _latency(engine: EngineClient, cfg: dict, args, path: str) -> dict:
    kv_token_bytes = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    gpus = f", all {args.tensor_parallel_size} GPUs" if args.tensor_parallel_size > 1 else ""
    result = {}
    for batch in args.batch_sizes:
        prompts = sample_requests(batch, args.input_len, args.input_len, cfg["vocab_size"], seed=1)
        await _decode(engine, prompts, 8, f"warm-{batch}")
        spans = await _decode(engine, prompts, args.output_len, f"lat-{batch}")
        generated = sum(n for _, (_, n) in spans)
        if generated != batch * args.output_len:
            raise RuntimeError(f"expected {batch * args.output_len} tokens, got {generated}")
        # One decode step per token after the first output of each request.
        per_step = sum((t1 - t0) / (n1 - n0) for (t0, n0), (t1, n1) in spans) / batch
        ctx = args.input_len + args.output_len / 2
        gbs = (weight_bytes(cfg, batch, args.quantization, path) + batch * ctx * kv_token_bytes)
        gbs = gbs / per_step / 1e9
        tokens = sum(n1 - n0 for (_, n0), (_, n1) in spans)
        result[batch] = {"tok_s_per_seq": 1 / per_step, "GB_s": gbs, "decode_tokens": tokens}
        print(f"batch {batch}: {1 / per_step:,.1f} tok/s per sequence, {batch / per_step:,.0f} "
              f"tok/s total over {tokens} decoded tokens, {gbs:,.0f} GB/s (weights read + KV per "
              f"step{gpus})")
    return result


async def _decode(
    engine: EngineClient, prompts: list[list[int]], output_len: int, tag: str
) -> list[tuple[tuple[float, int], tuple[float, int]]]:
    """Run `prompts` together, greedy, EOS ignored; per request (time, tokens) at its first
    output and at its last."""
    from tinypaged import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)

    async def one(i: int, prompt: list[int]):
        first = last = None
        async for out in engine.generate({"prompt_token_ids": prompt}, params, f"{tag}-{i}"):
            last = (time.perf_counter(), len(out.outputs[0].token_ids))
            first = first or last
        return first, last

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="tinypaged bench", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    for name in ("throughput", "latency"):
        p = sub.add_parser(name)
        p.add_argument("--model-shape", default="qwen3-0.6b",
                       help="qwen3-0.6b | llama3-8b | llama3-70b | qwen3-30b-a3b | PATH")
        p.add_argument("--dtype", default="bfloat16")
        p.add_argument("--output-len", type=int, default=256)
        p.add_argument("--max-model-len", type=int, default=2048)
        p.add_argument("--max-num-seqs", type=int, default=256)
        # vLLM's defaults in the baseline runs: 16384 batched tokens.
        p.add_argument("--max-num-batched-tokens", type=int, default=16384)
        p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
        p.add_argument("--quantization", default=None, choices=list(QUANTIZATION_FORMATS))
        p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"])
        p.add_argument("--enforce-eager", action="store_true")
        p.add_argument("--cudagraph-mode", default="FULL_AND_PIECEWISE",
                       choices=list(CUDAGRAPH_MODES))
        p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
        p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
        p.add_argument("--disable-custom-all-reduce", action="store_true")
        p.add_argument("--data-parallel-size", "-dp", type=int, default=1)
        p.add_argument("--cpu-threads", type=int, default=None, help="torch's CPU threads")
        p.add_argument("--json", help="also write the result to this file")
    tp = sub.choices["throughput"]
    tp.add_argument("--num-prompts", type=int, default=256)
    tp.add_argument("--min-input-len", type=int, default=100)
    tp.add_argument("--max-input-len", type=int, default=1024)
    tp.add_argument("--baseline", choices=["none", "hf"], default="none")
    lat = sub.choices["latency"]
    lat.add_argument("--input-len", type=int, default=512)
    lat.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    lat.add_argument("--speculative-config", default=None, metavar="JSON",
                     help="also run with speculative decoding and print the speed-up; methods "
                          "oracle / oracle_miss take the first run's greedy output as drafts")
    bench_serve.add_arguments(sub.add_parser("serve", help=bench_serve.__doc__.split("\n")[0]))
    args = parser.parse_args(argv)
    if args.mode == "serve":
        return bench_serve.main(args)
    result = {"throughput": throughput, "latency": latency}[args.mode](args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result
