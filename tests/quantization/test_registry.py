"""The registry of quantization formats: every name resolves to a QuantizationMethod, a
checkpoint's format is detected from its config or its .gguf file, the engine config and the CLI
accept exactly the registered names, and a format added to the registry alone is loaded."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.models import (  # noqa: F401  (single_thread: autouse fixture)
    PagedRunner,
    single_thread,
    tiny_hf_model,
)
from torch import nn
from transformers import PretrainedConfig

from tinypaged.config import EngineConfig
from tinypaged.entrypoints.cli import build_parser
from tinypaged.models.loader import load_model
from tinypaged.quantization import registry
from tinypaged.quantization.awq import AWQConfig
from tinypaged.quantization.base import QuantizationMethod
from tinypaged.quantization.gguf import GGUFConfig
from tinypaged.quantization.gptq import GPTQConfig

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
       "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 8, "group_size": 64, "desc_act": True, "sym": True,
        "checkpoint_format": "gptq_v2"}


def test_every_name_resolves_to_a_concrete_quantization_method():
    assert set(registry.QUANTIZATION_FORMATS) == {"awq", "gptq", "gguf", "fp8",
                                                  "compressed-tensors"}
    for name in registry.QUANTIZATION_FORMATS:
        cls = registry.get_quantization_config(name)
        assert issubclass(cls, QuantizationMethod) and not inspect.isabstract(cls), name
        assert cls.name == name  # the key is the quant_method the class answers to
    assert registry.get_quantization_config("awq") is AWQConfig
    assert registry.get_quantization_config("gptq") is GPTQConfig
    assert registry.get_quantization_config("gguf") is GGUFConfig


@pytest.mark.parametrize("name", ["bitsandbytes", "AWQ", ""])
def test_unknown_name_is_an_error_naming_the_known_ones(name):
    with pytest.raises(ValueError, match=f"got {name!r}") as error:
        registry.get_quantization_config(name)
    assert "awq, gptq, gguf" in str(error.value)


def test_detection_from_a_config():
    """config.json's dict or a transformers config: the declared quant_method, which builds
    the registered class from that same config."""
    assert registry.detect_quantization({"model_type": "llama"}) is None
    assert registry.detect_quantization({"quantization_config": None}) is None
    for raw, expected in ((AWQ, AWQConfig(group_size=128)),
                          (GPTQ, GPTQConfig(bits=8, group_size=64, desc_act=True, version=2))):
        for config in ({"model_type": "llama", "quantization_config": raw},
                       PretrainedConfig(quantization_config=raw)):
            name = registry.detect_quantization(config)
            assert name == raw["quant_method"]
            quant = registry.get_quantization_config(name).from_config(
                registry.quantization_config_of(config))
            assert quant == expected
    # a method no format has is reported as written: the loader names it in its error
    assert registry.detect_quantization(
        {"quantization_config": {"quant_method": "bitsandbytes"}}) == "bitsandbytes"


def test_detection_from_a_gguf_file_and_a_model_directory(tmp_path):
    assert registry.detect_quantization(tmp_path / "SmolLM2.Q4_1.gguf") == "gguf"
    assert registry.detect_quantization(str(tmp_path / "Model.Q8_0.GGUF")) == "gguf"
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": GPTQ}))
    assert registry.detect_quantization(tmp_path) == "gptq"
    assert registry.detect_quantization(str(tmp_path)) == "gptq"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert registry.detect_quantization(tmp_path) is None


@pytest.mark.parametrize("method", [AWQConfig, GPTQConfig])
def test_a_config_of_another_format_is_refused(method):
    other = "gptq" if method.name == "awq" else "awq"
    with pytest.raises(ValueError, match=f"quant_method is '{other}', not '{method.name}'"):
        method.from_config({"quant_method": other, "bits": 4, "group_size": 128})
    assert method.from_config({"bits": 4, "group_size": 128}).group_size == 128  # none: its own


def test_engine_config_accepts_exactly_the_registered_names():
    for name in registry.QUANTIZATION_FORMATS:
        assert EngineConfig(quantization=name).quantization == name
    assert EngineConfig().quantization is None
    with pytest.raises(ValueError, match="awq, gptq, gguf, fp8.*got 'int3'"):
        EngineConfig(quantization="int3")


def test_cli_accepts_exactly_the_registered_names():
    parser = build_parser()
    for command in (["serve"], ["generate", "hi"], ["chat"]):
        for name in registry.QUANTIZATION_FORMATS:
            assert parser.parse_args([*command, "--quantization", name]).quantization == name
    serve = parser._subparsers._group_actions[0].choices["serve"]
    action = next(a for a in serve._actions if "--quantization" in a.option_strings)
    assert list(action.choices) == list(registry.QUANTIZATION_FORMATS)
    for name, fmt in registry.QUANTIZATION_FORMATS.items():
        assert f"{name} = {fmt.description}" in action.help


def test_config_and_registry_import_no_torch():
    """EngineConfig and the CLI read the names at import: the registry must stay light."""
    code = ("import sys, tinypaged.config, tinypaged.quantization.registry as r; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "print(list(r.QUANTIZATION_FORMATS))")
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['awq', 'gptq', 'gguf', 'fp8', 'compressed-tensors']"


class TransposedWeights(QuantizationMethod):
    """A toy format, for the test below: the checkpoint's `weight [out, in]` is repacked after
    loading into `weight_t [in, out]` (as GPTQ repacks into AWQ's layout), and apply() reads only
    the repacked tensor."""

    name = "transposed"

    @classmethod
    def from_config(cls, quantization_config: dict) -> TransposedWeights:
        return cls()

    def create_weights(self, layer: nn.Module, input_size: int,
                       output_size_per_partition: int, params_dtype: torch.dtype) -> None:
        weight = nn.Parameter(torch.empty(output_size_per_partition, input_size,
                                          dtype=params_dtype), requires_grad=False)
        weight.output_dim, weight.input_dim = 0, 1
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight_t = layer.weight.data.t().contiguous()
        del layer.weight
        layer.register_buffer("weight_t", weight_t)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = x @ layer.weight_t
        return y if bias is None else y + bias


def test_a_format_added_to_the_registry_alone_is_loaded(tmp_path, monkeypatch):
    """One class and one registry entry: the loader detects the checkpoint's quant_method, builds
    every linear through the class, repacks after loading, and the logits equal the dense
    model's."""
    hf_model = tiny_hf_model("qwen2")  # q/k/v biases: apply() gets them
    hf_model.save_pretrained(tmp_path)
    dense, _, _ = load_model(EngineConfig(model=str(tmp_path)), "cpu")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "transposed"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'transposed'.*'awq', 'gptq', 'gguf'"):
        load_model(EngineConfig(model=str(tmp_path)), "cpu")

    monkeypatch.setitem(registry.QUANTIZATION_FORMATS, "transposed", registry.QuantizationFormat(
        f"{__name__}:TransposedWeights", "the test's toy format"))
    assert EngineConfig(quantization="transposed").quantization == "transposed"
    model, _, _ = load_model(EngineConfig(model=str(tmp_path)), "cpu")
    linears = [m for m in model.modules() if hasattr(m, "quant_config")]
    assert linears and all(isinstance(m.quant_config, TransposedWeights) for m in linears)
    assert all(hasattr(m, "weight_t") and not hasattr(m, "weight") for m in linears)

    prompt = [5, 17, 99, 3, 250, 42, 7]
    logits = []
    for m in (dense, model):
        runner = PagedRunner(m, block_size=4, num_blocks=8)
        seq = runner.add_sequence()
        logits.append(runner.step({seq: prompt})[seq])
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
