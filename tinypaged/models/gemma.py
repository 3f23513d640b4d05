"""Gemma 2 and Gemma 3 (text), on the shared decoder with Gemma's switches set.

What differs from Llama (see decoder.py):
- GeGLU MLP (`hidden_activation` gelu_pytorch_tanh), embeddings times sqrt(hidden), tied head;
- every RMSNorm (q/k norms included) scales by (1 + w);
- four norms a layer: input, after attention, before and after the MLP (decoder.py's sandwich
  norms, under other checkpoint names, see `_NORM_NAMES`);
- softmax scale query_pre_attn_scalar^-1/2 instead of head_dim^-1/2;
- local (sliding-window) and global layers alternating as `layer_types` (or Gemma 3's
  `sliding_window_pattern`) says;
- Gemma 2: attention logits and final logits soft-capped, cap * tanh(x / cap);
- Gemma 3: RMSNorm over each head of q and k, and its own rotary base for the local layers
  (`rope_parameters["sliding_attention"]`, 4.x: `rope_local_base_freq`).
"""

from __future__ import annotations

from tinypaged.models.decoder import DecoderForCausalLM, read_layer_windows, spec_from_hf_config
from tinypaged.models.rope import read_rope

# Gemma's norm names -> decoder.py's (same places in the layer)
_NORM_NAMES = {
    "post_attention_layernorm": "post_self_attn_layernorm",  # on the attention output
    "pre_feedforward_layernorm": "post_attention_layernorm",  # on the MLP input
    "post_feedforward_layernorm": "post_mlp_layernorm",  # on the MLP output
}
_CHECKPOINT_NAMES = {ours: theirs for theirs, ours in _NORM_NAMES.items()}


def _rename(name: str, table: dict[str, str]) -> str:
    return ".".join(table.get(part, part) for part in name.split("."))


class Gemma2ForCausalLM(DecoderForCausalLM):
    gemma3 = False

    def __init__(self, hf_config, quant_config=None) -> None:
        head_dim = hf_config.head_dim
        gemma3 = self.gemma3
        spec = spec_from_hf_config(
            hf_config,
            hidden_act=getattr(hf_config, "hidden_activation", None) or hf_config.hidden_act,
            sandwich_norms=True,
            qk_norm=gemma3,
            norm_offset=1.0,
            embed_scale=hf_config.hidden_size**0.5,
            attn_scale=hf_config.query_pre_attn_scalar**-0.5,
            attn_logit_softcap=getattr(hf_config, "attn_logit_softcapping", None),
            final_logit_softcap=getattr(hf_config, "final_logit_softcapping", None),
            layer_windows=read_layer_windows(hf_config),
            local_rope=read_rope(hf_config, head_dim, layer_type="sliding_attention")
            if gemma3 else None,
            rope=read_rope(hf_config, head_dim, layer_type="full_attention" if gemma3 else None),
        )
        super().__init__(spec, quant_config)

    def map_name(self, checkpoint_name: str) -> str | None:
        name = super().map_name(checkpoint_name)
        return None if name is None else _rename(name, _NORM_NAMES)

    def checkpoint_name(self, name: str) -> str:
        return _rename(name, _CHECKPOINT_NAMES)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    gemma3 = True
