"""Tiny random checkpoints of every supported architecture, to check tinypaged against
transformers token for token: the CPU tests (tests/models/, tests/engine/, ...) and the GPU
checks (benchmarks/gpu_check.py, tp_check.py, piecewise_check.py) build the same models here.

- `tiny_hf_model(kind)`: a 2-layer random transformers model (fp32, eager attention) of one of
  `HF_KINDS`, with every parameter (biases and norm weights too) drawn at random, so that a
  mis-loaded tensor cannot hide behind a zero bias or a unit norm.
- `chatglm_checkpoint(glm_model)`: the same GLM weights renamed into the original chatglm layout,
  with a chatglm-style config.
- `save_tiny(kind, path)`: one of them written as a checkpoint ("chatglm": GLM converted).

transformers is imported inside the functions: importing this module costs nothing.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file
from torch import nn

TINY = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
}

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}

_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0,  # 8 frequencies of head_dim 16
             "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
             "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.5, 11.5, 15.0],
             "original_max_position_embeddings": 64}

HF_KINDS = {
    # kind: (config class, extra config fields)
    "llama": ("LlamaConfig", {"tie_word_embeddings": True}),
    "llama3_scaling": ("LlamaConfig", {"tie_word_embeddings": True, "rope_scaling": _LLAMA3_ROPE}),
    "llama_untied": ("LlamaConfig", {"tie_word_embeddings": False, "rope_theta": 1000.0}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}),
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": True, "head_dim": 32}),
    "glm": ("GlmConfig", {"head_dim": 16, "pad_token_id": 0, "eos_token_id": 1}),
    "glm4": ("Glm4Config", {"head_dim": 16, "pad_token_id": 0, "eos_token_id": 1}),
    # mixture of experts: layer 0 sparse (with a shared expert) and layer 1 dense
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 8, "num_experts_per_tok": 3,
                                     "moe_intermediate_size": 32, "norm_topk_prob": False,
                                     "shared_expert_intermediate_size": 48,
                                     "mlp_only_layers": [1]}),
    # every layer sparse, renormalized top-k, q/k norm
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "norm_topk_prob": True,
                                     "head_dim": 32}),
    # first layer dense, then grouped sigmoid routing with a bias, scaling, 2 shared experts
    "glm4_moe": ("Glm4MoeConfig", {"head_dim": 32, "n_routed_experts": 8,
                                   "num_experts_per_tok": 3, "moe_intermediate_size": 32,
                                   "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
                                   "n_shared_experts": 2, "routed_scaling_factor": 2.5,
                                   "use_qk_norm": True, "attention_bias": True,
                                   "pad_token_id": 0, "eos_token_id": 1}),
    # sliding windows (8 tokens) shorter than the prompts; soft-caps low enough to bite
    "mistral": ("MistralConfig", {"sliding_window": 8, "head_dim": 16}),
    "qwen2_sliding": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 8,
                                      "max_window_layers": 1}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "sliding_window": 8, "pad_token_id": 0,
                                "attn_logit_softcapping": 0.5, "final_logit_softcapping": 1.5}),
    "gemma3": ("Gemma3TextConfig", {
        "head_dim": 16, "sliding_window": 8, "pad_token_id": 0, "query_pre_attn_scalar": 32,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}}),
    "phi3": ("Phi3Config", {"pad_token_id": 0, "eos_token_id": 1, "sliding_window": 8,
                            "partial_rotary_factor": 0.5}),
    # rope scaling computed by transformers.modeling_rope_utils
    "qwen3_yarn": ("Qwen3Config", {"head_dim": 32, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 32}}),
    "llama_dynamic": ("LlamaConfig", {"rope_parameters": {
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}),
    "phi3_longrope": ("Phi3Config", {"pad_token_id": 0, "eos_token_id": 1,
                                     "original_max_position_embeddings": 64,
                                     "rope_parameters": _LONGROPE}),
}


def randomize_(model: nn.Module, seed: int) -> nn.Module:
    """Every parameter random: norm weights in [0.5, 1.5], MoE router weights N(0, 1) (wide
    gaps between expert scores, so that bf16 rounding seldom flips a choice), all others
    N(0, 0.1^2); and the MoE routers' score-correction biases (buffers) too."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        biases = [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
        for name, p in [*model.named_parameters(), *zip(["bias"] * len(biases), biases)]:
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def tiny_hf_model(kind: str, seed: int = 0, **overrides):
    """A random transformers model of `kind` (a key of HF_KINDS), fp32, eager attention."""
    import transformers

    class_name, extra = HF_KINDS[kind]
    config = getattr(transformers, class_name)(**{**TINY, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    return randomize_(model, seed).eval()


def chatglm_checkpoint(glm):
    """(config, state dict) of `glm` (a GlmForCausalLM) in the original chatglm format."""
    import transformers

    c = glm.config
    rope = c.rope_parameters
    config = transformers.PretrainedConfig(
        architectures=["ChatGLMModel"], model_type="chatglm",
        num_layers=c.num_hidden_layers, padded_vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        ffn_hidden_size=c.intermediate_size, kv_channels=c.head_dim,
        num_attention_heads=c.num_attention_heads, multi_query_attention=True,
        multi_query_group_num=c.num_key_value_heads, layernorm_epsilon=c.rms_norm_eps,
        add_qkv_bias=True, add_bias_linear=False, rope_ratio=rope["rope_theta"] / 10000.0,
        seq_length=c.max_position_embeddings, rmsnorm=True,
        apply_residual_connection_post_layernorm=False, post_layer_norm=True, original_rope=True,
        tie_word_embeddings=False,
    )
    sd = glm.state_dict()
    out = {
        "transformer.embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
        "transformer.encoder.final_layernorm.weight": sd["model.norm.weight"],
        "transformer.output_layer.weight": sd["lm_head.weight"],
        "transformer.rotary_pos_emb.inv_freq": torch.ones(c.head_dim // 4),
    }
    for i in range(c.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"transformer.encoder.layers.{i}."
        attn = src + "self_attn."
        for kind in ("weight", "bias"):
            out[dst + f"self_attention.query_key_value.{kind}"] = torch.cat(
                [sd[attn + f"{p}_proj.{kind}"] for p in "qkv"]
            )
        out[dst + "self_attention.dense.weight"] = sd[attn + "o_proj.weight"]
        out[dst + "mlp.dense_h_to_4h.weight"] = sd[src + "mlp.gate_up_proj.weight"]
        out[dst + "mlp.dense_4h_to_h.weight"] = sd[src + "mlp.down_proj.weight"]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[dst + f"{norm}.weight"] = sd[src + f"{norm}.weight"]
    return config, out


def save_tiny(kind: str, path, **overrides) -> torch.nn.Module:
    """Write a tiny random model of `kind` to `path` (config `overrides` on TINY's and the
    kind's); returns the transformers reference."""
    hf = tiny_hf_model("glm" if kind == "chatglm" else kind, seed=3, **overrides)
    if kind == "chatglm":
        config, weights = chatglm_checkpoint(hf)
        (path / "config.json").write_text(json.dumps(config.to_dict()))
        save_file({k: v.contiguous() for k, v in weights.items()}, path / "model.safetensors")
    else:
        hf.save_pretrained(path)
    return hf


def tiny_llama_config_dir(prefix: str = "tinypaged-tiny-") -> str:
    """A new temporary folder holding only the config.json of a 2-layer Llama (hidden 64, 512
    ids): what the host-time benchmarks load with load_format="dummy" on the CPU, where the
    model's forward must cost next to nothing."""
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp(prefix=prefix))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "torch_dtype": "float32"}))
    return str(path)
