"""GLM-4: `GlmForCausalLM` (glm-4-9b-chat-hf), `Glm4ForCausalLM` (GLM-4-0414) and the original
ChatGLM3 / GLM-4 checkpoint format (model_type "chatglm"), all on one definition.

What differs from the reference decoder (decoder.py):
- Rotary on the first half of each head only (partial_rotary_factor 0.5) with GLM's pairing of
  adjacent dims (2i, 2i+1), angle pos * base^(-2i / rotary_dim).
- q, k and v carry a bias; gate and up come already fused in the checkpoint (`gate_up_proj`,
  gate first).
- Glm4 adds an RMSNorm on the attention output and one on the MLP output, before each residual
  add (`post_self_attn_layernorm`, `post_mlp_layernorm`).

The chatglm format needs no remote code: its config fields are read from a plain
`PretrainedConfig` (num_layers, padded_vocab_size, ffn_hidden_size, kv_channels,
multi_query_group_num, layernorm_epsilon, rope_ratio: base = 10000 * rope_ratio, seq_length, ...)
and its tensors renamed onto the GLM names. Its `query_key_value` is q, k, v stacked (with bias)
and `dense_h_to_4h` is gate and up stacked, exactly our fused layouts.
"""

from __future__ import annotations

from typing import ClassVar

from tinypaged.models.decoder import DecoderForCausalLM, DecoderSpec, spec_from_hf_config
from tinypaged.models.rope import RopeSpec


class GlmForCausalLM(DecoderForCausalLM):
    # gate_up_proj is stored fused by GLM checkpoints: only q, k, v need packing.
    packed_modules: ClassVar[dict[str, tuple[str, object]]] = {
        name: target for name, target in DecoderForCausalLM.packed_modules.items()
        if target[0] == "qkv_proj"
    }
    sandwich_norms = False

    def __init__(self, hf_config, quant_config=None) -> None:
        spec = spec_from_hf_config(
            hf_config,
            interleaved_rope=True,
            default_partial_rotary=0.5,
            qkv_bias=bool(getattr(hf_config, "attention_bias", True)),
            sandwich_norms=self.sandwich_norms,
        )
        super().__init__(spec, quant_config)


class Glm4ForCausalLM(GlmForCausalLM):
    sandwich_norms = True


# chatglm tensor-name pieces -> ours (each applied at most once, in this order).
_CHATGLM_RENAMES = (
    ("transformer.embedding.word_embeddings.", "model.embed_tokens."),
    ("transformer.encoder.final_layernorm.", "model.norm."),
    ("transformer.encoder.layers.", "model.layers."),
    ("transformer.output_layer.", "lm_head."),
    (".self_attention.query_key_value.", ".self_attn.qkv_proj."),
    (".self_attention.dense.", ".self_attn.o_proj."),
    (".mlp.dense_h_to_4h.", ".mlp.gate_up_proj."),
    (".mlp.dense_4h_to_h.", ".mlp.down_proj."),
)

# Variants of the chatglm architecture this definition does not implement: field -> the value
# it must have (the value every ChatGLM2/3 and GLM-4 checkpoint uses).
_CHATGLM_REQUIRED = {
    "rmsnorm": True,
    "apply_residual_connection_post_layernorm": False,
    "post_layer_norm": True,
    "original_rope": True,
}


def chatglm_spec(cfg) -> DecoderSpec:
    for key, required in _CHATGLM_REQUIRED.items():
        value = getattr(cfg, key, required)
        if value != required:
            raise ValueError(
                f"{key}={value!r} in the chatglm config.json is not supported "
                f"(only {key}={required!r})"
            )
    num_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "kv_channels", None) or cfg.hidden_size // num_heads
    multi_query = bool(getattr(cfg, "multi_query_attention", False))
    bias_linear = bool(getattr(cfg, "add_bias_linear", False))
    return DecoderSpec(
        vocab_size=cfg.padded_vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_layers=cfg.num_layers,
        num_heads=num_heads,
        num_kv_heads=cfg.multi_query_group_num if multi_query else num_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.layernorm_epsilon,
        rope=RopeSpec(
            theta=10000.0 * float(getattr(cfg, "rope_ratio", 1.0)),
            rotary_dim=head_dim // 2,
            max_position=int(cfg.seq_length),
            interleaved=True,
        ),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qkv_bias=bias_linear or bool(getattr(cfg, "add_qkv_bias", False)),
        o_bias=bias_linear,
        mlp_bias=bias_linear,
    )


class ChatGLMForConditionalGeneration(GlmForCausalLM):
    # q/k/v and gate/up are both stored fused: nothing to pack.
    packed_modules: ClassVar[dict[str, tuple[str, object]]] = {}

    def __init__(self, hf_config, quant_config=None) -> None:
        DecoderForCausalLM.__init__(self, chatglm_spec(hf_config), quant_config)

    def map_name(self, checkpoint_name: str) -> str | None:
        if checkpoint_name.endswith("rotary_pos_emb.inv_freq"):
            return None
        name = checkpoint_name
        for old, new in _CHATGLM_RENAMES:
            name = name.replace(old, new, 1)
        return super().map_name(name)

    def checkpoint_name(self, name: str) -> str:
        for old, new in _CHATGLM_RENAMES:
            name = name.replace(new, old, 1)
        return name
