"""Loader pieces that need no model class: model resolution, hub errors, config, dtype, weights."""

from __future__ import annotations

import json
import time
import warnings

import pytest
import torch

from tinypaged.models import loader


def _tiny_llama(tmp_path, **save_kwargs):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path, **save_kwargs)
    return model


# ------------------------------------------------------------------ resolve_model
def test_local_directory_resolves_to_itself(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert loader.resolve_model(str(tmp_path)) == tmp_path.resolve()


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        loader.resolve_model(str(tmp_path))
    (tmp_path / "model.Q4_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError, match=r"model\.Q4_0\.gguf: pass that file itself"):
        loader.resolve_model(str(tmp_path))


def test_non_gguf_file_is_rejected(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        loader.resolve_model(str(tmp_path / "weights.bin"))


@pytest.mark.parametrize("name", ["./missing-model", "/no/such/dir", "a/b/c", "model.gguf"])
def test_missing_paths_are_not_mistaken_for_hub_ids(name, unreachable_hub):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        loader.resolve_model(name)


def test_unreachable_hub_fails_fast_with_a_local_path_hint(unreachable_hub):
    start = time.monotonic()
    with pytest.raises(ConnectionError) as info:
        loader.resolve_model("someorg/some-model")
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "could not be reached" in message and "someorg/some-model" in message
    assert "local path" in message and "--local-dir" in message


def test_client_failure_after_a_good_probe_gives_the_same_error(unreachable_hub, monkeypatch):
    monkeypatch.setattr(loader, "_hub_reachable", lambda endpoint: True)
    with pytest.raises(ConnectionError, match="could not be reached"):
        loader.resolve_model("someorg/some-model")


def test_offline_mode_names_hf_hub_offline(unreachable_hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(loader, "_hub_reachable", lambda endpoint: pytest.fail("probed offline"))
    with pytest.raises(ConnectionError, match="HF_HUB_OFFLINE"):
        loader.resolve_model("someorg/some-model")


def test_unreachable_hub_uses_the_local_hf_cache(unreachable_hub):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = unreachable_hub / "models--someorg--cached-model"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (snapshot / "config.json").write_text("{}")
    assert loader.resolve_model("someorg/cached-model") == snapshot


# ------------------------------------------------------------------ config
def test_known_model_type_goes_through_autoconfig(tmp_path):
    _tiny_llama(tmp_path)
    config = loader.load_hf_config(tmp_path)
    assert type(config).__name__ == "LlamaConfig"
    assert config.num_key_value_heads == 2 and config.architectures == ["LlamaForCausalLM"]


def test_chatglm_config_is_read_without_remote_code(tmp_path):
    raw = {"architectures": ["ChatGLMModel"], "model_type": "chatglm", "num_layers": 2,
           "multi_query_group_num": 2, "kv_channels": 8, "padded_vocab_size": 64,
           "auto_map": {"AutoConfig": "configuration_chatglm.ChatGLMConfig"},
           "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = loader.load_hf_config(tmp_path)
    assert config.model_type == "chatglm" and config.architectures == ["ChatGLMModel"]
    assert config.num_layers == 2 and config.multi_query_group_num == 2
    assert config.padded_vocab_size == 64 and config.kv_channels == 8
    assert loader._checkpoint_dtype(config) == torch.bfloat16


def test_unknown_model_type_keeps_its_fields_for_the_registry_error(tmp_path):
    raw = {"architectures": ["MysteryForCausalLM"], "model_type": "mystery", "hidden_size": 8}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = loader.load_hf_config(tmp_path)
    assert config.architectures == ["MysteryForCausalLM"] and config.hidden_size == 8


# ------------------------------------------------------------------ dtype
class _Cfg:
    def __init__(self, dtype):
        self.dtype = dtype


def test_auto_dtype_is_float32_on_cpu():
    assert loader.resolve_dtype("auto", _Cfg(torch.bfloat16), "cpu") == torch.float32


@pytest.mark.parametrize(
    "checkpoint, bf16_ok, expected",
    [
        (torch.bfloat16, True, torch.bfloat16),
        (torch.float16, True, torch.float16),
        ("float32", True, torch.bfloat16),  # vLLM: fp32 checkpoints run in bf16 on GPU
        (None, True, torch.bfloat16),
        (torch.bfloat16, False, torch.float16),  # pre-Ampere GPUs have no bf16
        (torch.float32, False, torch.float16),
    ],
)
def test_auto_dtype_on_gpu_follows_the_checkpoint(monkeypatch, checkpoint, bf16_ok, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_ok)
    assert loader.resolve_dtype("auto", _Cfg(checkpoint), "cuda") == expected


def test_explicit_dtype_is_honoured_and_warns_when_slow_on_cpu():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loader.resolve_dtype("float32", _Cfg(torch.bfloat16), "cpu") == torch.float32
    with pytest.warns(UserWarning, match="slower"):
        assert loader.resolve_dtype("float16", _Cfg(None), "cpu") == torch.float16
    assert loader.resolve_dtype("bfloat16", _Cfg(torch.float16), "cuda") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        loader.resolve_dtype("int8", _Cfg(None), "cpu")


# ------------------------------------------------------------------ weights
@pytest.mark.parametrize("sharded", [False, True])
def test_iterate_weights_yields_every_tensor_once(tmp_path, sharded):
    model = _tiny_llama(tmp_path, **({"max_shard_size": "20KB"} if sharded else {}))
    files = loader.safetensors_files(tmp_path)
    assert (len(files) > 1) == sharded
    weights = dict(loader.iterate_weights(tmp_path))
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"
                or not model.config.tie_word_embeddings}
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name


def test_no_safetensors_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="no safetensors.*pytorch_model.bin"):
        list(loader.iterate_weights(tmp_path))


def test_missing_shard_is_named(tmp_path):
    _tiny_llama(tmp_path, max_shard_size="20KB")
    victim = loader.safetensors_files(tmp_path)[-1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        list(loader.iterate_weights(tmp_path))
