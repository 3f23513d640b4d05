"""Rotary tables against transformers' own rotary-embedding modules, row by row.

For each rope type the cos/sin table our models index by position must equal what
transformers' rotary module returns for those positions (cos and sin already multiplied by the
attention factor). Longrope: positions below original_max_position_embeddings use the short
factors, the rest the long ones, which is what transformers uses for a sequence that long.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers.models import HF_KINDS, TINY

from tinypaged.models.rope import read_rope


def hf_cos_sin(kind: str, positions: torch.Tensor, layer_type: str | None = None):
    class_name, extra = HF_KINDS[kind]
    config = getattr(transformers, class_name)(**{**TINY, **extra})
    model = transformers.AutoModelForCausalLM.from_config(config)
    x = torch.zeros(1, len(positions), 8)
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    cos, sin = model.model.rotary_emb(x, positions[None], **kwargs)  # [1, T, rotary_dim]
    half = cos.shape[-1] // 2
    return config, torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1)


@pytest.mark.parametrize("kind,head_dim,positions,layer_type", [
    ("qwen3_yarn", 32, torch.arange(0, 256), None),
    ("llama_dynamic", 16, torch.arange(0, 256), None),
    ("phi3_longrope", 16, torch.arange(0, 64), None),  # short factors
    ("phi3_longrope", 16, torch.arange(64, 256), None),  # long factors
    ("gemma3", 16, torch.arange(0, 256), "sliding_attention"),
    ("gemma3", 16, torch.arange(0, 256), "full_attention"),  # linear scaling
])
def test_table_matches_transformers(kind, head_dim, positions, layer_type):
    config, want = hf_cos_sin(kind, positions, layer_type)
    table = read_rope(config, head_dim, layer_type=layer_type).cos_sin_cache()
    torch.testing.assert_close(table[positions], want, atol=1e-6, rtol=1e-6)


def test_yarn_scales_cos_and_sin_by_its_attention_factor():
    config, _ = hf_cos_sin("qwen3_yarn", torch.arange(1))
    rope = read_rope(config, 32)
    assert rope.attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    assert rope.cos_sin_cache()[0, 0].item() == pytest.approx(rope.attention_factor)


def test_gemma3_4x_config_fields():
    # transformers 4.x wrote Gemma 3's local base as `rope_local_base_freq` beside a global
    # `rope_theta` and `rope_scaling`
    from types import SimpleNamespace

    config = SimpleNamespace(max_position_embeddings=64, rope_theta=1e6, rope_local_base_freq=1e4,
                             rope_scaling={"rope_type": "linear", "factor": 8.0})
    local = read_rope(config, 16, layer_type="sliding_attention")
    full = read_rope(config, 16, layer_type="full_attention")
    assert (local.theta, local.scaling) == (1e4, None)
    assert (full.theta, full.scaling) == (1e6, {"rope_type": "linear", "factor": 8.0})
