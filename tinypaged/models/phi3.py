"""Phi-3 / Phi-3.5 / Phi-4-mini (`Phi3ForCausalLM`).

The reference decoder (decoder.py) with no biases; its checkpoints already hold the fused
projections our layers compute with: `self_attn.qkv_proj.weight` ([q; k; v] rows) and
`mlp.gate_up_proj.weight` ([gate; up] rows), which the fused layers' weight loaders split per
shard (and per tensor-parallel rank) at load. Rotary: neox style, optionally partial
(`partial_rotary_factor`, Phi-4-mini), with longrope scaling in the 128k-context models; a set
`sliding_window` (Phi-3-mini-4k) applies to every layer, as in transformers.
"""

from __future__ import annotations

from tinypaged.models.decoder import DecoderForCausalLM, read_layer_windows, spec_from_hf_config


class Phi3ForCausalLM(DecoderForCausalLM):
    def __init__(self, hf_config, quant_config=None) -> None:
        spec = spec_from_hf_config(hf_config, layer_windows=read_layer_windows(hf_config))
        super().__init__(spec, quant_config)
