"""Reading a checkpoint's rotary-embedding settings, whichever transformers wrote its config.

transformers 5.x keeps them in `config.rope_parameters` ({"rope_theta", "rope_type",
"partial_rotary_factor", and the scaling fields such as Llama 3's "factor", "low_freq_factor",
"high_freq_factor", "original_max_position_embeddings"}); models whose layers differ (Gemma 3's
local and global layers) nest one such dict per layer type. 4.x configs have `rope_theta`,
`partial_rotary_factor` and an optional `rope_scaling` dict ("type" or "rope_type" + fields) as
top-level attributes (Gemma 3: `rope_local_base_freq` for the local layers). All read the same
here.

The angle table is built in float32. Default, linear and llama3 frequencies are computed by
`tinypaged.kernels.build_cos_sin_cache`; for yarn, dynamic and longrope the inverse frequencies
and the attention factor (which scales cos and sin, i.e. the logits by its square) come from
transformers' own `modeling_rope_utils`, so they cannot drift from the reference:

- yarn (Qwen2.5 / Qwen3 long context): interpolated low frequencies, extrapolated high ones and
  a ramp between; attention factor 0.1 ln(factor) + 1 by default.
- dynamic (NTK): transformers grows the base only once a sequence outgrows
  max_position_embeddings; the engine never holds a longer sequence, so the frequencies are the
  ones transformers uses at that length (the plain base).
- longrope (Phi-3): `short_factor` per frequency for positions below
  original_max_position_embeddings and `long_factor` beyond, as vLLM tables them (transformers
  switches the whole sequence to the long factors once it is longer; both agree below).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tinypaged import kernels

TABLED_TYPES = ("default", "linear", "llama3")  # frequencies computed by build_cos_sin_cache
HF_TYPES = ("yarn", "dynamic", "longrope")  # frequencies from transformers.modeling_rope_utils
SUPPORTED_ROPE_TYPES = TABLED_TYPES + HF_TYPES


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    rotary_dim: int  # dims of each head that rotate (head_dim * partial_rotary_factor)
    max_position: int
    interleaved: bool = False  # GLM: adjacent pairs; otherwise neox halves
    scaling: dict | None = field(default=None, hash=False)  # HF rope_scaling fields
    # yarn / dynamic / longrope: transformers' inverse frequencies [rotary_dim / 2], and for
    # longrope the long ones used from position `long_from` on; cos and sin times the factor
    inv_freq: tuple[float, ...] | None = None
    long_inv_freq: tuple[float, ...] | None = None
    long_from: int = 0
    attention_factor: float = 1.0

    def cos_sin_cache(self) -> torch.Tensor:
        """[max_position, rotary_dim] float32 on the current default device."""
        device = torch.get_default_device()
        if self.inv_freq is None:
            return kernels.build_cos_sin_cache(
                self.rotary_dim, self.max_position, self.theta, self.scaling,
                dtype=torch.float32, device=device,
            )
        positions = torch.arange(self.max_position, dtype=torch.int64, device=device).float()
        inv_freq = torch.tensor(self.inv_freq, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq)  # [max_position, rotary_dim / 2]
        if self.long_inv_freq is not None:
            long = torch.tensor(self.long_inv_freq, dtype=torch.float32, device=device)
            freqs[self.long_from :] = torch.outer(positions[self.long_from :], long)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1) * self.attention_factor


def _rope_fields(hf_config, layer_type: str | None) -> dict:
    """The rope dict of `layer_type` (None: the model's only one), 4.x and 5.x alike."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})  # 5.x
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        return dict(params[layer_type])
    local_base = getattr(hf_config, "rope_local_base_freq", None)  # 4.x Gemma 3
    if layer_type == "sliding_attention" and local_base is not None:
        return {"rope_theta": local_base, "rope_type": "default"}
    fields = dict(getattr(hf_config, "rope_scaling", None) or {})  # 4.x (an alias in 5.x)
    fields.update(params)
    return fields


def _from_transformers(hf_config, rope_type: str, layer_type: str | None,
                       seq_len: int | None = None) -> tuple[tuple[float, ...], float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if not hasattr(hf_config, "standardize_rope_params"):
        raise ValueError(
            f"rope type {rope_type!r} needs a transformers config object (PretrainedConfig) to "
            f"compute its frequencies; got {type(hf_config).__name__}"
        )
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    try:
        inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", seq_len=seq_len,
                                                          **kwargs)
    except KeyError as e:
        raise ValueError(f"rope type {rope_type!r} needs {e} in config.json") from None
    return tuple(inv_freq.float().tolist()), float(factor)


def read_rope(hf_config, head_dim: int, interleaved: bool = False,
              default_partial_factor: float = 1.0, layer_type: str | None = None) -> RopeSpec:
    """The RopeSpec of `hf_config` (of its `layer_type` layers, for models whose layer types
    rotate differently)."""
    fields = _rope_fields(hf_config, layer_type)
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
    spec = RopeSpec(
        theta=float(theta),
        rotary_dim=int(head_dim * partial),
        max_position=int(hf_config.max_position_embeddings),
        interleaved=interleaved,
    )
    if rope_type in HF_TYPES:
        inv_freq, attention_factor = _from_transformers(hf_config, rope_type, layer_type)
        long_inv_freq, long_from = None, 0
        if rope_type == "longrope":
            long_from = int(fields["original_max_position_embeddings"])
            long_inv_freq, _ = _from_transformers(hf_config, rope_type, layer_type,
                                                  seq_len=long_from + 1)
        return RopeSpec(spec.theta, spec.rotary_dim, spec.max_position, interleaved,
                        inv_freq=inv_freq, long_inv_freq=long_inv_freq, long_from=long_from,
                        attention_factor=attention_factor)
    needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                "original_max_position_embeddings")}
    missing = [k for k in needed.get(rope_type, ()) if k not in fields]
    if missing:
        raise ValueError(f"rope type {rope_type!r} needs {', '.join(missing)} in config.json")
    if rope_type == "default":
        return spec
    scaling = {"rope_type": rope_type, **{k: fields[k] for k in needed[rope_type]}}
    return RopeSpec(spec.theta, spec.rotary_dim, spec.max_position, interleaved, scaling)
