"""FP8 mixture-of-experts models: a tiny random Qwen3-MoE written by hand as an FP8 checkpoint
(block-wise [128, 128] as Qwen3-*-FP8; per tensor, quant_method "fp8"; per channel,
compressed-tensors) gives transformers' greedy tokens and logits on the dequantized weights (the
CPU path, fp32 activations); `quantization="fp8"` on the dense checkpoint quantizes the experts
at load; the W8A8 path of the experts (Triton, interpreted) is close to their dequantized MLP."""

import json

import pytest
import torch
from helpers.models import (  # noqa: F401  (single_thread: autouse fixture)
    PagedRunner,
    assert_logits_close,
    check_prefill_then_decode,
    greedy_reference,
    single_thread,
)
from helpers.quantize import LINEARS, save_tiny
from safetensors.torch import load_file, save_file

from tinypaged.config import EngineConfig
from tinypaged.kernels import moe
from tinypaged.kernels.fp8 import FP8_MAX, dequantize_fp8
from tinypaged.models.loader import load_model
from tinypaged.models.moe_fp8 import Fp8FusedMoE

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")
PROMPTS = [[5, 17, 99, 3, 250, 42, 7], list(range(11, 31))]
# whole [128, 128] blocks in every linear and expert projection
SHAPES = dict(hidden_size=128, moe_intermediate_size=128, num_key_value_heads=4)
EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")


def quantize(w, fmt):
    """w [N, K] -> ({name suffix: tensor} in the format's layout, the dequantized w)."""
    w = w.float()
    if fmt == "block":
        N, K = w.shape
        s = w.reshape(N // 128, 128, K // 128, 128).abs().amax((1, 3)) / FP8_MAX
        q = (w.reshape(N // 128, 128, K // 128, 128) / s[:, None, :, None])
        q = q.to(torch.float8_e4m3fn).reshape(N, K)
        return {"weight": q, "weight_scale_inv": s}, dequantize_fp8(q, s, (128, 128))
    s = w.abs().amax(1, keepdim=True) / FP8_MAX if fmt == "channel" else w.abs().amax() / FP8_MAX
    q = (w / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": s}, q.float() * s


def is_quantized(name):
    prefix = name.removesuffix(".weight")
    return name.endswith(".weight") and (any(prefix.endswith(lin) for lin in LINEARS)
                                         or ".experts." in name)


def hf_state(tensors, num_experts):
    """Per-expert checkpoint tensors -> transformers' fused expert parameters."""
    state = {}
    for name, w in tensors.items():
        if ".experts." not in name:
            state[name] = w
    layers = {n.split(".mlp.experts.")[0] for n in tensors if ".mlp.experts." in n}
    for layer in layers:
        p = f"{layer}.mlp.experts"
        state[f"{p}.gate_up_proj"] = torch.stack([torch.cat(
            [tensors[f"{p}.{e}.gate_proj.weight"], tensors[f"{p}.{e}.up_proj.weight"]])
            for e in range(num_experts)])
        state[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight"]
                                               for e in range(num_experts)])
    return state


def fp8_moe_pair(tmp_path, fmt):
    """(checkpoint dir, transformers Qwen3-MoE holding its dequantized weights)."""
    hf_model = save_tiny("qwen3_moe", tmp_path, **SHAPES)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    dequantized = {}
    for name in [n for n in tensors if is_quantized(n)]:
        stored, dequantized[name] = quantize(tensors.pop(name), fmt)
        if fmt == "tensor":
            stored["weight_scale"] = stored["weight_scale"].reshape(())
        prefix = name.removesuffix(".weight")
        tensors.update({f"{prefix}.{k}": v for k, v in stored.items()})
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    if fmt == "channel":
        scheme = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                  "strategy": "channel"}
        inputs = dict(scheme, dynamic=True, strategy="token")
        q = {"quant_method": "compressed-tensors", "format": "float-quantized",
             "ignore": ["lm_head", "re:.*mlp.gate$"], "config_groups": {"group_0": {
                 "targets": ["Linear"], "weights": scheme, "input_activations": inputs}}}
    else:
        q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
        if fmt == "block":
            q["weight_block_size"] = [128, 128]
            q["modules_to_not_convert"] = ["lm_head", "model.layers.0.mlp.gate"]
    config["quantization_config"] = q
    (tmp_path / "config.json").write_text(json.dumps(config))
    _, unexpected = hf_model.load_state_dict(
        hf_state(dequantized, hf_model.config.num_experts), strict=False)
    assert not unexpected
    return tmp_path, hf_model


@pytest.mark.parametrize("fmt", ["block", "tensor", "channel"])
def test_fp8_moe_checkpoint_matches_dequantized_transformers(tmp_path, fmt):
    out, hf_model = fp8_moe_pair(tmp_path, fmt)
    model, _, _ = load_model(EngineConfig(model=str(out)), "cpu")
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, Fp8FusedMoE) and experts.w13_weight.dtype == torch.float8_e4m3fn
    assert experts.w13_weight_scale.shape == ((8, 2, 1) if fmt == "block" else (8, 256, 1))
    check_prefill_then_decode(PagedRunner(model, block_size=4, num_blocks=32), hf_model,
                              PROMPTS, 2, what=f"fp8 moe {fmt}")
    tokens = greedy_reference(hf_model, PROMPTS[0], 4)[0]
    runner = PagedRunner(model, block_size=4, num_blocks=32)
    seq, ids = runner.add_sequence(), list(PROMPTS[0])
    out_tokens = []
    for _ in range(4):
        logits = runner.step({seq: ids if not out_tokens else [out_tokens[-1]]})[seq]
        out_tokens.append(int(logits[-1].argmax()))
    assert out_tokens == tokens


def test_quantize_at_load_moe_is_close_to_the_dense_model(tmp_path):
    """quantization="fp8" on a dense Qwen3-MoE: every expert per-channel FP8. Logits equal
    transformers' on the round-to-nearest per-channel weights, and are within 15% (relative
    L2; 8.8% measured) of the dense model's on this tiny random model (fp32 activations)."""
    hf_model = save_tiny("qwen3_moe", tmp_path)
    model, _, _ = load_model(EngineConfig(model=str(tmp_path), quantization="fp8"), "cpu")
    experts = model.model.layers[1].mlp.experts
    E, two_i, H = experts.w13_weight.shape
    assert experts.w13_weight.dtype == experts.w2_weight.dtype == torch.float8_e4m3fn
    assert experts.w13_weight_scale.shape == (E, two_i, 1)
    assert experts.w2_weight_scale.shape == (E, H, 1)
    runner = PagedRunner(model, block_size=4, num_blocks=32)
    out = next(iter(runner.step({runner.add_sequence(): PROMPTS[1]}).values()))
    ref = greedy_reference(hf_model, PROMPTS[1], 0)[1][: len(PROMPTS[1])]
    err = ((out - ref).norm() / ref.norm()).item()
    print(f"quantize-at-load fp8 moe: relative L2 of the logits {err:.4f}")
    assert 0 < err < 0.15
    state = {}
    for name, w in hf_model.state_dict().items():
        if any(name.endswith(f"{lin}.weight") for lin in LINEARS):
            state[name] = quantize(w, "channel")[1]
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            state[name] = torch.stack([quantize(we, "channel")[1] for we in w])
    hf_model.load_state_dict(state, strict=False)
    ref = greedy_reference(hf_model, PROMPTS[1], 0)[1][: len(PROMPTS[1])]
    assert_logits_close(out, ref, what="online fp8 moe vs its round-to-nearest weights")


def test_w8a8_experts_of_a_block_checkpoint(tmp_path, monkeypatch):
    """The experts' Triton path (interpreted) on the loaded block-wise layout: within 6% of the
    dense MLP on their dequantized weights (the activations' e4m3 rounding)."""
    out, _ = fp8_moe_pair(tmp_path, "block")
    model, _, _ = load_model(EngineConfig(model=str(out)), "cpu")
    experts = model.model.layers[1].mlp.experts
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 128, generator=gen)
    ids = torch.tensor([[0, 5], [5, 7], [2, 0]], dtype=torch.int32)
    weights = torch.rand(3, 2, generator=gen)
    dense = moe.fused_experts_ref(x, experts.dequantized("w13", x.dtype),
                                  experts.dequantized("w2", x.dtype), weights, ids)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    got = experts(x, weights, ids)
    assert 0 < (got - dense).norm() / dense.norm() < 0.06


@pytest.mark.parametrize("fmt", ["block", "channel"])
def test_tensor_parallel_rank_loads_its_slice(monkeypatch, fmt):
    """Rank 1 of 2 keeps its half of every expert's intermediate dim, weights and scales: its
    dequantized experts are those columns / rows of the full ones (loaded at TP=1)."""
    from tinypaged.models import moe_fp8
    from tinypaged.quantization.fp8 import CompressedTensorsFp8Config, Fp8Config

    method = Fp8Config(weight_scheme="block", block=(128, 128)) if fmt == "block" else \
        CompressedTensorsFp8Config(weight_scheme="channel")
    E, H, inter = 2, 256, 256
    gen = torch.Generator().manual_seed(9)
    tensors = {}
    for e in range(E):
        for proj, shape in (("gate_proj", (inter, H)), ("up_proj", (inter, H)),
                            ("down_proj", (H, inter))):
            stored, _ = quantize(torch.randn(*shape, generator=gen), fmt)
            for k, v in stored.items():
                tensors[(e, proj, k)] = v

    def load(rank, size):
        monkeypatch.setattr(moe_fp8, "get_tp_rank", lambda: rank)
        monkeypatch.setattr(moe_fp8, "get_tp_size", lambda: size)
        layer = moe_fp8.Fp8FusedMoE(E, H, inter, method)
        for (e, proj, k), v in tensors.items():
            stacked = "w2" if proj == "down_proj" else "w13"
            param = getattr(layer, f"{stacked}_{'weight' if k == 'weight' else 'weight_scale'}")
            sid = e if proj == "down_proj" else (e, 0 if proj == "gate_proj" else 1)
            layer.weight_loader(param, v, sid)
        return layer.dequantized("w13", torch.float32), layer.dequantized("w2", torch.float32)

    full13, full2 = load(0, 1)
    part13, part2 = load(1, 2)
    half = inter // 2
    want13 = torch.cat([full13[:, half:inter], full13[:, inter + half:]], 1)
    assert torch.equal(part13, want13) and torch.equal(part2, full2[:, :, half:])
