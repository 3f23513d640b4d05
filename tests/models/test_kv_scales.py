"""A checkpoint's FP8 KV-cache scales (self_attn.k_scale / v_scale, the older kv_scale, and
compressed-tensors' k_proj / v_proj output_scale): loaded per layer, used by the fused rotary +
store kernel (divide; its interpreted check is in tests/kernels/test_kv_cache_fp8.py) and by
attention (multiply) when the cache is FP8, ignored with a full-precision cache."""

import pytest
import torch
from helpers.models import (  # noqa: F401  (single_thread: autouse fixture)
    build_model,
    checkpoint_weights,
    paged_logits,
    single_thread,
    tiny_hf_model,
)

from tinypaged.models.kv_scales import kv_scale_target
from tinypaged.models.layers import Attention

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")
FP8 = torch.float8_e4m3fn
PROMPTS = [[5, 17, 99, 3, 250, 42, 7, 8, 9, 10], list(range(11, 31))]


def test_names():
    assert kv_scale_target("model.layers.3.self_attn.k_scale") == ("model.layers.3.self_attn.attn",
                                                                   "k")
    assert kv_scale_target("model.layers.0.self_attn.kv_scale")[1] == "kv"
    assert kv_scale_target("model.layers.0.self_attn.v_proj.output_scale")[1] == "v"
    assert kv_scale_target("model.layers.0.self_attn.attn.v_scale")[1] == "v"
    assert kv_scale_target("model.layers.0.self_attn.q_scale")[1] == ""
    assert kv_scale_target("model.layers.0.self_attn.k_proj.weight_scale") is None


def run(model, kv_dtype):
    return paged_logits(model, PROMPTS, 2, kv_dtype)


def attention_layers(model):
    return [m for m in model.modules() if isinstance(m, Attention)]


@pytest.mark.parametrize("style", ["k_v_scale", "kv_scale", "output_scale"])
def test_checkpoint_scales_are_used_with_an_fp8_cache(style):
    """Scales of amax / 448 from an fp32 run (far from 1.0 on this tiny model): the cache holds
    k / k_scale (its largest values near e4m3's 448) and attention multiplies back, so the
    logits stay as close to the fp32 cache's as with scale 1.0 (within 5% relative L2, 4.2%
    measured; a scale applied on one side only would be off by the scale's factor)."""
    hf = tiny_hf_model("llama")
    weights = checkpoint_weights(hf)
    dense = build_model(hf.config, weights)
    ref = run(dense, None)
    # per layer amax of what the fp32 cache stored (the rotated keys, the values)
    amax = [(a.k_cache.abs().max().item(), a.v_cache.abs().max().item())
            for a in attention_layers(dense)]
    unscaled_err = ((run(dense, FP8) - ref).norm() / ref.norm()).item()
    for i, (ka, va) in enumerate(amax):
        p = f"model.layers.{i}.self_attn"
        ks, vs = torch.tensor(ka / 448), torch.tensor(va / 448)
        if style == "k_v_scale":
            weights.update({f"{p}.k_scale": ks, f"{p}.v_scale": vs})
        elif style == "kv_scale":
            weights[f"{p}.kv_scale"] = torch.maximum(ks, vs)
        else:
            weights.update({f"{p}.k_proj.output_scale": ks.reshape(1),
                            f"{p}.v_proj.output_scale": vs.reshape(1)})
    model = build_model(hf.config, weights)
    layers = attention_layers(model)
    want = max(amax[1]) if style == "kv_scale" else amax[1][0]
    assert layers[1].k_scale == pytest.approx(want / 448) and abs(want / 448 - 1) > 0.5
    assert torch.equal(run(model, None), ref)  # a full-precision cache ignores the scales
    scaled = run(model, FP8)
    err = ((scaled - ref).norm() / ref.norm()).item()
    # the cache holds k / k_scale: near e4m3's top
    assert layers[0].k_cache.float().abs().max() > 100
    print(f"fp8 KV cache, relative L2 of the logits: scales {err:.4f}, 1.0 {unscaled_err:.4f}")
    assert 0 < err < 0.05 and err < 1.1 * unscaled_err


def test_bad_scale_is_named():
    hf = tiny_hf_model("llama")
    weights = checkpoint_weights(hf)
    weights["model.layers.0.self_attn.k_scale"] = torch.tensor([0.1, 0.2])
    with pytest.raises(ValueError, match=r"self_attn\.k_scale.*one value"):
        build_model(hf.config, weights)
    weights["model.layers.0.self_attn.k_scale"] = torch.tensor(0.0)
    with pytest.raises(ValueError, match="positive"):
        build_model(hf.config, weights)
