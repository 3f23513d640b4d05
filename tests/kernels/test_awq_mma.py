"""The AWQ decode GEMM with the weights in the MMA's M slot (kernels/awq_mma.py) under the Triton
interpreter, fp32 and fp16, against the fp32 reference, and awq_gemm's decode table; bf16 and
the paired-PTX dequant are checked on the GPU (benchmarks/awq_gemv.py --layers)."""

import pytest
import torch

from tinypaged.kernels import awq, awq_mma
from tinypaged.kernels.split_k import SPLIT_K_WORKSPACE


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def random_awq(K, N, group_size, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (K, N), generator=g)
    z = torch.randint(0, 16, (K // group_size, N), generator=g)
    s = (torch.rand(K // group_size, N, generator=g) * 0.02 + 0.002).half()
    qweight, qzeros = awq.pack_awq(q, z)
    return qweight, qzeros, s, torch.randn(64, K, generator=g)


TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=1e-2, atol=1e-2)}


def assert_workspace_zero():
    for partial, count in SPLIT_K_WORKSPACE.values():
        assert not partial.any() and not count.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,K,N,group_size,split_k", [
    (2, 256, 1024, 128, 1), (5, 256, 520, 64, 2), (16, 128, 1024, 32, 3), (3, 512, 512, 128, 4)])
def test_column_kernel_matches_reference(dtype, M, K, N, group_size, split_k):
    qweight, qzeros, s, x = random_awq(K, N, group_size, seed=M + K + N)
    x = x[:M].to(dtype)
    ref = awq.awq_gemm_reference(x, qweight, qzeros, s, group_size)
    for scales_t in (None, awq.gemv_scales(s)):
        y = awq_mma.awq_mma(x, qweight, qzeros, s, group_size, block_n=512,
                                 split_k=split_k, scales_t=scales_t)
        assert y.dtype == dtype and y.shape == (M, N)
        torch.testing.assert_close(y, ref, **TOL[dtype])
        assert_workspace_zero()


def test_every_decode_batch_has_one_path():
    for M in range(2, awq.GEMV_MAX_M + 1):
        for N, K in ((6144, 4096), (28672, 4096), (4096, 14336)):
            name, config = awq.decode_path(M, N, K)
            assert name in ("awq_mma", "awq_gemv") and isinstance(config, dict)
    with pytest.raises(ValueError, match="GEMV_MAX_M"):
        awq.decode_path(awq.GEMV_MAX_M + 1, 4096, 4096)


@pytest.mark.parametrize("M", [3, 8])
def test_min_block_m_8(M):
    qweight, qzeros, s, x = random_awq(256, 512, 128, seed=M)
    x = x[:M].half()
    ref = awq.awq_gemm_reference(x, qweight, qzeros, s, 128)
    y = awq_mma.awq_mma(x, qweight, qzeros, s, 128, split_k=2, scale_w=True, min_block_m=8)
    torch.testing.assert_close(y, ref, **TOL[torch.float16])
    assert_workspace_zero()
