"""GLM-4.5 / GLM-4.6 (`Glm4MoeForCausalLM`: GLM-4.5, GLM-4.5-Air, GLM-4.6).

The reference decoder (decoder.py) with:
- partial rotary: neox halves on the first `partial_rotary_factor` (0.5) of each head (unlike
  GLM-4's adjacent pairs); q/k/v bias when `attention_bias`, no o bias; optional q/k norm
  (`use_qk_norm`);
- the first `first_k_dense_replace` layers dense (`intermediate_size`), every later one a MoE
  block (models/moe.py): `n_routed_experts` experts of `moe_intermediate_size`, routed by
  sigmoid scores plus `e_score_correction_bias` with grouped top-k (`n_group`, `topk_group`),
  weights renormalized (`norm_topk_prob`) and scaled by `routed_scaling_factor`; plus
  `n_shared_experts` shared experts stored as one MLP of n * moe_intermediate_size, summed in
  ungated. The router weight stays float32, as in transformers.
Checkpoints may carry multi-token-prediction layers past `num_hidden_layers`
(`num_nextn_predict_layers`); they are skipped here and loaded by speculative decoding's
`{"method": "mtp"}` (spec_decode/heads.py).
"""

from __future__ import annotations

import re

from tinypaged.models.decoder import DecoderForCausalLM, spec_from_hf_config
from tinypaged.models.moe import MoESpec

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def glm_moe_spec(hf_config) -> MoESpec:
    first_sparse = int(getattr(hf_config, "first_k_dense_replace", 0))
    moe_inter = int(hf_config.moe_intermediate_size)
    return MoESpec(
        num_experts=int(hf_config.n_routed_experts),
        top_k=int(hf_config.num_experts_per_tok),
        intermediate_size=moe_inter,
        sparse_layers=tuple(range(first_sparse, hf_config.num_hidden_layers)),
        renormalize=bool(getattr(hf_config, "norm_topk_prob", True)),
        scoring_func="sigmoid",
        correction_bias=True,
        num_expert_group=int(getattr(hf_config, "n_group", 1) or 1),
        topk_group=int(getattr(hf_config, "topk_group", 1) or 1),
        routed_scaling_factor=float(getattr(hf_config, "routed_scaling_factor", 1.0)),
        router_fp32=True,
        shared_intermediate_size=moe_inter * int(getattr(hf_config, "n_shared_experts", 0) or 0),
    )


class Glm4MoeForCausalLM(DecoderForCausalLM):
    def __init__(self, hf_config, quant_config=None) -> None:
        spec = spec_from_hf_config(
            hf_config,
            default_partial_rotary=0.5,
            qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=bool(getattr(hf_config, "use_qk_norm", False)),
            moe=glm_moe_spec(hf_config),
        )
        super().__init__(spec, quant_config)

    def map_name(self, checkpoint_name: str) -> str | None:
        layer = _LAYER.match(checkpoint_name)
        if layer is not None and int(layer.group(1)) >= self.num_layers:
            return None  # a multi-token-prediction layer
        return super().map_name(checkpoint_name.replace(".mlp.shared_experts.",
                                                        ".mlp.shared_expert.", 1))

    def checkpoint_name(self, name: str) -> str:
        return name.replace(".mlp.shared_expert.", ".mlp.shared_experts.", 1)
