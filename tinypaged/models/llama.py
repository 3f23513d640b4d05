"""Llama 2 and 3 (with Llama-3.1 rope scaling), SmolLM2, and Mistral configs that are plain Llama.

The reference decoder (see decoder.py) with nothing added: neox-style rotary on the whole head,
optional biases (`attention_bias` on q/k/v and o, `mlp_bias` on the MLP), tied or untied LM head.
Checkpoint names are transformers' (`model.layers.N.self_attn.q_proj.weight`, ...).
"""

from __future__ import annotations

from tinypaged.models.decoder import DecoderForCausalLM, spec_from_hf_config


class LlamaForCausalLM(DecoderForCausalLM):
    def __init__(self, hf_config, quant_config=None) -> None:
        window = getattr(hf_config, "sliding_window", None)  # Mistral v0.1 has one
        if window is not None and window < hf_config.max_position_embeddings:
            raise ValueError(
                f"sliding_window={window} in config.json: sliding-window attention is not "
                "supported; use a checkpoint with sliding_window null"
            )
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        spec = spec_from_hf_config(
            hf_config,
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        )
        super().__init__(spec, quant_config)
