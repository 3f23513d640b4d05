"""load_model end to end on tiny checkpoints written by transformers, and its error messages."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.models import (
    PagedRunner,
    assert_logits_close,
    chatglm_checkpoint,
    greedy_reference,
    tiny_hf_model,
)
from safetensors.torch import load_file, save_file

from tinypaged.config import EngineConfig
from tinypaged.models.loader import load_model

PROMPTS = [[5, 17, 99, 3, 250, 42, 7], list(range(11, 31))]
DECODE_STEPS = 3


def _check_against_transformers(model, hf_model) -> None:
    """Two prompts of different lengths prefilled in one flat batch, then batched decode steps
    fed with transformers' greedy tokens: every step's logits match transformers'."""
    refs = [greedy_reference(hf_model, p, DECODE_STEPS) for p in PROMPTS]
    runner = PagedRunner(model, block_size=4, num_blocks=32)
    seqs = [runner.add_sequence() for _ in PROMPTS]
    out = runner.step({s: p for s, p in zip(seqs, PROMPTS)})
    for s, p, (_, ref) in zip(seqs, PROMPTS, refs):
        assert_logits_close(out[s], ref[: len(p)], what=f"prefill of sequence {s}")
    for step in range(DECODE_STEPS):
        out = runner.step({s: [tokens[step]] for s, (tokens, _) in zip(seqs, refs)})
        for s, p, (_, ref) in zip(seqs, PROMPTS, refs):
            assert_logits_close(out[s][0], ref[len(p) + step], what=f"decode {step} of seq {s}")


@pytest.mark.parametrize("kind, shard", [("llama", None), ("qwen3", "40KB"), ("qwen2", "40KB"),
                                         ("glm4_moe", "40KB")])
def test_saved_checkpoint_matches_transformers(tmp_path, kind, shard):
    hf_model = tiny_hf_model(kind)
    hf_model.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    assert (tmp_path / "model.safetensors.index.json").is_file() == bool(shard)
    previous = torch.get_default_dtype()
    model, hf_config, model_dir = load_model(EngineConfig(model=str(tmp_path)), "cpu")
    assert torch.get_default_dtype() == previous  # the build-time default dtype is restored
    assert model_dir == tmp_path.resolve() and hf_config.model_type == hf_model.config.model_type
    assert next(model.parameters()).dtype == torch.float32  # dtype="auto" on the CPU
    assert not any(p.requires_grad for p in model.parameters()) and not model.training
    _check_against_transformers(model, hf_model)


def test_chatglm_checkpoint_loads_without_remote_code(tmp_path):
    glm = tiny_hf_model("glm")
    config, weights = chatglm_checkpoint(glm)
    config_dict = config.to_dict()
    # as in a real chatglm config.json (to_dict of a generic config leaves model_type empty)
    config_dict.update(model_type="chatglm",
                       auto_map={"AutoConfig": "configuration_chatglm.ChatGLMConfig"})
    (tmp_path / "config.json").write_text(json.dumps(config_dict))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp_path / "model.safetensors"))
    model, hf_config, _ = load_model(EngineConfig(model=str(tmp_path)), "cpu")
    assert hf_config.model_type == "chatglm" and hf_config.architectures == ["ChatGLMModel"]
    _check_against_transformers(model, glm)


def test_explicit_dtype_builds_parameters_in_that_dtype(tmp_path):
    tiny_hf_model("llama").save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="slower"):
        model, _, _ = load_model(EngineConfig(model=str(tmp_path), dtype="bfloat16"), "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32


def test_dummy_weights_are_small_random_and_seeded(tmp_path):
    hf_model = tiny_hf_model("qwen3")
    hf_model.config.save_pretrained(tmp_path)  # config only: dummy loading reads no weights
    runs = [load_model(EngineConfig(model=str(tmp_path), load_format="dummy", seed=s), "cpu")[0]
            for s in (1, 1, 2)]
    params = [torch.cat([p.flatten() for p in m.parameters()]) for m in runs]
    assert params[0].abs().max() <= 1e-3 and params[0].std() > 1e-4
    assert torch.equal(params[0], params[1]) and not torch.equal(params[0], params[2])


def test_dummy_weights_refused_for_a_gguf_config(tmp_path):
    # GGUF layers take their blocks from the .gguf file; random ones would fail at the first
    # forward, far from the cause.
    config = tiny_hf_model("llama").config
    config.quantization_config = {"quant_method": "gguf"}
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="dummy.*GGUF"):
        load_model(EngineConfig(model=str(tmp_path), load_format="dummy"), "cpu")


# ------------------------------------------------------------------ errors through load_model
def _edit_checkpoint(path, edit) -> None:
    weights = load_file(str(path / "model.safetensors"))
    edit(weights)
    save_file(weights, str(path / "model.safetensors"))


def _load(path):
    return load_model(EngineConfig(model=str(path)), "cpu")


@pytest.fixture
def llama_dir(tmp_path):
    tiny_hf_model("llama_untied").save_pretrained(tmp_path)
    return tmp_path


def test_missing_tensor_is_named(llama_dir):
    _edit_checkpoint(llama_dir, lambda w: w.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.mlp\.up_proj\.weight"):
        _load(llama_dir)


def test_extra_tensor_is_named(llama_dir):
    _edit_checkpoint(llama_dir, lambda w: w.update({"model.layers.0.mystery.weight":
                                                    torch.zeros(3)}))
    with pytest.raises(ValueError, match=r"unexpected.*model\.layers\.0\.mystery\.weight"):
        _load(llama_dir)


def test_wrong_shape_is_named(llama_dir):
    def shrink(w):
        name = "model.layers.0.self_attn.k_proj.weight"
        w[name] = w[name][1:]

    _edit_checkpoint(llama_dir, shrink)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*shape"):
        _load(llama_dir)


def test_unknown_architecture_lists_the_supported_ones(llama_dir):
    config = json.loads((llama_dir / "config.json").read_text())
    config.update(architectures=["MysteryForCausalLM"], model_type="mystery")
    (llama_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"MysteryForCausalLM.*LlamaForCausalLM"):
        _load(llama_dir)


def test_no_safetensors_is_a_clear_error(llama_dir):
    (llama_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):
        _load(llama_dir)


def test_unreachable_hub_id(unreachable_hub):
    with pytest.raises(ConnectionError, match="could not be reached.*local path"):
        load_model(EngineConfig(model="someorg/some-model"), "cpu")


def test_quantization_mismatch_is_rejected(llama_dir):
    with pytest.raises(ValueError, match="quant_method"):
        load_model(EngineConfig(model=str(llama_dir), quantization="awq"), "cpu")
    config = json.loads((llama_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (llama_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'bitsandbytes'"):
        _load(llama_dir)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_dtype_on_gpu_runs_an_fp32_checkpoint_in_bf16(tmp_path):
    hf_model = tiny_hf_model("qwen3")
    hf_model.save_pretrained(tmp_path)  # float32 weights and torch_dtype
    model, _, _ = load_model(EngineConfig(model=str(tmp_path)), "cuda")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert all(p.is_cuda for p in model.parameters())
    prompt = PROMPTS[1]
    runner = PagedRunner(model, block_size=4, num_blocks=16)
    ours = runner.step({runner.add_sequence(): prompt})[0].cpu()
    _, ref = greedy_reference(hf_model, prompt, 0)
    assert_logits_close(ours, ref, rtol=3e-2, what="bf16 prefill on the GPU")
