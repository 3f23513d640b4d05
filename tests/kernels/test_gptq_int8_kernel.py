"""The GPTQ int8 kernels (M = 1 GEMV, split-K tiled GEMM, dequantize) under the Triton interpreter
against the torch reference, fp32 and fp16, with and without act-order."""

import pytest
import torch

from tinypaged.kernels import gptq_int8 as K8
from tinypaged.kernels.split_k import SPLIT_K_WORKSPACE


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # gptq_int8_gemm reads it at each call


def random_int8(K, N, G, act_order, seed, dtype=torch.float16):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (K, N), generator=gen).to(torch.uint8)
    z = torch.randint(0, 256, (K // G, N), generator=gen).to(torch.uint8)
    s = (torch.rand(K // G, N, generator=gen) * 0.02 + 0.001).to(dtype)
    perm = torch.randperm(K, generator=gen).int() if act_order else None
    return q, z, s, perm, gen


def test_reference_is_the_definition():
    q, z, s, perm, gen = random_int8(64, 8, 32, True, 0)
    x = torch.randn(3, 64, generator=gen)
    w = torch.empty(64, 8)
    for k in range(64):
        w[k] = (q[k].float() - z[k // 32].float()) * s[k // 32].float()
    y = K8.gptq_int8_gemm_reference(x, q, z, s, perm)
    torch.testing.assert_close(y, x[:, perm.long()] @ w)
    scales_t = K8.int8_gemv_scales(s)
    assert scales_t[1, 3, 1] == s[1, 4 * 1 + 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("G, act_order", [(32, False), (64, True), (256, True)])
def test_gemv_matches_reference(dtype, G, act_order):
    K, N = 256, 72  # N not a multiple of the block: masked words
    q, z, s, perm, gen = random_int8(K, N, G, act_order, seed=G)
    x = torch.randn(1, K, generator=gen).to(dtype)
    ref = K8.gptq_int8_gemm_reference(x.float(), q, z, s, perm)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for scales_t in (None, K8.int8_gemv_scales(s)):
        for split_k in (1, 3):
            y = K8._gemv1(x, q, z, s, perm, scales_t, block_n=64, split_k=split_k)
            torch.testing.assert_close(y.float(), ref, **tol)
    torch.testing.assert_close(K8.gptq_int8_gemm(x, q, z, s, perm).float(), ref, **tol)
    partial, count = SPLIT_K_WORKSPACE[x.device]
    assert not partial.any() and not count.any()  # left zeroed for the next call


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M, G, act_order", [(5, 64, True), (16, 32, False), (40, 128, True)])
def test_gemm_matches_reference(dtype, M, G, act_order):
    K, N = 256, 144
    q, z, s, perm, gen = random_int8(K, N, G, act_order, seed=M)
    x = torch.randn(M, K, generator=gen).to(dtype)
    ref = K8.gptq_int8_gemm_reference(x.float(), q, z, s, perm)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    xp = x if perm is None else x[:, perm.long()]
    y = K8._gemm(xp, q, z, s, K8.int8_gemv_scales(s), block_n=64, split_k=3)
    torch.testing.assert_close(y.float(), ref, **tol)
    torch.testing.assert_close(K8.gptq_int8_gemm(x, q, z, s, perm).float(), ref, **tol)
    partial, count = SPLIT_K_WORKSPACE[x.device]
    assert not partial.any() and not count.any()


def test_dequantize_and_the_dense_path():
    q, z, s, perm, gen = random_int8(128, 40, 32, True, seed=9)
    w = K8.gptq_int8_dequantize(q, z, s, torch.float32)
    torch.testing.assert_close(w, K8.gptq_int8_dequantize_reference(q, z, s))
    x = torch.randn(K8.DENSE_MIN_M, 128, generator=gen)
    torch.testing.assert_close(K8.gptq_int8_gemm(x, q, z, s, perm),
                               K8.gptq_int8_gemm_reference(x, q, z, s, perm), rtol=1e-4,
                               atol=1e-4)


def test_rejects_mismatched_tensors():
    q, z, s, _, _ = random_int8(128, 8, 32, False, seed=1)
    with pytest.raises(ValueError, match=r"x must be \[M, K=128\], got \[1, 64\]"):
        K8.gptq_int8_gemm(torch.randn(1, 64), q, z, s)
    with pytest.raises(ValueError, match="qzeros .* must be"):
        K8.gptq_int8_gemm(torch.randn(1, 128), q, z[:3], s)
