"""A checkpoint's FP8 KV-cache scales: per layer, one for the keys and one for the values.

FP8 checkpoints made for an FP8 KV cache carry per-tensor scales (vLLM's names):

    model.layers.{i}.self_attn.k_scale, .v_scale        (AutoFP8, llm-compressor, vLLM)
    model.layers.{i}.self_attn.kv_scale                 (older: one scale for both)
    model.layers.{i}.self_attn.{k,v}_proj.output_scale  (older compressed-tensors)
    model.layers.{i}.self_attn.attn.{k,v}_scale         (vLLM's own module path)

With `kv_cache_dtype="fp8"` the cache then stores k / k_scale and v / v_scale (the fused
rotary + store kernel divides) and attention multiplies them back (kernels/attention.py's score
scale times k_scale, its output times v_scale: per-tensor scales commute with the softmax and
the weighted sum). With a full-precision cache the scales are unused, as in vLLM; without them
an FP8 cache uses 1.0. `q_scale` / `prob_scale` (for FP8 attention math, which tinypaged does
not do) are read and ignored.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

_KV_SCALE = re.compile(
    r"^(?P<attn>.*\.self_attn)\.(?:attn\.)?"
    r"(?:(?P<which>[kv])_scale|kv_scale|(?P<proj>[kv])_proj\.(?:output_scale|kv_scale)"
    r"|(?P<unused>q_scale|prob_scale))$")


def kv_scale_target(name: str) -> tuple[str, str] | None:
    """A checkpoint tensor name -> (the layer's attention module path, "k" | "v" | "kv" | ""),
    "" for scales that are read and ignored; None for any other tensor."""
    match = _KV_SCALE.match(name)
    if match is None:
        return None
    if match.group("unused"):
        return match.group("attn") + ".attn", ""
    return match.group("attn") + ".attn", match.group("which") or match.group("proj") or "kv"


def load_kv_scale(model: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Set the attention module's k_scale / v_scale from `tensor` if `name` is a KV-cache scale
    (False: not one, the caller loads it as a weight)."""
    target = kv_scale_target(name)
    if target is None:
        return False
    path, which = target
    try:
        attn = model.get_submodule(path)
    except AttributeError:
        return False  # no such layer: the caller names the tensor as unexpected
    if tensor.numel() != 1:
        raise ValueError(f"KV-cache scale {name!r} must hold one value (per tensor); got shape "
                         f"{tuple(tensor.shape)}")
    value = float(tensor.float().reshape(-1)[0])
    if not which:
        return True
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"KV-cache scale {name!r} is {value}: it must be positive and finite")
    for part in which:
        setattr(attn, f"{part}_scale", value)
    return True
