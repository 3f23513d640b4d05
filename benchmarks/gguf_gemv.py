"""GGUF block-quantized GEMV on the GPU beside the bf16 linear and the AWQ GEMV, then batch-1
decode of a Llama-3-8B-shape model with Q4_K_M-like weights beside bf16.

1. Kernels, Llama-3-8B layer shapes: each GGML type's GEMV (M = 1 and 8) and the prefill path
   (dequantize + cuBLAS, M = 512) are checked against the torch reference of the block layout,
   then timed in CUDA graphs over weight copies larger than L2 (awq_gemv.graph_us).
2. Tokens: a small random llama with Q4_K_M-like weights generates greedily through the engine
   twice, with the blocks kept (GEMV / dequantize kernels) and with the same weights dequantized
   to dense bf16 at load; the tokens must agree.
3. Decode: `tinypaged bench latency` (512 prompt tokens, 256 out, batch 1 and 8) on the
   Llama-3-8B shape, bf16 (dummy weights) and Q4_K_M-like GGUF blocks (random bytes, finite
   scales: Q4_K everywhere, Q6_K for the LM head and for attn_v / ffn_down of the layers
   llama.cpp's Q4_K_M gives more bits), CUDA graphs on.

    PYTHONPATH=. python benchmarks/gguf_gemv.py            # all three, ~5 minutes
    PYTHONPATH=. python benchmarks/gguf_gemv.py --sweep    # also BLOCK_N / warps per type
"""
import argparse
import itertools
import json
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from awq_gemv import L2_BYTES, awq_weights, copy_bandwidth, gemv, graph_us

from tinypaged import bench
from tinypaged.kernels import gguf
from tinypaged.kernels._triton import cdiv
from tinypaged.kernels.gguf_format import GGML_TYPES, gguf_dequantize_reference, row_bytes
from tinypaged.models import gguf_layers, loader

SHAPES = [(4096, 6144, "qkv"), (4096, 4096, "o"), (4096, 28672, "gate_up"), (14336, 4096, "down"),
          (4096, 128256, "lm_head")]
TYPES = {"Q4_K": 12, "Q6_K": 14, "Q5_K": 13, "Q8_0": 8, "Q4_0": 2, "Q4_1": 3}
FP16_FIELDS = {2: (0,), 3: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}
SCALE = {2: 5e-3, 3: 5e-3, 8: 5e-4, 12: 4e-4, 13: 2e-4, 14: 6e-5}  # weights of ~0.05


def random_qweight(type_id: int, N: int, K: int) -> torch.Tensor:
    """uint8 [N, row_bytes] on the GPU: random quants, fp16 fields in [0, SCALE)."""
    t = GGML_TYPES[type_id]
    nb = K // t.block_elems
    blocks = torch.randint(0, 256, (N, nb, t.block_bytes), dtype=torch.uint8, device="cuda")
    for off in FP16_FIELDS[type_id]:
        field = (torch.rand(N, nb, 1, device="cuda") * SCALE[type_id]).half()
        blocks[..., off : off + 2] = field.view(torch.uint8)
    return blocks.reshape(N, -1)


def check(x, qweight, type_id, **config):
    ref = x.float() @ gguf_dequantize_reference(qweight, type_id, x.shape[1]).T
    y = gguf.gguf_gemv(x, qweight, type_id, **config) if x.shape[0] <= gguf.GEMV_MAX_M \
        else gguf.gguf_linear(x, qweight, type_id)
    err = ((y.float() - ref).norm() / ref.norm()).item()
    assert torch.isfinite(y).all() and err < 1e-2, (type_id, config, err)
    return err


def kernels(args):
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    rows = []
    for (K, N, name), (tname, type_id), M in itertools.product(SHAPES, TYPES.items(), args.m):
        if name == "lm_head" and tname not in ("Q6_K", "Q8_0"):
            continue
        nbytes = N * row_bytes(type_id, K)
        copies = max(2, cdiv(3 * L2_BYTES, nbytes))
        weights = [random_qweight(type_id, N, K) for _ in range(copies)]
        x = torch.randn(M, K, device="cuda").bfloat16()
        dense = [torch.randn(N, K, device="cuda").bfloat16()
                 for _ in range(max(2, cdiv(3 * L2_BYTES, 2 * N * K)))]
        base = graph_us([lambda w=w, x=x: F.linear(x, w) for w in dense], reps=20)
        awq_t = "-"
        if M <= 16 and name != "lm_head" and tname == "Q4_K":
            aw = awq_weights(K, N, max(2, cdiv(3 * L2_BYTES, K * N // 2)))
            awq_t = f"{graph_us([lambda w=w, x=x: gemv(x, w) for w in aw], reps=20):.1f}"
            del aw
        configs = [{}]
        if args.sweep and M <= gguf.GEMV_MAX_M:
            configs += [dict(block_n=b, num_warps=w) for b, w in
                        itertools.product((2, 4, 8, 16, 32), (2, 4, 8))]
        for config in configs:
            err = check(x, weights[0], type_id, **config)
            fn = (lambda w, x=x, c=config, t=type_id: gguf.gguf_gemv(x, w, t, **c)) \
                if M <= gguf.GEMV_MAX_M else (lambda w, x=x, t=type_id: gguf.gguf_linear(x, w, t))
            t = graph_us([lambda w=w, fn=fn: fn(w) for w in weights], reps=20)
            rows.append((name, K, N, tname, M, config or "default", base, awq_t, t, err,
                         nbytes / t / 1e3))
            print(f"{name} {K}x{N} {tname} M={M} {config or 'default'}: bf16 {base:.1f} us, "
                  f"AWQ {awq_t} us, GGUF {t:.1f} us ({nbytes / t / 1e3:.0f} GB/s), "
                  f"err {err:.1e}", flush=True)
        del weights, dense
    print("\n| layer | K x N | type | M | bf16 (us) | AWQ g128 (us) | GGUF (us) | vs bf16 | "
          "GGUF GB/s | rel. error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    best = {}
    for name, K, N, tname, M, config, base, awq_t, t, err, gbs in rows:
        key = (name, tname, M)
        if key not in best or t < best[key][0]:
            best[key] = (t, config)
        if config == "default":
            print(f"| {name} | {K}x{N} | {tname} | {M} | {base:.1f} | {awq_t} | {t:.1f} | "
                  f"{base / t:.2f}x | {gbs:.0f} | {err:.1e} |")
    if args.sweep:
        for key, (t, config) in best.items():
            print(f"best {key}: {t:.1f} us {config}")


def q4_k_m_type(name: str, num_layers: int) -> int:
    """llama.cpp's Q4_K_M choice, roughly: Q6_K for the LM head and for attn_v / ffn_down of the
    first and last eighth of the layers and every third layer between, Q4_K elsewhere."""
    if name == "lm_head.weight":
        return 14
    if ".v_proj." in name or ".down_proj." in name:
        i = int(name.split(".")[2])
        eighth = num_layers // 8
        more_bits = i < eighth or i >= 7 * eighth or (i - eighth) % 3 == 2
        return 14 if more_bits else 12
    return 12


def random_gguf_weights(cfg: dict, dequantize: bool = False):
    """What gguf_weights yields for a model of config `cfg`, with random Q4_K_M-like blocks."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter)})
    gen = torch.Generator(device="cuda").manual_seed(0)
    torch.manual_seed(0)
    for name, (N, K) in shapes.items():
        type_id = q4_k_m_type(name, layers)
        data = random_qweight(type_id, N, K)
        if dequantize:
            yield name, gguf.gguf_dequantize(data, type_id, K, torch.bfloat16).float()
        else:
            yield name, gguf_layers.GGUFWeight(type_id, data, (N, K))
    for i in range(layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            yield f"model.layers.{i}.{norm}.weight", 1 + 0.1 * torch.rand(h, generator=gen,
                                                                          device="cuda")
    yield "model.norm.weight", torch.ones(h, device="cuda")


def gguf_model_dir(cfg: dict, quantized: bool) -> str:
    path = Path(tempfile.mkdtemp(prefix="tinypaged-gguf-bench-"))
    config = {**cfg, "torch_dtype": "bfloat16"}
    if quantized:
        config["quantization_config"] = {"quant_method": "gguf"}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def patched_weights(cfg: dict, dequantize: bool = False):
    loader.iterate_weights = lambda model_dir, sliced=False: random_gguf_weights(cfg, dequantize)


def same_tokens():
    from tinypaged import LLM, SamplingParams

    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=1024,
               intermediate_size=2048, num_hidden_layers=4, num_attention_heads=16,
               num_key_value_heads=4, head_dim=64, vocab_size=4096, tie_word_embeddings=False,
               max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0)
    prompts = [{"prompt_token_ids": [(i * 37 + j * 11) % 4000 + 5 for j in range(40 + 30 * i)]}
               for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = []
    for quantized in (True, False):
        patched_weights(cfg, dequantize=not quantized)
        llm = LLM(gguf_model_dir(cfg, quantized), skip_tokenizer_init=True, max_model_len=512)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()
    same = sum(a == b for a, b in zip(*outs))
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
             for a, b in zip(*outs)]
    print(f"greedy tokens, Q4_K_M blocks vs the same weights dequantized to bf16: "
          f"{same}/{len(prompts)} sequences identical; first difference at {first}")
    return same == len(prompts)


def decode(args):
    cfg = bench.SHAPES["llama3-8b"]
    argv = ["latency", "--batch-sizes", "1", "8", "--max-num-seqs", "16"]
    bf16 = bench.main(argv + ["--model-shape", "llama3-8b"])
    torch.cuda.empty_cache()
    patched_weights(cfg)
    q = bench.main(argv + ["--model-shape", gguf_model_dir(cfg, quantized=True)])
    print("\n| Llama-3-8B shape, decode | bf16 tok/s | Q4_K_M-like GGUF tok/s | speed-up |")
    print("|---|---|---|---|")
    for batch in (1, 8):
        a, b = bf16[batch]["tok_s_per_seq"], q[batch]["tok_s_per_seq"]
        print(f"| batch {batch} (per sequence) | {a:.1f} | {b:.1f} | {b / a:.2f}x |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="BLOCK_N / num_warps per type")
    parser.add_argument("--m", type=int, nargs="+", default=[1, 8, 512], help="rows of x")
    parser.add_argument("--only", choices=["kernels", "tokens", "decode"])
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.only in (None, "kernels"):
        kernels(args)
    if args.only in (None, "tokens"):
        same_tokens()
    if args.only in (None, "decode"):
        decode(args)


if __name__ == "__main__":
    main()
