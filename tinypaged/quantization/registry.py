"""The one list of quantization formats: name -> the QuantizationMethod subclass that runs it.

Every place that names a format reads it here: EngineConfig's check of `quantization`, the CLI's
--quantization choices and help, and the loader, which pairs the engine's `quantization` with the
format the checkpoint declares (`detect_quantization`). config.py and the CLI import this module
at start, so it imports no torch: a format's class is imported the first time it is asked for
(`get_quantization_config`).
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from tinypaged.quantization.base import QuantizationMethod


class QuantizationFormat(NamedTuple):
    class_path: str  # "module:Class" of the format's QuantizationMethod subclass
    description: str  # what checkpoints it reads, for --help


# The key is the `quant_method` the format's checkpoints declare in config.json (vLLM's
# QUANTIZATION_METHODS are these keys).
QUANTIZATION_FORMATS: dict[str, QuantizationFormat] = {
    "awq": QuantizationFormat("tinypaged.quantization.awq:AWQConfig",
                              "AutoAWQ int4 'gemm' checkpoints"),
    "gptq": QuantizationFormat("tinypaged.quantization.gptq:GPTQConfig",
                               "AutoGPTQ / GPTQModel int4 and int8 checkpoints"),
    "gguf": QuantizationFormat("tinypaged.quantization.gguf:GGUFConfig",
                               "llama.cpp .gguf files (weights stay in their blocks)"),
    "fp8": QuantizationFormat("tinypaged.quantization.fp8:Fp8Config",
                              "FP8 e4m3 checkpoints (per-tensor or block-wise scales); on a "
                              "bf16/fp16 checkpoint, quantize the weights at load"),
    "compressed-tensors": QuantizationFormat(
        "tinypaged.quantization.fp8:CompressedTensorsFp8Config",
        "llm-compressor FP8 / FP8_DYNAMIC checkpoints (float-quantized)"),
}
# formats that can also quantize a dense checkpoint's weights as they load (vLLM's online FP8):
# their class has an `online()` constructor
ONLINE_QUANTIZATION = ("fp8",)


def check_quantization(name: str) -> None:
    """Raise ValueError, naming the known formats, unless `name` is one of them."""
    if name not in QUANTIZATION_FORMATS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_FORMATS)} (or "
                         f"None: read it from the checkpoint), got {name!r}")


def get_quantization_config(name: str) -> type[QuantizationMethod]:
    """The QuantizationMethod subclass of format `name` (its module imported now)."""
    check_quantization(name)
    module, _, class_name = QUANTIZATION_FORMATS[name].class_path.partition(":")
    return getattr(importlib.import_module(module), class_name)


def quantization_config_of(config: Any) -> dict | None:
    """A model config's `quantization_config` as a dict (None: dense weights). `config` is
    config.json's dict or a transformers config, whose quantization_config may be an object."""
    raw = config.get("quantization_config") if isinstance(config, dict) else \
        getattr(config, "quantization_config", None)
    if raw is not None and not isinstance(raw, dict):
        raw = raw.to_dict()
    return raw or None


def detect_quantization(checkpoint: Any) -> str | None:
    """The format a checkpoint is stored in, None for dense weights. `checkpoint` is a .gguf
    file (-> "gguf"), a model directory (its config.json is read), or a model config (as for
    quantization_config_of). The result is the config's `quant_method` as written, even when no
    format here has that name: the caller says what to do about it."""
    if isinstance(checkpoint, (str, os.PathLike)):
        path = Path(checkpoint)
        if path.suffix.lower() == ".gguf":
            return "gguf"
        checkpoint = json.loads((path / "config.json").read_text())
    return (quantization_config_of(checkpoint) or {}).get("quant_method")
