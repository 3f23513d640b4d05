"""Qwen2 / Qwen2.5 and Qwen3.

Both are the reference decoder (decoder.py) with neox rotary on the whole head. Their differences:
- Qwen2 / 2.5: q, k and v projections carry a bias (always; the o projection has none).
- Qwen3: no bias (unless `attention_bias`), and an RMSNorm over each head of q and of k (weights
  [head_dim], `self_attn.q_norm` / `k_norm`) applied before the rotary embedding.
With `use_sliding_window` (off in the released configs) the layers `layer_types` names
"sliding_attention" (those from `max_window_layers` on) attend over `sliding_window` tokens.
"""

from __future__ import annotations

from tinypaged.models.decoder import DecoderForCausalLM, read_layer_windows, spec_from_hf_config


class Qwen2ForCausalLM(DecoderForCausalLM):
    def __init__(self, hf_config, quant_config=None) -> None:
        spec = spec_from_hf_config(hf_config, qkv_bias=True,
                                   layer_windows=read_layer_windows(hf_config))
        super().__init__(spec, quant_config)


class Qwen3ForCausalLM(DecoderForCausalLM):
    def __init__(self, hf_config, quant_config=None) -> None:
        bias = bool(getattr(hf_config, "attention_bias", False))
        spec = spec_from_hf_config(hf_config, qkv_bias=bias, o_bias=bias, qk_norm=True,
                                   layer_windows=read_layer_windows(hf_config))
        super().__init__(spec, quant_config)
