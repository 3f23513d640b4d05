"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B) and Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B).

The Qwen2 / Qwen3 decoders (qwen.py) with a sparse MoE block (models/moe.py) as the MLP of the
layers `mlp_only_layers` leaves out and `decoder_sparse_step` picks ((i + 1) % step == 0); the
other layers keep a dense MLP of `intermediate_size`. Routing is softmax top-k
(`num_experts_per_tok` of `num_experts`), renormalized when `norm_topk_prob`.
- Qwen2-MoE: q/k/v bias; a shared expert (`shared_expert_intermediate_size`) in every sparse
  layer, its output gated by sigmoid(x `shared_expert_gate`^T); norm_topk_prob false by default.
- Qwen3-MoE: q/k norm, no bias, no shared expert.
Sliding-window layers (`use_sliding_window`, off in the released configs) run as in qwen.py.
"""

from __future__ import annotations

from tinypaged.models.decoder import DecoderForCausalLM, read_layer_windows, spec_from_hf_config
from tinypaged.models.moe import MoESpec


def qwen_moe_spec(hf_config, *, shared_expert: bool) -> MoESpec:
    skip = set(getattr(hf_config, "mlp_only_layers", None) or ())
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    # transformers 5 stores `num_experts` as `num_local_experts` (an attribute_map alias)
    num_experts = int(getattr(hf_config, "num_experts", None)
                      or getattr(hf_config, "num_local_experts", 0))
    sparse = tuple(
        i for i in range(hf_config.num_hidden_layers)
        if num_experts > 0 and i not in skip and (i + 1) % step == 0
    )
    return MoESpec(
        num_experts=num_experts,
        top_k=int(hf_config.num_experts_per_tok),
        intermediate_size=int(hf_config.moe_intermediate_size),
        sparse_layers=sparse,
        renormalize=bool(getattr(hf_config, "norm_topk_prob", False)),
        shared_intermediate_size=(
            int(hf_config.shared_expert_intermediate_size) if shared_expert else 0
        ),
        shared_expert_gate=shared_expert,
    )


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    def __init__(self, hf_config, quant_config=None) -> None:
        spec = spec_from_hf_config(
            hf_config, qkv_bias=bool(getattr(hf_config, "qkv_bias", True)),
            moe=qwen_moe_spec(hf_config, shared_expert=True),
            layer_windows=read_layer_windows(hf_config),
        )
        super().__init__(spec, quant_config)


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    def __init__(self, hf_config, quant_config=None) -> None:
        bias = bool(getattr(hf_config, "attention_bias", False))
        spec = spec_from_hf_config(
            hf_config, qkv_bias=bias, o_bias=bias, qk_norm=True,
            moe=qwen_moe_spec(hf_config, shared_expert=False),
            layer_windows=read_layer_windows(hf_config),
        )
        super().__init__(spec, quant_config)
