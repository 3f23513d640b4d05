"""The configuration of a draft head (heads.py), read from its checkpoint and checked against
the target, and the one change the target needs before its CUDA graphs are captured
(`prepare_target`: the layers whose hidden states it keeps).

    eagle3   the head's config.json: HF layout (a Llama layer config with `draft_vocab_size`,
             `eagle_config`) or `speculators` layout (`speculators_model_type: "eagle3"`,
             `transformer_layer_config`, `norm_before_residual` defaulting to true); the three
             target layers from `eagle_aux_hidden_state_layer_ids` (top level, in
             `eagle_config`, or `eagle_config.layer_ids`), else vLLM's default (2, L // 2, L - 3)
    eagle    an HF-layout EAGLE head; the target's final normed hidden state
    mtp      the target's own checkpoint (num_nextn_predict_layers >= 1, Glm4MoeForCausalLM);
             the target's final normed hidden state
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

_REFUSED_EAGLE3 = ("norm_before_fc", "fc_norm", "norm_output")  # newer speculators variants


@dataclasses.dataclass
class HeadConfig:
    method: str  # "eagle3", "eagle", "mtp"
    path: Path  # the head's checkpoint directory (the target's for MTP)
    layer: dict  # the draft layer's Llama-style config fields
    aux_layers: tuple[int, ...]  # the target's hidden states the head reads
    draft_vocab_size: int | None = None
    target_hidden_size: int | None = None
    norm_before_residual: bool = False
    names: frozenset = frozenset()  # the checkpoint's tensor names


def _tensor_names(path: Path, prefix: str = "") -> frozenset:
    from safetensors import safe_open

    from tinypaged.models.loader import safetensors_files

    names = set()
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as handle:
            names.update(n for n in handle.keys() if n.startswith(prefix))  # noqa: SIM118
    return frozenset(names)


def read_head_config(method: str, model: str | None, target_dir: Path,
                     target_hf_config) -> HeadConfig:
    """The head's configuration, checked against the target; ValueError saying what is wrong."""
    from tinypaged.models.loader import resolve_model

    num_layers = target_hf_config.num_hidden_layers
    if method == "mtp":
        if model is not None and resolve_model(model) != Path(target_dir).resolve():
            raise ValueError(
                "speculative_config: method 'mtp' drafts with the target checkpoint's own "
                f"multi-token-prediction layer; 'model' ({model!r}) must be the target or absent"
            )
        arch = list(getattr(target_hf_config, "architectures", None) or [])
        if not int(getattr(target_hf_config, "num_nextn_predict_layers", 0) or 0):
            raise ValueError(
                "speculative_config: method 'mtp' needs a checkpoint with multi-token-prediction "
                "layers (num_nextn_predict_layers >= 1 in config.json, as GLM-4.5 / "
                f"GLM-4.5-Air); {target_dir} has none"
            )
        if "Glm4MoeForCausalLM" not in arch:
            raise ValueError(
                f"speculative_config: method 'mtp' is implemented for Glm4MoeForCausalLM "
                f"(GLM-4.5 / GLM-4.5-Air), not {arch}"
            )
        names = _tensor_names(Path(target_dir), f"model.layers.{num_layers}.")
        return HeadConfig("mtp", Path(target_dir), {}, (num_layers,), names=names)
    path = resolve_model(model)
    raw = json.loads((path / "config.json").read_text())
    speculators = raw.get("speculators_model_type")
    if speculators is not None:
        if speculators != method:
            raise ValueError(
                f"speculative_config: method {method!r} but {model} is a speculators "
                f"{speculators!r} checkpoint; set method to {speculators!r}"
            )
        if method != "eagle3":
            raise ValueError(
                "speculative_config: speculators-format checkpoints are supported for eagle3 "
                f"only; {model} is {speculators!r}"
            )
        layer = dict(raw.get("transformer_layer_config") or {})
        before_residual = bool(raw.get("norm_before_residual", True))
    else:
        layer, before_residual = raw, bool(raw.get("norm_before_residual", False))
    for key in _REFUSED_EAGLE3:
        if raw.get(key):
            raise ValueError(f"speculative_config: {model}: the EAGLE-3 variant {key}=true is "
                             "not supported by tinypaged")
    eagle_config = raw.get("eagle_config") or layer.get("eagle_config") or {}
    if method == "eagle3":
        if eagle_config.get("use_aux_hidden_state") is False:
            raise ValueError(f"speculative_config: {model} sets use_aux_hidden_state=false, "
                             "an EAGLE-3 head without the three-layer input is not supported")
        ids = (raw.get("eagle_aux_hidden_state_layer_ids")
               or layer.get("eagle_aux_hidden_state_layer_ids")
               or eagle_config.get("eagle_aux_hidden_state_layer_ids")
               or eagle_config.get("layer_ids")
               or (2, num_layers // 2, num_layers - 3))
        aux = tuple(int(i) for i in ids)
        if len(aux) != 3 or len(set(aux)) != 3 or not all(0 <= i < num_layers for i in aux):
            raise ValueError(
                f"speculative_config: EAGLE-3 reads three distinct layers of the target's "
                f"{num_layers}; got eagle_aux_hidden_state_layer_ids {list(aux)} (set them in "
                f"{path / 'config.json'})"
            )
        aux = tuple(sorted(aux))  # the target keeps them in layer order
    else:
        aux = (num_layers,)
    names = _tensor_names(path)
    return HeadConfig(
        method, path, layer, aux,
        draft_vocab_size=raw.get("draft_vocab_size") or layer.get("draft_vocab_size"),
        target_hidden_size=raw.get("target_hidden_size") or layer.get("target_hidden_size"),
        norm_before_residual=before_residual, names=names,
    )


def prepare_target(executor: Any, config: Any) -> None:
    """Before the target's runner captures CUDA graphs: with an EAGLE / MTP head, make the
    target keep the hidden states the head reads (DecoderForCausalLM.aux_layers)."""
    from tinypaged.spec_decode.config import HEADS, SpeculativeConfig

    spec = SpeculativeConfig.from_dict(config.speculative_config)
    if spec.method not in HEADS:
        return
    if config.tensor_parallel_size != 1:
        raise ValueError(
            f"speculative_config: method {spec.method!r} runs its head on one device; "
            "tensor_parallel_size > 1 cannot be combined with it in tinypaged yet"
        )
    head = read_head_config(spec.method, spec.model, executor.model_dir, executor.hf_config)
    executor.model.aux_layers = head.aux_layers
