"""Reading a checkpoint's rotary-embedding settings, whichever transformers wrote its config.

transformers 5.x keeps them in `config.rope_parameters` ({"rope_theta", "rope_type",
"partial_rotary_factor", and the scaling fields such as Llama 3's "factor", "low_freq_factor",
"high_freq_factor", "original_max_position_embeddings"}); 4.x configs have `rope_theta`,
`partial_rotary_factor` and an optional `rope_scaling` dict ("type" or "rope_type" + fields) as
top-level attributes. Both read the same here. The angle table itself is built by
`tinypaged.kernels.build_cos_sin_cache` in float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tinypaged import kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    rotary_dim: int  # dims of each head that rotate (head_dim * partial_rotary_factor)
    max_position: int
    interleaved: bool = False  # GLM: adjacent pairs; otherwise neox halves
    scaling: dict | None = field(default=None, hash=False)  # HF rope_scaling fields

    def cos_sin_cache(self) -> torch.Tensor:
        """[max_position, rotary_dim] float32 on the current default device."""
        return kernels.build_cos_sin_cache(
            self.rotary_dim, self.max_position, self.theta, self.scaling,
            dtype=torch.float32, device=torch.get_default_device(),
        )


def read_rope(hf_config, head_dim: int, interleaved: bool = False,
              default_partial_factor: float = 1.0) -> RopeSpec:
    fields = dict(getattr(hf_config, "rope_scaling", None) or {})  # 4.x (an alias in 5.x)
    fields.update(getattr(hf_config, "rope_parameters", None) or {})  # 5.x
    theta = fields.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0
    partial = (
        fields.get("partial_rotary_factor")
        or getattr(hf_config, "partial_rotary_factor", None)
        or default_partial_factor
    )
    rope_type = fields.get("rope_type") or fields.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} in config.json is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                "original_max_position_embeddings")}
    missing = [k for k in needed.get(rope_type, ()) if k not in fields]
    if missing:
        raise ValueError(f"rope type {rope_type!r} needs {', '.join(missing)} in config.json")
    scaling = None
    if rope_type != "default":
        scaling = {"rope_type": rope_type, **{k: fields[k] for k in needed[rope_type]}}
    return RopeSpec(
        theta=float(theta),
        rotary_dim=int(head_dim * partial),
        max_position=int(hf_config.max_position_embeddings),
        interleaved=interleaved,
        scaling=scaling,
    )
