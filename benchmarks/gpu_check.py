"""GPU correctness check, run before any timing: bf16 greedy agreement with transformers.

For each architecture a tiny random model (`save_tiny`: 2 layers, every parameter random, so a
mis-loaded bias or norm cannot hide) runs through tinypaged (Triton kernels, CUDA graphs) and
through transformers on the same GPU in bf16. Prints, per architecture, the fraction of prompts
whose greedy tokens agree fully, the length of the common prefix, and the max |logprob
difference| of the first step. tp_check.py and piecewise_check.py build their models here too.

    PYTHONPATH=. python benchmarks/gpu_check.py [--kinds llama qwen3 ...] [--eager]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import torch

from tinypaged import LLM, SamplingParams

TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5}
HF_KINDS = {  # kind: (transformers config class, fields over TINY); "chatglm" is glm converted
    "llama": ("LlamaConfig", {"tie_word_embeddings": True}),
    "llama3_scaling": ("LlamaConfig", {"tie_word_embeddings": True, "rope_scaling": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}),
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": True, "head_dim": 32}),
    "glm": ("GlmConfig", {"head_dim": 16, "pad_token_id": 0, "eos_token_id": 1}),
    "glm4": ("Glm4Config", {"head_dim": 16, "pad_token_id": 0, "eos_token_id": 1}),
    "qwen2_moe": ("Qwen2MoeConfig", {  # layer 0 sparse with a shared expert, layer 1 dense
        "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
        "norm_topk_prob": False, "shared_expert_intermediate_size": 48, "mlp_only_layers": [1]}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2, "head_dim": 32,
                                     "moe_intermediate_size": 32, "norm_topk_prob": True}),
    "glm4_moe": ("Glm4MoeConfig", {  # grouped sigmoid routing with a bias, 2 shared experts
        "head_dim": 32, "n_routed_experts": 8, "num_experts_per_tok": 3,
        "moe_intermediate_size": 32, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
        "n_shared_experts": 2, "routed_scaling_factor": 2.5, "use_qk_norm": True,
        "attention_bias": True, "pad_token_id": 0, "eos_token_id": 1}),
    # sliding windows (8 tokens) shorter than the prompts; soft-caps low enough to bite
    "mistral": ("MistralConfig", {"sliding_window": 8, "head_dim": 16}),
    "qwen2_sliding": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 8,
                                      "max_window_layers": 1}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "sliding_window": 8, "pad_token_id": 0,
                                "attn_logit_softcapping": 0.5, "final_logit_softcapping": 1.5}),
    "gemma3": ("Gemma3TextConfig", {
        "head_dim": 16, "sliding_window": 8, "pad_token_id": 0, "query_pre_attn_scalar": 32,
        "layer_types": ["sliding_attention", "full_attention"], "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}}),
    "phi3": ("Phi3Config", {"pad_token_id": 0, "eos_token_id": 1, "sliding_window": 8,
                            "partial_rotary_factor": 0.5}),
    "qwen3_yarn": ("Qwen3Config", {"head_dim": 32, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 32}}),
    "llama_dynamic": ("LlamaConfig", {"rope_parameters": {
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}),
}
# Phi-3's longrope is left to tests/models/test_models_cuda.py: these prompts outgrow its short
# original context, past which transformers re-rotates the whole sequence with the long factors.
KINDS = [*HF_KINDS, "chatglm"]


def save_tiny(kind: str, path: Path, seed: int = 3) -> torch.nn.Module:
    """Write a tiny random checkpoint of `kind` to `path`; returns transformers' model of it
    (fp32, eager attention). Norm weights are drawn in [0.5, 1.5], MoE routers N(0, 1) (wide
    gaps between expert scores: bf16 rounding seldom flips a choice), the rest N(0, 0.1^2)."""
    import transformers
    from safetensors.torch import save_file

    class_name, extra = HF_KINDS["glm" if kind == "chatglm" else kind]
    config = getattr(transformers, class_name)(**{**TINY, **extra})
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                       dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        biases = [("bias", b) for n, b in hf.named_buffers() if n.endswith("correction_bias")]
        for name, p in [*hf.named_parameters(), *biases]:
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                std = 1.0 if name.endswith("mlp.gate.weight") else 0.1
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    if kind != "chatglm":
        hf.save_pretrained(path)
        return hf
    config, weights = chatglm_checkpoint(hf)
    (path / "config.json").write_text(json.dumps(config))
    save_file(weights, path / "model.safetensors")
    return hf


def chatglm_checkpoint(glm) -> tuple[dict, dict]:
    """(config, tensors) of a GlmForCausalLM in the original chatglm layout (fused qkv)."""
    c, sd = glm.config, glm.state_dict()
    config = {
        "architectures": ["ChatGLMModel"], "model_type": "chatglm", "num_layers":
        c.num_hidden_layers, "padded_vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "ffn_hidden_size": c.intermediate_size, "kv_channels": c.head_dim,
        "num_attention_heads": c.num_attention_heads, "multi_query_attention": True,
        "multi_query_group_num": c.num_key_value_heads, "layernorm_epsilon": c.rms_norm_eps,
        "add_qkv_bias": True, "add_bias_linear": False, "rmsnorm": True,
        "rope_ratio": c.rope_parameters["rope_theta"] / 10000.0, "original_rope": True,
        "seq_length": c.max_position_embeddings, "post_layer_norm": True,
        "apply_residual_connection_post_layernorm": False, "tie_word_embeddings": False,
        "torch_dtype": "float32"}
    out = {"transformer.embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
           "transformer.encoder.final_layernorm.weight": sd["model.norm.weight"],
           "transformer.output_layer.weight": sd["lm_head.weight"],
           "transformer.rotary_pos_emb.inv_freq": torch.ones(c.head_dim // 4)}
    for i in range(c.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"transformer.encoder.layers.{i}."
        for kind in ("weight", "bias"):
            out[dst + f"self_attention.query_key_value.{kind}"] = torch.cat(
                [sd[src + f"self_attn.{p}_proj.{kind}"] for p in "qkv"])
        out[dst + "self_attention.dense.weight"] = sd[src + "self_attn.o_proj.weight"]
        out[dst + "mlp.dense_h_to_4h.weight"] = sd[src + "mlp.gate_up_proj.weight"]
        out[dst + "mlp.dense_4h_to_h.weight"] = sd[src + "mlp.down_proj.weight"]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[dst + f"{norm}.weight"] = sd[src + f"{norm}.weight"]
    return config, {k: v.contiguous() for k, v in out.items()}


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    ids = torch.tensor([prompt], device="cuda")
    first = None
    for _ in range(steps):
        logits = hf(ids).logits[0, -1].float()
        first = logits if first is None else first
        ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist(), first


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kinds", nargs="+", default=KINDS)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--reference", action="store_true", help="torch reference kernels")
    args = parser.parse_args()
    if args.reference:  # locate a disagreement: kernels or the rest of the engine?
        import importlib

        for name in ("activation", "attention", "kv_cache", "moe", "norm", "rotary"):
            importlib.import_module(f"tinypaged.kernels.{name}").use_triton = lambda x: False
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 250) for _ in range(rng.randint(5, 60))] for _ in range(8)]
    rows = []
    for kind in args.kinds:
        path = Path(tempfile.mkdtemp())
        hf = save_tiny(kind, path).to("cuda", torch.bfloat16)
        llm = LLM(str(path), dtype="bfloat16", skip_tokenizer_init=True, num_kv_blocks=256,
                  enforce_eager=args.eager, max_num_seqs=16)
        params = SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True, logprobs=5)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        full, prefix, err = 0, [], 0.0
        for p, o in zip(prompts, outs):
            ref, first = hf_greedy(hf, p, args.steps)
            ours = o.outputs[0].token_ids
            full += ours == ref
            prefix.append(next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), len(ref)))
            ref_lp = torch.log_softmax(first, -1)
            first_step = o.outputs[0].logprobs[0]
            err = max(err, max(abs(v - ref_lp[t].item()) for t, v in first_step.items()))
        rows.append((kind, full, len(prompts), min(prefix), err))
    print("| arch | prompts fully equal | shortest common prefix | max logprob diff (step 1) |")
    print("|---|---|---|---|")
    for kind, full, n, pre, err in rows:
        print(f"| {kind} | {full}/{n} | {pre}/{args.steps} | {err:.3f} |")


if __name__ == "__main__":
    main()
