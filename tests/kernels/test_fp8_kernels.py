"""The FP8 kernels (activation quantization, the scaled GEMM in its three scale layouts) under the
Triton interpreter against their torch references, fp32 and fp16 inputs."""

import pytest
import torch

from tinypaged.kernels import fp8 as F

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the ops read it at each call


def test_reference_is_the_definition():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, generator=gen)
    x[2] = 0.0  # an all-zero row keeps a finite scale
    q, s = F.quantize_fp8_reference(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 1)
    assert torch.equal(q[:2].float().abs().amax(1), torch.full((2,), F.FP8_MAX))
    torch.testing.assert_close(q.float() * s, x, rtol=2 ** -4, atol=0)  # 3 mantissa bits
    qg, sg = F.quantize_fp8_reference(x, group=4)
    torch.testing.assert_close(sg[0], x[0].reshape(2, 4).abs().amax(1) / F.FP8_MAX)
    w = torch.randn(256, 256, generator=gen).to(torch.float8_e4m3fn)
    ws = torch.rand(2, 2, generator=gen)
    full = F.dequantize_fp8(w, ws, (128, 128))
    torch.testing.assert_close(full[130, 5], w[130, 5].float() * ws[1, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M, K, group, static, one_pass", [
    (5, 96, None, False, 16384), (3, 2048, None, False, 512), (4, 256, 128, False, 16384),
    (2, 64, None, True, 16384), (2, 320, None, True, 128)])
def test_quantize_matches_reference(monkeypatch, dtype, M, K, group, static, one_pass):
    monkeypatch.setattr(F, "MAX_ONE_PASS", one_pass)  # < K: the two-pass loop over chunks
    gen = torch.Generator().manual_seed(K)
    x = (torch.randn(M, K, generator=gen) * 3).to(dtype)
    scale = torch.tensor(0.02) if static else None
    q, s = F.quantize_fp8(x, group, scale)
    q_ref, s_ref = F.quantize_fp8_reference(x, group, scale)
    torch.testing.assert_close(s, s_ref)
    assert torch.equal(q.float(), q_ref.float())  # exact: the same rounding of the same scale


def _operands(M, N, K, block, gen):
    a = (torch.randn(M, K, generator=gen) * 4).to(torch.float8_e4m3fn)
    w = (torch.randn(N, K, generator=gen) * 4).to(torch.float8_e4m3fn)
    if block is None:
        a_s, w_s = torch.rand(M, 1, generator=gen) + 0.5, torch.rand(N, 1, generator=gen) + 0.5
    else:
        a_s = torch.rand(M, -(-K // block[1]), generator=gen) + 0.5
        w_s = torch.rand(-(-N // block[0]), -(-K // block[1]), generator=gen) + 0.5
    return a, a_s, w, w_s


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M, N, K, block", [(3, 40, 64, None), (20, 72, 256, None),
                                             (3, 256, 256, (128, 128)), (17, 192, 384, (128, 128))])
def test_gemm_matches_reference(out_dtype, M, N, K, block):
    gen = torch.Generator().manual_seed(M * N)
    a, a_s, w, w_s = _operands(M, N, K, block, gen)
    ref = F.fp8_gemm_reference(a, a_s, w, w_s, torch.float32, block)
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64 if block is None else 128, GROUP_M=2)
    y = F.fp8_gemm(a, a_s, w, w_s, out_dtype, block, config=cfg)
    tol = dict(rtol=1e-4, atol=1e-2) if out_dtype == torch.float32 else dict(rtol=2e-3, atol=0.5)
    torch.testing.assert_close(y.float(), ref, **tol)
    if block is None:  # per-tensor scales broadcast through zero strides
        y = F.fp8_gemm(a, a_s[:1], w, w_s[:1], out_dtype, None, config=cfg)
        ref = F.fp8_gemm_reference(a, a_s[:1], w, w_s[:1], torch.float32)
        torch.testing.assert_close(y.float(), ref, **tol)


def test_w8a8_close_to_the_unquantized_product():
    """The numerics the W8A8 path gives up: per-token x per-channel FP8 within 5% of fp32."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(8, 256, generator=gen), torch.randn(64, 256, generator=gen)
    ws = w.abs().amax(1, keepdim=True) / F.FP8_MAX
    q, s = F.quantize_fp8(x)
    y = F.fp8_gemm(q, s, (w / ws).to(torch.float8_e4m3fn), ws, torch.float32)
    err = (y - x @ w.t()).norm() / (x @ w.t()).norm()
    assert err < 0.05, err
