"""fp8_norm_linear: an FP8 W8A8 qkv / gate-up linear after an RMSNorm takes its quantized input
from the norm's own pass (rms_norm_quant_fp8) instead of a separate quantize_fp8. The products
see the same quantized operands as norm-then-linear, so the numbers are the same; the cases
apply would not quantize x that way fall back (None). Triton kernels interpreted."""

from types import SimpleNamespace

import pytest
import torch

from tinypaged.kernels.fp8 import FP8_DTYPE
from tinypaged.models import decoder
from tinypaged.models.decoder import DecoderLayer, DecoderSpec, _rotary_embedding
from tinypaged.models.layers import QKVParallelLinear, RMSNorm
from tinypaged.models.rope import RopeSpec
from tinypaged.quantization import fp8 as fp8_module
from tinypaged.quantization.fp8 import CompressedTensorsFp8Config, Fp8Config, fp8_norm_linear

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 128, 4, 2, 64  # q, k, v shards whole [128, 128] blocks
METHODS = {
    "tensor": Fp8Config(weight_scheme="tensor"),  # dynamic per-token activations
    "channel": CompressedTensorsFp8Config(weight_scheme="channel"),
    "online": Fp8Config.online(),
    "block": Fp8Config(weight_scheme="block", block=(128, 128)),  # per token group of 128
}


def fill_fp8(linear, method, gen, dtype=torch.float32) -> None:
    """Random weights as `method` stores them (a dense one quantized at load), then processed."""
    w = torch.randn(linear.weight.shape, generator=gen)
    if method.from_dense:
        linear.weight.data.copy_(w * 0.05)
    else:
        linear.weight.data.copy_((w * 64).to(FP8_DTYPE))
        scale = getattr(linear, "weight_scale_inv", None)
        scale = linear.weight_scale if scale is None else scale
        if method.weight_scheme == "tensor":  # one per tensor, widened to rows at load
            scale.data.fill_(1e-3)
        else:
            scale.data.copy_(torch.rand(scale.shape, generator=gen) * 1e-3 + 5e-4)
    method.process_weights_after_loading(linear)
    if linear.bias is not None:
        linear.bias.data = torch.randn(linear.bias.shape, generator=gen).to(dtype)


def norm_and_qkv(method, gen, dtype=torch.float32):
    norm = RMSNorm(HIDDEN, 1e-6)
    norm.weight.data = (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype)
    linear = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=True,
                               quant_config=method)
    fill_fp8(linear, method, gen, dtype)
    return norm, linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("rows", [2, 5, 17])
@pytest.mark.parametrize("scheme", list(METHODS))
def test_fused_is_norm_then_linear(monkeypatch, scheme, rows, with_residual, dtype):
    """(y, r) equal linear(norm(x + residual)) and x + residual (residual None: x itself), at
    fp8_rows' sizes (2, 5) and fp8_gemm's (17)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(rows)
    norm, linear = norm_and_qkv(METHODS[scheme], gen, dtype)
    x = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
    residual = torch.randn(rows, HIDDEN, generator=gen).to(dtype) if with_residual else None
    y, r = fp8_norm_linear(norm, linear, x, residual)
    if residual is None:
        normed, r_ref = norm(x), x
    else:
        normed, r_ref = norm(x, residual)
    y_ref = linear(normed)
    assert y.dtype == y_ref.dtype == dtype and y.shape == (rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(r, r_ref, rtol=0, atol=0)


def test_quantize_fp8_runs_only_where_it_falls_back(monkeypatch):
    """The fused path quantizes in the norm, never through quantize_fp8; None where apply would
    not quantize x dynamically from its unquantized value: one row (the W8A16 GEMV), the
    w8a8dot GEMV's rows, a static input_scale, LoRA, a dense linear, the CPU path."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []
    real = fp8_module.quantize_fp8

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(fp8_module, "quantize_fp8", spy)
    gen = torch.Generator().manual_seed(0)
    norm, linear = norm_and_qkv(METHODS["channel"], gen)
    x5, x1 = torch.randn(5, HIDDEN, generator=gen), torch.randn(1, HIDDEN, generator=gen)
    assert fp8_norm_linear(norm, linear, x5, None) is not None and calls == []
    assert fp8_norm_linear(norm, linear, x1, None) is None  # the W8A16 GEMV reads x as it is
    monkeypatch.setenv("TINYPAGED_DENSE_GEMV", "0")  # W8A8 at every size: one row fuses too
    assert fp8_norm_linear(norm, linear, x1, None) is not None and calls == []
    monkeypatch.delenv("TINYPAGED_DENSE_GEMV")
    monkeypatch.setenv("TINYPAGED_FP8_GEMV", "w8a8dot")  # 1-16 rows quantized inside the GEMV
    assert fp8_norm_linear(norm, linear, x5, None) is None
    monkeypatch.delenv("TINYPAGED_FP8_GEMV")
    linear.lora = SimpleNamespace(active=True)  # the adapter's delta reads the unquantized x
    assert fp8_norm_linear(norm, linear, x5, None) is None
    linear.lora.active = False  # a step with no adapter runs as LoRA-off (lora/idle.py)
    assert fp8_norm_linear(norm, linear, x5, None) is not None and calls == []
    del linear.lora

    static = Fp8Config(weight_scheme="tensor", static_input=True)
    norm, linear = norm_and_qkv(static, gen)
    linear.input_scale.data.fill_(0.01)
    assert fp8_norm_linear(norm, linear, x5, None) is None
    linear(norm(x5))
    assert calls == [5]  # the fallback quantizes with the static scale

    dense = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS)
    assert fp8_norm_linear(norm, dense, x5, None) is None
    monkeypatch.delenv("TRITON_INTERPRET")  # the CPU path: weight-only FP8
    norm, linear = norm_and_qkv(METHODS["channel"], gen)
    assert fp8_norm_linear(norm, linear, x5, None) is None


def tiny_layer(method, gen) -> DecoderLayer:
    spec = DecoderSpec(vocab_size=64, hidden_size=HIDDEN, intermediate_size=256, num_layers=1,
                       num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                       rms_norm_eps=1e-6, rope=RopeSpec(10000.0, HEAD_DIM, 64))
    layer = DecoderLayer(spec, _rotary_embedding(spec.rope), method)
    for module in layer.modules():
        if hasattr(module, "quant_config"):
            fill_fp8(module, method, gen)
        elif isinstance(module, RMSNorm):
            module.weight.data = 1 + 0.1 * torch.randn(HIDDEN, generator=gen)
    return layer


@pytest.mark.parametrize("rows", [2, 5, 17])
@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_decoder_layer_fused_matches_unfused(monkeypatch, scheme, rows):
    """A decoder layer's two halves (pre_attention: add, norm, QKV, rotary, KV store;
    post_attention: o_proj, add, norm, MLP) give the same q, k / v cache, output and residual
    stream with fp8_norm_linear as without it; quantize_fp8 runs for o_proj only (the down
    projection quantizes in its SiLU-and-mul), unfused for each qkv and gate-up too."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []
    real = fp8_module.quantize_fp8
    monkeypatch.setattr(fp8_module, "quantize_fp8",
                        lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    gen = torch.Generator().manual_seed(10 + rows)
    layer = tiny_layer(METHODS[scheme], gen)
    positions, slots = torch.arange(rows), torch.arange(rows)
    hidden = torch.randn(rows, HIDDEN, generator=gen)
    residual = torch.randn(rows, HIDDEN, generator=gen)
    attn_out = torch.randn(rows, HEADS, HEAD_DIM, generator=gen)

    def run():
        attn = layer.self_attn.attn
        attn.k_cache = torch.zeros(2, 16, KV_HEADS, HEAD_DIM)
        attn.v_cache = torch.zeros(2, 16, KV_HEADS, HEAD_DIM)
        first = layer.pre_attention(positions, hidden, None, slots)  # layer 0: no residual yet
        q, r = layer.pre_attention(positions, hidden, residual, slots)
        return (*first, q, r, attn.k_cache, attn.v_cache,
                *layer.post_attention(attn_out, residual))

    fused = run()
    assert calls == [rows]
    calls.clear()
    monkeypatch.setattr(decoder, "fp8_norm_linear", lambda *args: None)
    unfused = run()
    assert calls == [rows] * 4  # two pre_attention qkv, o_proj, gate-up
    for got, want in zip(fused, unfused, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
