"""Weights that do not fit the model, and architectures we do not know, fail loudly and by name."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers.models import build_model, chatglm_checkpoint, single_thread, tiny_hf_model  # noqa: F401

from tinypaged.models.registry import get_model_class


@pytest.fixture(scope="module")
def llama_model():
    return tiny_hf_model("llama_untied")


@pytest.fixture
def llama(llama_model):
    """(config, a fresh name -> tensor dict the test may edit)."""
    return llama_model.config, dict(llama_model.state_dict())


def test_missing_tensor_is_named(llama):
    config, weights = llama
    del weights["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.self_attn\.k_proj\.weight"):
        build_model(config, weights)


def test_missing_untied_lm_head_is_named(llama):
    config, weights = llama
    del weights["lm_head.weight"]
    with pytest.raises(ValueError, match=r"missing.*lm_head\.weight"):
        build_model(config, weights)


def test_unexpected_tensor_is_named(llama):
    config, weights = llama
    weights["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4)
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.extra_proj"):
        build_model(config, weights)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.v_proj.weight",
                                  "model.layers.1.mlp.down_proj.weight",
                                  "model.embed_tokens.weight", "model.norm.weight"])
def test_wrong_shape_is_named(llama, name):
    config, weights = llama
    weights[name] = weights[name][..., :-1]
    with pytest.raises(ValueError, match=rf"{name.replace('.', '[.]')}.*expected shape"):
        build_model(config, weights)


def test_fused_gate_up_with_wrong_size_is_named():
    hf = tiny_hf_model("glm")
    weights = dict(hf.state_dict())
    name = "model.layers.0.mlp.gate_up_proj.weight"
    weights[name] = weights[name][:-2]
    with pytest.raises(ValueError, match=rf"{name.replace('.', '[.]')}.*expected shape"):
        build_model(hf.config, weights)


def test_missing_chatglm_tensor_is_named_in_chatglm_terms():
    config, weights = chatglm_checkpoint(tiny_hf_model("glm"))
    del weights["transformer.encoder.layers.1.self_attention.query_key_value.bias"]
    with pytest.raises(ValueError, match=r"transformer\.encoder\.layers\.1\.self_attention\."
                                         r"query_key_value\.bias"):
        build_model(config, weights)


def test_unknown_architecture_lists_supported():
    config = transformers.PretrainedConfig(architectures=["FooForCausalLM"], model_type="foo")
    with pytest.raises(ValueError, match=r"FooForCausalLM.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        get_model_class(config)


def test_model_type_resolves_without_architectures():
    config = transformers.PretrainedConfig(model_type="qwen3")
    assert get_model_class(config).__name__ == "Qwen3ForCausalLM"


def test_unsupported_rope_type_is_refused():
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        vocab_size=64, rope_scaling={"rope_type": "mrope", "rope_theta": 1e4},
    )
    with pytest.raises(ValueError, match="mrope.*supported: default"):
        get_model_class(config)(config)


def test_yarn_needs_a_transformers_config():
    from types import SimpleNamespace

    from tinypaged.models.rope import read_rope

    config = SimpleNamespace(max_position_embeddings=64, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
        "original_max_position_embeddings": 16})
    with pytest.raises(ValueError, match="yarn.*transformers config.*SimpleNamespace"):
        read_rope(config, 16)


def test_layer_types_of_the_wrong_length_are_refused():
    config = transformers.MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=64, sliding_window=8,
    )
    config.layer_types = ["sliding_attention"]
    with pytest.raises(ValueError, match="layer_types.*1 entries for 2 layers"):
        get_model_class(config)(config)
