"""A LoRA adapter in the PEFT format, read from disk into the CPU cache.

PEFT (and most fine-tuning tools) write a folder with `adapter_config.json` and
`adapter_model.safetensors`; for every adapted linear `W [out, in]` of the base model the
safetensors hold

    base_model.model.<module>.lora_A.weight   A [r, in]
    base_model.model.<module>.lora_B.weight   B [out, r]

and the adapted layer computes y = x W^T + scaling * (x A^T) B^T, with scaling = lora_alpha / r,
or lora_alpha / sqrt(r) with `use_rslora`. The scaling is folded into B here (in float32), so the
kernels only add. Supported: the attention and MLP projections q/k/v/o/gate/up/down and the fused
qkv_proj / gate_up_proj of checkpoints that store them fused (Phi-3), any rank up to
max_lora_rank, per-module ranks and alphas (`rank_pattern`, `alpha_pattern`), bias "none".
Anything else is refused with a clear error rather than silently served wrong.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

# HF module name -> (tinypaged module, shard): the fused layers take their shards' adapters.
TARGETS = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "qkv_proj": ("qkv_proj", None), "o_proj": ("o_proj", None),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "gate_up_proj": ("gate_up_proj", None), "down_proj": ("down_proj", None),
}  # fmt: skip
_NOT_LINEAR = ("embed_tokens", "lm_head", "wte", "embed_in", "embed_out")


@dataclass
class LoRAAdapter:
    """One adapter on the CPU: `weights[(module, shard)] = (A [r, in], B [out, r] * scaling)`,
    float32; `module` is tinypaged's module name (model.layers.0.self_attn.qkv_proj), `shard` the
    fused layer's shard (None: the whole layer)."""

    name: str
    int_id: int
    rank: int  # the largest rank of its modules
    weights: dict[tuple[str, object], tuple[torch.Tensor, torch.Tensor]]
    path: str = ""


def _fail(path: Path, message: str) -> ValueError:
    return ValueError(f"LoRA adapter {str(path)!r}: {message}")


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: a key matches a module name that ends in it."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def read_config(path: Path) -> dict:
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise _fail(path, "no adapter_config.json here; give the folder a PEFT adapter was "
                          "saved to (model.save_pretrained)")
    config = json.loads(config_file.read_text())
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise _fail(path, f"peft_type {peft_type!r} is not supported; only LORA adapters are")
    if config.get("use_dora"):
        raise _fail(path, "DoRA adapters (use_dora=true) are not supported; merge the DoRA "
                          "adapter into the model or train a plain LoRA")
    if config.get("bias", "none") != "none":
        raise _fail(path, f"bias={config['bias']!r} is not supported; only bias='none'")
    if config.get("modules_to_save"):
        raise _fail(path, f"modules_to_save {config['modules_to_save']} (fully trained copies "
                          "of whole modules) are not supported")
    targets = config.get("target_modules")
    if isinstance(targets, (list, tuple)):
        _check_targets(path, [str(t).split(".")[-1] for t in targets])
    return config


def _check_targets(path: Path, names: list[str]) -> None:
    for name in names:
        if name in _NOT_LINEAR:
            raise _fail(path, f"adapters on the embedding or lm_head ({name!r}) are not "
                              f"supported; target only {', '.join(TARGETS)}")
        if name not in TARGETS:
            raise _fail(path, f"unknown target module {name!r}; supported: {', '.join(TARGETS)}")


def load_adapter(path: str | Path, name: str, int_id: int, max_lora_rank: int) -> LoRAAdapter:
    """Read a PEFT adapter folder (see the module docstring); raises ValueError naming what is
    unsupported or inconsistent."""
    from safetensors.torch import load_file

    config_path, path = str(path), Path(path)
    config = read_config(path)
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise _fail(path, "no adapter_model.safetensors here (adapter_model.bin is not read: "
                          "save with safe_serialization=True)")
    tensors = load_file(str(weights_file))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if "lora_embedding" in key or "lora_magnitude" in key:
            raise _fail(path, f"tensor {key!r}: embedding adapters and DoRA magnitudes are not "
                              "supported")
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.(lora_A|lora_B)(?:\.\w+)?\.weight", key)
        if m is None:
            raise _fail(path, f"unexpected tensor {key!r}; expected <module>.lora_A.weight and "
                              "<module>.lora_B.weight only (bias='none')")
        pairs.setdefault(m.group(1), {})[m.group(2)] = tensor
    if not pairs:
        raise _fail(path, "adapter_model.safetensors holds no lora_A / lora_B tensors")
    _check_targets(path, sorted({module.split(".")[-1] for module in pairs}))
    alpha, rslora = config.get("lora_alpha", config.get("r", 8)), config.get("use_rslora", False)
    weights, max_rank = {}, 0
    for module, ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise _fail(path, f"module {module!r} has {sorted(ab)} but needs lora_A and lora_B")
        a, b = ab["lora_A"].float(), ab["lora_B"].float()  # [r, in], [out, r]
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
            raise _fail(path, f"module {module!r}: lora_A {tuple(a.shape)} and lora_B "
                              f"{tuple(b.shape)} do not make a rank-r pair")
        if rank > max_lora_rank:
            raise _fail(path, f"module {module!r} has rank {rank} > max_lora_rank="
                              f"{max_lora_rank}; start the engine with max_lora_rank >= {rank}")
        module_alpha = _pattern_value(config.get("alpha_pattern") or {}, module, alpha)
        scaling = module_alpha / (math.sqrt(rank) if rslora else rank)
        parent, _, leaf = module.rpartition(".")
        target, shard = TARGETS[leaf]
        weights[(f"{parent}.{target}", shard)] = (a.contiguous(), (b * scaling).contiguous())
        max_rank = max(max_rank, rank)
    return LoRAAdapter(name, int_id, max_rank, weights, config_path)
