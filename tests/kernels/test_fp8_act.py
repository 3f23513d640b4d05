"""SiLU-and-mul fused with the FP8 activation quantization, under the Triton interpreter (fp32,
fp16; per token and per group of 128) against its reference, and the FP8 MLP's fused path equal
to the separate kernels (silu_and_mul, quantize_fp8, the FP8 GEMM)."""

from types import SimpleNamespace

import pytest
import torch

from tinypaged.kernels import fp8_act, silu_and_mul
from tinypaged.kernels.fp8 import FP8_MAX
from tinypaged.models import layers
from tinypaged.quantization.fp8 import Fp8Config, fp8_silu_and_mul_down

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M, inter, group", [(5, 96, None), (3, 256, 128)])
def test_matches_reference(dtype, M, inter, group):
    gen = torch.Generator().manual_seed(inter)
    x = (torch.randn(M, 2 * inter, generator=gen) * 3).to(dtype)
    x[1, :inter] = 0.0  # a row whose output is all zero keeps a finite scale
    q, s = fp8_act.silu_and_mul_quant_fp8(x, group)
    qr, sr = fp8_act.silu_and_mul_quant_fp8_reference(x, group)
    assert q.dtype == torch.float8_e4m3fn and s.shape == sr.shape == (M, inter // (group or inter))
    torch.testing.assert_close(s, sr, rtol=1e-5, atol=0)
    # torch's and Triton's sigmoid may differ in the last bit: at most one e4m3 step apart
    G = group or inter
    got = (q.float().reshape(M, -1, G) * s[..., None]).reshape(M, inter)
    want = (qr.float().reshape(M, -1, G) * sr[..., None]).reshape(M, inter)
    assert ((got - want).abs() <= want.abs() / 8 + 1e-6).all()
    assert (q.float() != qr.float()).float().mean() < 0.01
    assert q.float().abs().amax() == FP8_MAX


@pytest.mark.parametrize("method", [Fp8Config.online(), Fp8Config(weight_scheme="block",
                                                                   block=(128, 128))])
def test_fp8_mlp_fused_path_equals_the_separate_kernels(method):
    gen = torch.Generator().manual_seed(1)
    down = layers.RowParallelLinear(256, 128, quant_config=method)
    if method.from_dense:
        down.weight.data.copy_(torch.randn(128, 256, generator=gen) * 0.05)
    else:
        down.weight.data.copy_((torch.randn(128, 256, generator=gen) * 100).clamp(-448, 448)
                               .to(torch.float8_e4m3fn))
        down.weight_scale_inv.data.copy_(torch.rand(1, 2, generator=gen) * 1e-3)
    method.process_weights_after_loading(down)
    gate_up = torch.randn(20, 512, generator=gen)  # past the decode GEMV's 16 rows
    # decode: the W8A16 GEMV forms silu(gate) * up as it loads it
    decode = fp8_silu_and_mul_down(down, gate_up[:4])
    torch.testing.assert_close(decode, down(silu_and_mul(gate_up[:4])), rtol=1e-5, atol=1e-5)
    fused = fp8_silu_and_mul_down(down, gate_up)
    separate = down(silu_and_mul(gate_up))
    assert fused is not None and torch.equal(fused, separate)
    dense = silu_and_mul(gate_up) @ method.dequantized_weight(down).t()
    assert (fused - dense).norm() / dense.norm() < 0.05  # the activations' e4m3 rounding


def test_cpu_path_is_left_to_the_separate_ops(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    down = layers.RowParallelLinear(64, 32, quant_config=Fp8Config.online())
    assert fp8_silu_and_mul_down(down, torch.randn(2, 128)) is None


def test_lora_on_down_takes_the_separate_ops():
    """down_proj's adapter delta is added in down's own matmul (lora/layers.py): a step with an
    adapter leaves the fused path; one without keeps it, as LoRA-off (lora/idle.py)."""
    gen = torch.Generator().manual_seed(2)
    method = Fp8Config.online()
    down = layers.RowParallelLinear(256, 128, quant_config=method)
    down.weight.data.copy_(torch.randn(128, 256, generator=gen) * 0.05)
    method.process_weights_after_loading(down)
    gate_up = torch.randn(4, 512, generator=gen)
    down.lora = SimpleNamespace(active=True)
    assert fp8_silu_and_mul_down(down, gate_up) is None
    down.lora.active = False
    assert fp8_silu_and_mul_down(down, gate_up) is not None
