"""Mixture-of-experts models beyond the logits test of test_models.py: which layers are sparse,
the stacked experts against the checkpoint's per-expert tensors, and the loader's messages."""

from __future__ import annotations

import pytest
import torch
from helpers.models import build_model, checkpoint_weights, tiny_hf_model

from tinypaged.models.moe import SparseMoeBlock


def mlp_kinds(model) -> list[str]:
    return ["sparse" if isinstance(layer.mlp, SparseMoeBlock) else "dense"
            for layer in model.model.layers]


@pytest.mark.parametrize("kind,overrides", [
    ("qwen3_moe", {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]}),
    ("qwen2_moe", {"num_hidden_layers": 3, "mlp_only_layers": [0, 2]}),
    ("glm4_moe", {"num_hidden_layers": 3, "first_k_dense_replace": 2}),
])
def test_sparse_layers_follow_the_config(kind, overrides):
    hf = tiny_hf_model(kind, **overrides)
    model = build_model(hf.config, checkpoint_weights(hf))
    want = ["dense" if type(layer.mlp).__name__.endswith("MLP") else "sparse"
            for layer in hf.model.layers]
    assert mlp_kinds(model) == want and "sparse" in want and "dense" in want


def test_experts_are_stacked_from_the_per_expert_tensors():
    hf = tiny_hf_model("qwen2_moe")
    weights = checkpoint_weights(hf)
    experts = build_model(hf.config, weights).model.layers[0].mlp.experts
    for e in (0, 5):
        prefix = f"model.layers.0.mlp.experts.{e}."
        want_w13 = torch.cat([weights[prefix + "gate_proj.weight"],
                              weights[prefix + "up_proj.weight"]])
        torch.testing.assert_close(experts.w13_weight[e], want_w13, atol=0, rtol=0)
        torch.testing.assert_close(experts.w2_weight[e], weights[prefix + "down_proj.weight"],
                                   atol=0, rtol=0)


def test_missing_expert_tensor_is_named_as_in_the_checkpoint():
    hf = tiny_hf_model("glm4_moe")
    weights = checkpoint_weights(hf)
    del weights["model.layers.1.mlp.experts.6.up_proj.weight"]
    del weights["model.layers.1.mlp.shared_experts.down_proj.weight"]
    with pytest.raises(ValueError, match="2 tensor") as error:
        build_model(hf.config, weights)
    assert "model.layers.1.mlp.experts.6.up_proj.weight" in str(error.value)
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in str(error.value)


def test_wrong_expert_shape_is_named():
    hf = tiny_hf_model("qwen3_moe")
    weights = checkpoint_weights(hf)
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    weights[name] = weights[name][:, :16]
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + ".*expected shape"):
        build_model(hf.config, weights)


def test_glm_multi_token_prediction_layers_are_skipped():
    hf = tiny_hf_model("glm4_moe")
    weights = checkpoint_weights(hf)
    reference = build_model(hf.config, weights)
    # GLM-4.5 checkpoints carry a next-token-prediction layer after the last decoder layer
    mtp = {k.replace("model.layers.1.", "model.layers.2."): v for k, v in weights.items()
           if k.startswith("model.layers.1.")}
    mtp["model.layers.2.eh_proj.weight"] = torch.ones(2)
    model = build_model(hf.config, {**weights, **mtp})
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(a, b), name


def test_glm_router_stays_float32_in_bf16():
    hf = tiny_hf_model("glm4_moe")
    model = build_model(hf.config, checkpoint_weights(hf), dtype=torch.bfloat16)
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert model.model.layers[1].mlp.experts.w13_weight.dtype == torch.bfloat16


def test_quantized_moe_is_refused():
    from tinypaged.models.moe import MoESpec

    spec = MoESpec(num_experts=4, top_k=2, intermediate_size=8, sparse_layers=(0,),
                   renormalize=True)
    with pytest.raises(ValueError, match="quantized mixture-of-experts"):
        SparseMoeBlock(16, spec, quant_config=object())
