"""Llama 2 and 3 (with Llama-3.1 rope scaling), SmolLM2, and Mistral.

The reference decoder (see decoder.py) with nothing added: neox-style rotary on the whole head,
optional biases (`attention_bias` on q/k/v and o, `mlp_bias` on the MLP), tied or untied LM head.
Checkpoint names are transformers' (`model.layers.N.self_attn.q_proj.weight`, ...).

Mistral is Llama plus a sliding window: with `sliding_window` set, every layer attends to that
many tokens (the newest included), as transformers' MistralForCausalLM does. A Llama config has
no window of its own: like transformers, a `sliding_window` field in a LlamaForCausalLM config
applies only through `layer_types`.
"""

from __future__ import annotations

from tinypaged.models.decoder import DecoderForCausalLM, read_layer_windows, spec_from_hf_config


class LlamaForCausalLM(DecoderForCausalLM):
    window_on_every_layer = False  # Mistral: a bare `sliding_window` applies to every layer

    def __init__(self, hf_config, quant_config=None) -> None:
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        sliding = self.window_on_every_layer or getattr(hf_config, "layer_types", None)
        spec = spec_from_hf_config(
            hf_config,
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            layer_windows=read_layer_windows(hf_config) if sliding else (),
        )
        super().__init__(spec, quant_config)


class MistralForCausalLM(LlamaForCausalLM):
    window_on_every_layer = True
