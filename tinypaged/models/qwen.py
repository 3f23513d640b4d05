"""Qwen2 / Qwen2.5 and Qwen3.

Both are the reference decoder (decoder.py) with neox rotary on the whole head. Their differences:
- Qwen2 / 2.5: q, k and v projections carry a bias (always; the o projection has none).
- Qwen3: no bias (unless `attention_bias`), and an RMSNorm over each head of q and of k (weights
  [head_dim], `self_attn.q_norm` / `k_norm`) applied before the rotary embedding.
Sliding-window layers (off in the released configs) are refused.
"""

from __future__ import annotations

from tinypaged.models.decoder import DecoderForCausalLM, spec_from_hf_config


def _check_full_attention(hf_config) -> None:
    layer_types = getattr(hf_config, "layer_types", None) or ()
    if getattr(hf_config, "use_sliding_window", False) or "sliding_attention" in layer_types:
        raise ValueError(
            "use_sliding_window is true in config.json: sliding-window attention is not "
            "supported; set use_sliding_window to false"
        )


class Qwen2ForCausalLM(DecoderForCausalLM):
    def __init__(self, hf_config, quant_config=None) -> None:
        _check_full_attention(hf_config)
        super().__init__(spec_from_hf_config(hf_config, qkv_bias=True), quant_config)


class Qwen3ForCausalLM(DecoderForCausalLM):
    def __init__(self, hf_config, quant_config=None) -> None:
        _check_full_attention(hf_config)
        bias = bool(getattr(hf_config, "attention_bias", False))
        spec = spec_from_hf_config(hf_config, qkv_bias=bias, o_bias=bias, qk_norm=True)
        super().__init__(spec, quant_config)
