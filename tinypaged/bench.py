"""`tinypaged bench throughput | latency | serve`: the project's benchmarks.

throughput  The offline workload of the design notes: N requests (default 256), prompt lengths
            uniform in [100, 1024] from `random.Random(0)` (length drawn with randint, then that
            many ids with randrange(1000, vocab - 1000)), 256 greedy output tokens each, EOS
            ignored, bf16, random weights in a named shape (or a real checkpoint). Reports output
            and total tok/s and the fraction of the roofline bound:

                t_bound = prefill FLOPs / peak_flops
                        + sum over decode steps (weight bytes + live KV bytes) / copy_bandwidth

            `--baseline hf` runs transformers' paged `generate_batch` on the same requests in the
            same process and prints the ratio.
latency     Single-request decode speed (batch 1 and 8): tok/s per sequence and achieved GB/s.
serve       Poisson arrivals against a running server: TTFT, TPOT, ITL p50/p99, request rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

SHAPES = {
    # Qwen3-0.6B: 28 layers, hidden 1024, 16/8 heads, head_dim 128, vocab 151936, tied.
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024,
        intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
    ),
    # Llama-3-8B: 32 layers, hidden 4096, 32/8 heads, head_dim 128, vocab 128256.
    "llama3-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
    ),
    # Llama-3-70B: 80 layers, hidden 8192, 64/8 heads, head_dim 128, vocab 128256 (TP >= 2).
    "llama3-70b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=8192,
        intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
    ),
    # Qwen3-30B-A3B: 48 layers, hidden 2048, 32/4 heads, head_dim 128, every layer 128 experts
    # top-8 of moe_intermediate 768 (30.5B parameters, 3.3B active per token).
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0,
    ),
}
PEAK_FLOPS = 790e12  # bf16 matmul measured on the H200
COPY_BW = 4.2e12  # device-to-device copy, bytes read + written, measured on the H200


AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
              "version": "gemm"}
GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
               "sym": True, "checkpoint_format": "gptq"}


def shape_dir(shape: str, quantization: str | None = None) -> Path:
    """A model directory holding only config.json for a named shape (used with dummy weights);
    with quantization="awq" / "gptq" the config declares an AutoAWQ / AutoGPTQ int4 checkpoint
    (group 128)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown --model-shape {shape!r}; choose from {', '.join(SHAPES)}")
    path = Path(tempfile.mkdtemp(prefix=f"tinypaged-{shape}-"))
    config = {**SHAPES[shape], "torch_dtype": "bfloat16"}
    if quantization in ("awq", "gptq"):
        config["quantization_config"] = AWQ_CONFIG if quantization == "awq" else GPTQ_CONFIG
    (path / "config.json").write_text(json.dumps(config))
    return path


def sample_requests(num: int, min_len: int, max_len: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        length = rng.randint(min_len, max_len)
        out.append([rng.randrange(1000, vocab - 1000) for _ in range(length)])
    return out


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


def roofline_seconds(cfg: dict, prompt_lens: list[int], output_len: int) -> float:
    """Lower bound on the run: compute-bound prefill plus bandwidth-bound decode steps (all
    sequences decoding together; a MoE step reads only the experts its batch routes to)."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    hd, vocab = cfg["head_dim"], cfg["vocab_size"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    attn = h * hd * (nq + 2 * nkv) + nq * hd * h
    mlp_flop_params, mlp_read_params = _mlp_params(cfg, len(prompt_lens))
    params = layers * (attn + mlp_flop_params) + vocab * h  # LM head; embedding lookups are free
    read_params = layers * (attn + mlp_read_params) + vocab * h
    weight_bytes = 2 * (read_params + (0 if cfg["tie_word_embeddings"] else vocab * h))
    kv_token_bytes = 2 * layers * nkv * hd * 2
    prefill_flops = sum(2 * params * n + 2 * layers * nq * hd * n * n for n in prompt_lens)
    decode_bytes = sum(
        weight_bytes + kv_token_bytes * sum(n + t for n in prompt_lens) for t in range(output_len)
    )
    return prefill_flops / PEAK_FLOPS + decode_bytes / COPY_BW


def _model_args(args) -> tuple[str, dict, dict]:
    if args.model_shape in SHAPES:
        cfg = SHAPES[args.model_shape]
        path = str(shape_dir(args.model_shape, args.quantization))
        extra = dict(load_format="dummy", skip_tokenizer_init=True)
    else:
        path = args.model_shape
        cfg = json.loads((Path(path) / "config.json").read_text())
        cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
        cfg.setdefault("tie_word_embeddings", False)
        cfg.setdefault("num_experts", cfg.get("n_routed_experts", 0))  # GLM-4.5 names it so
        extra = dict(skip_tokenizer_init=True)
    engine = dict(
        dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager,
        gpu_memory_utilization=args.gpu_memory_utilization, quantization=args.quantization,
        tensor_parallel_size=args.tensor_parallel_size,
        disable_custom_all_reduce=args.disable_custom_all_reduce, **extra,
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
    llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(map(len, prompts))
    llm.shutdown()  # tensor-parallel workers free their GPUs now
    # N GPUs at best split every FLOP and every byte N ways.
    gpus = args.tensor_parallel_size
    bound = roofline_seconds(cfg, [len(p) for p in prompts], args.output_len) / gpus
    result = {
        "requests": len(prompts), "tensor_parallel_size": gpus, "elapsed_s": elapsed,
        "output_tokens": out_tokens,
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
    model.generate_batch(inputs=prompts[:8], generation_config=gen)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = model.generate_batch(inputs=prompts, generation_config=gen)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return sum(len(o.generated_tokens) for o in outs.values()) / elapsed


def latency(args) -> dict:
    """Decode speed of `batch` concurrent requests: every step after the first token is timed."""
    import torch

    from tinypaged import LLM, SamplingParams

    path, cfg, engine_args = _model_args(args)
    llm = LLM(path, **engine_args)
    engine = llm.engine
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    kv_token_bytes = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    # Rank 0 holds 1/N of the weights (the few replicated norms are noise at this scale).
    named = list(engine.runner.model.named_parameters())
    weights = sum(p.numel() * p.element_size() for n, p in named if ".experts." not in n)
    experts = sum(p.numel() * p.element_size() for n, p in named if ".experts." in n)
    weights, experts = weights * args.tensor_parallel_size, experts * args.tensor_parallel_size
    gpus = f", all {args.tensor_parallel_size} GPUs" if args.tensor_parallel_size > 1 else ""
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    result = {}
    for batch in args.batch_sizes:
        prompts = sample_requests(batch, args.input_len, args.input_len, cfg["vocab_size"], seed=1)
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        waiting = {f"lat-{batch}-{i}" for i in range(batch)}
        for i, p in enumerate(prompts):
            engine.add_request(f"lat-{batch}-{i}", {"prompt_token_ids": p}, params)
        while waiting:  # prefill until every request has its first token
            waiting -= {out.request_id for out in engine.step()}
        sync()
        steps, start, outs = 0, time.perf_counter(), []
        while engine.has_unfinished_requests():
            outs += engine.step(finished_only=True)
            steps += 1
        sync()
        per_step = (time.perf_counter() - start) / steps
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        if generated != batch * args.output_len:
            raise RuntimeError(f"expected {batch * args.output_len} tokens, got {generated}")
        ctx = args.input_len + args.output_len / 2
        if experts:  # a decode step reads only the experts its batch routes to
            hit = experts_hit(cfg["num_experts"], cfg["num_experts_per_tok"], batch)
            read = weights + experts * hit / cfg["num_experts"]
        else:
            read = weights
        gbs = (read + batch * ctx * kv_token_bytes) / per_step / 1e9
        result[batch] = {"tok_s_per_seq": 1 / per_step, "GB_s": gbs, "steps": steps}
        print(f"batch {batch}: {1 / per_step:,.1f} tok/s per sequence, {batch / per_step:,.0f} "
              f"tok/s total over {steps} decode steps, {gbs:,.0f} GB/s (weights read + KV per step"
              f"{gpus})")
    llm.shutdown()
    return result


async def _serve_one(client, url, model, prompt_len, output_len, vocab_words, rng, stats):
    prompt = " ".join(rng.choice(vocab_words) for _ in range(prompt_len))
    # logprobs=0 makes each chunk list its tokens: one chunk may carry several under load.
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "stream": True,
            "ignore_eos": True, "temperature": 0.0, "logprobs": 0}
    start = time.perf_counter()
    times = []  # one entry per token: the arrival time of the chunk that carried it
    async with client.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                now = time.perf_counter()
                choice = json.loads(line[6:])["choices"][0]
                times += [now] * max(1, len((choice.get("logprobs") or {}).get("tokens") or []))
    stats.append((start, times))


def serve(args) -> dict:
    import httpx
    import numpy as np

    async def run():
        rng = random.Random(0)
        words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "green", "seven"]
        stats: list = []
        async with httpx.AsyncClient(timeout=600) as client:
            model = (await client.get(f"{args.base_url}/v1/models")).json()["data"][0]["id"]
            tasks, start = [], time.perf_counter()
            for _ in range(args.num_prompts):
                tasks.append(asyncio.create_task(_serve_one(
                    client, f"{args.base_url}/v1/completions", model, args.input_len,
                    args.output_len, words, rng, stats)))
                await asyncio.sleep(rng.expovariate(args.request_rate))
            await asyncio.gather(*tasks)
            return stats, time.perf_counter() - start

    stats, elapsed = asyncio.run(run())
    ttft = [t[0] - s for s, t in stats if t]
    itl = [b - a for _, t in stats for a, b in zip(t, t[1:]) if b > a]  # gaps between chunks
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for _, t in stats if len(t) > 1]
    pct = lambda xs, q: 1000 * float(np.percentile(xs, q)) if xs else float("nan")  # noqa: E731
    result = {"requests_per_s": len(stats) / elapsed}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        result[f"{name}_p50_ms"], result[f"{name}_p99_ms"] = pct(xs, 50), pct(xs, 99)
        print(f"{name.upper():5s} p50 {pct(xs, 50):8.1f} ms   p99 {pct(xs, 99):8.1f} ms")
    print(f"request throughput: {result['requests_per_s']:.2f} req/s")
    return result


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
        p.add_argument("--quantization", default=None)
        p.add_argument("--enforce-eager", action="store_true")
        p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
        p.add_argument("--disable-custom-all-reduce", action="store_true")
        p.add_argument("--json", help="also write the result to this file")
    tp = sub.choices["throughput"]
    tp.add_argument("--num-prompts", type=int, default=256)
    tp.add_argument("--min-input-len", type=int, default=100)
    tp.add_argument("--max-input-len", type=int, default=1024)
    tp.add_argument("--baseline", choices=["none", "hf"], default="none")
    lat = sub.choices["latency"]
    lat.add_argument("--input-len", type=int, default=512)
    lat.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    sv = sub.add_parser("serve")
    sv.add_argument("--base-url", default="http://127.0.0.1:8000")
    sv.add_argument("--request-rate", type=float, default=4.0, help="mean arrivals per second")
    sv.add_argument("--num-prompts", type=int, default=64)
    sv.add_argument("--input-len", type=int, default=128)
    sv.add_argument("--output-len", type=int, default=64)
    sv.add_argument("--json", help="also write the result to this file")
    args = parser.parse_args(argv)
    result = {"throughput": throughput, "latency": latency, "serve": serve}[args.mode](args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result
