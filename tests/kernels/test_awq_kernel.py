"""AWQ int4 packing and the Triton dequant GEMM / GEMV under the Triton interpreter."""

import itertools

import pytest
import torch

from tinypaged.kernels import awq
from tinypaged.kernels.split_k import SPLIT_K_WORKSPACE


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    # awq_gemm picks Triton on CPU tensors under TRITON_INTERPRET=1, read at each call; setting
    # it only per test keeps the rest of the session (and its subprocesses) on the references.
    monkeypatch.setenv("TRITON_INTERPRET", "1")

ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of a word holds column ORDER[i]


def loop_pack(values):
    """Independent packer: plain Python ints, one word at a time."""
    rows, cols = values.shape
    out = torch.empty(rows, cols // 8, dtype=torch.int32)
    for r in range(rows):
        for j in range(cols // 8):
            word = 0
            for nibble, col in enumerate(ORDER):
                word |= int(values[r, 8 * j + col]) << (4 * nibble)
            out[r, j] = word - (1 << 32) if word >= 1 << 31 else word
    return out


def random_awq(K, N, group_size, seed, scale_dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (K, N), generator=g)
    z = torch.randint(0, 16, (K // group_size, N), generator=g)
    s = (torch.rand(K // group_size, N, generator=g) * 0.02 + 0.002).to(scale_dtype)
    qweight, qzeros = awq.pack_awq(q, z)
    return q, z, s, qweight, qzeros


def test_known_word():
    # columns 0..7 hold 1..8: nibbles low to high read columns 0,2,4,6,1,3,5,7 = 1,3,5,7,2,4,6,8
    qweight = awq.pack_int4(torch.arange(1, 9).reshape(1, 8))
    assert qweight.item() == 0x86427531 - (1 << 32)
    assert awq.unpack_int4(qweight).tolist() == [list(range(1, 9))]


def test_pack_unpack_round_trip():
    q, z, s, qweight, qzeros = random_awq(64, 48, 32, seed=1)
    assert torch.equal(qweight, loop_pack(q))
    assert torch.equal(qzeros, loop_pack(z))
    q2, z2 = awq.unpack_awq(qweight, qzeros)
    assert torch.equal(q2, q.to(torch.int32)) and torch.equal(z2, z.to(torch.int32))
    # dequantized weights against a float computation written out per element
    w = awq.awq_dequantize_reference(qweight, qzeros, s, 32)
    expect = torch.empty(64, 48)
    for k in range(64):
        expect[k] = (q[k] - z[k // 32]).float() * s[k // 32].float()
    torch.testing.assert_close(w, expect, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("M", [1, 5, 16, 33, 300])
def test_awq_gemm_matches_reference(dtype, group_size, M):
    seed = M * 1000 + group_size
    g = torch.Generator().manual_seed(seed)
    K = group_size * int(torch.randint(1, 5, (1,), generator=g))
    N = 8 * int(torch.randint(3, 40, (1,), generator=g))  # often not a multiple of the tile
    _, _, s, qweight, qzeros = random_awq(K, N, group_size, seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    ref = awq.awq_gemm_reference(x, qweight, qzeros, s, group_size)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)

    y = awq.awq_gemm(x, qweight, qzeros, s, group_size)
    assert y.dtype == dtype and y.shape == (M, N)
    torch.testing.assert_close(y, ref, **tol)
    # every path, whatever M the dispatcher would pick it for (the split-K GEMV takes M >= 2)
    if M == 1:
        y = awq._awq_gemv1(x, qweight, qzeros, s, group_size, block_n=128, split_k=3,
                           scales_t=awq.gemv_scales(s))
        torch.testing.assert_close(y, ref, **tol)
    elif M <= awq.GEMV_MAX_M:
        y = awq._awq_gemv(x, qweight, qzeros, s, group_size, block_n=128, split_k=3,
                          scales_t=awq.gemv_scales(s))
        torch.testing.assert_close(y, ref, **tol)
    torch.testing.assert_close(awq._awq_gemm(x, qweight, qzeros, s, group_size), ref, **tol)


def test_gemv_split_k_and_strided_x():
    _, _, s, qweight, qzeros = random_awq(512, 64, 64, seed=3, scale_dtype=torch.float32)
    x = torch.randn(4, 1024)[:, ::2]  # a strided view: the launcher must not assume contiguity
    ref = awq.awq_gemm_reference(x, qweight, qzeros, s, 64)
    for split_k in (1, 2, 8, 100):  # 100 > number of groups: the extra splits are dropped
        y = awq._awq_gemv(x.contiguous(), qweight, qzeros, s, 64, block_n=128, split_k=split_k)
        torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
        partial, count = SPLIT_K_WORKSPACE[x.device]
        assert not partial.any() and not count.any()
    torch.testing.assert_close(awq.awq_gemm(x, qweight, qzeros, s, 64), ref, rtol=1e-4,
                               atol=1e-4)


def test_dequantize_kernel():
    _, _, s, qweight, qzeros = random_awq(256, 72, 128, seed=4)
    w = awq.awq_dequantize(qweight, qzeros, s, 128, dtype=torch.float32)
    torch.testing.assert_close(w, awq.awq_dequantize_reference(qweight, qzeros, s, 128))
    assert awq.awq_dequantize(qweight, qzeros, s, 128).dtype == torch.float16


def test_empty_batch():
    _, _, s, qweight, qzeros = random_awq(64, 16, 32, seed=5)
    assert awq.awq_gemm(torch.empty(0, 64), qweight, qzeros, s, 32).shape == (0, 16)


def test_bad_arguments():
    _, _, s, qweight, qzeros = random_awq(128, 32, 64, seed=6)
    x = torch.randn(2, 128)
    cases = [
        ((x, qweight, qzeros, s, 16), "group_size"),
        ((x, qweight.float(), qzeros, s, 64), "qweight"),
        ((x, qweight, qzeros[:1], s, 64), "qzeros"),
        ((x, qweight, qzeros, s[:, :8], 64), "scales"),
        ((x, qweight, qzeros, s.to(torch.int32), 64), "scales"),
        ((torch.randn(2, 64), qweight, qzeros, s, 64), "x has 64 columns"),
        ((torch.randn(128), qweight, qzeros, s, 64), "x must be"),
        ((x.to(torch.int64), qweight, qzeros, s, 64), "x must be"),
        ((x, qweight, qzeros, s, 128), "qzeros"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            awq.awq_gemm(*args)
    _, _, s96, qweight96, qzeros96 = random_awq(96, 32, 32, seed=7)
    with pytest.raises(ValueError, match="multiple of group_size"):
        awq.awq_gemm(torch.randn(1, 96), qweight96, qzeros96[:1], s96[:1], 64)
    with pytest.raises(ValueError, match="0..15"):
        awq.pack_awq(torch.full((8, 8), 16), torch.zeros(1, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="multiple of 8"):
        awq.pack_awq(torch.zeros(8, 12, dtype=torch.int64), torch.zeros(1, 12, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
# Each case a distinct tile (_gemv1_tile's T, R, words) or tail: N = 320 leaves half a column
# block masked (2.5 blocks), block_n = 1024 is one 128-word program over 2 groups, split 3 ways
# when split_k is None. The interpreter's time grows with blocks x steps: sizes stay small.
@pytest.mark.parametrize("K,N,group_size,block_n,num_warps", [
    (256, 512, 128, 256, 4), (512, 64, 64, 256, 4), (128, 96, 32, 128, 4), (128, 320, 32, 128, 2),
    (128, 1024, 64, 1024, 2)])
def test_batch1_gemv_matches_reference(dtype, K, N, group_size, block_n, num_warps):
    q, z, s, qweight, qzeros = random_awq(K, N, group_size, seed=K + N)
    x = torch.randn(1, K).to(dtype)
    s = s.to(dtype)
    ref = awq.awq_gemm_reference(x, qweight, qzeros, s, group_size)
    # one program per column block, partial sums, the default; the checkpoint's scale layout
    # and gemv_scales'
    for split_k, scales_t in itertools.product((1, 3, None), (None, awq.gemv_scales(s))):
        y = awq._awq_gemv1(x, qweight, qzeros, s, group_size, block_n=block_n,
                           split_k=split_k, num_warps=num_warps, scales_t=scales_t)
        torch.testing.assert_close(y, ref, rtol=1e-3, atol=1e-3)
        # the split-K sums and arrival counters are left zeroed for the next call
        partial, count = SPLIT_K_WORKSPACE[x.device]
        assert not partial.any() and not count.any()


def test_gemv_scales_layout_and_errors():
    s = torch.arange(2 * 16, dtype=torch.float32).reshape(2, 16)
    s_t = awq.gemv_scales(s)
    assert s_t.shape == (2, 8, 2) and s_t[1, 3, 1] == s[1, 8 + 3]
    _, _, s, qweight, qzeros = random_awq(128, 32, 64, seed=8)
    x = torch.randn(1, 128)
    with pytest.raises(ValueError, match="scales_t"):
        awq.awq_gemm(x, qweight, qzeros, s, 64, scales_t=s)
    _, _, s, qweight, qzeros = random_awq(64, 512, 32, seed=9)
    with pytest.raises(ValueError, match="the group size 32"):  # 128 rows a step, groups of 32
        awq._awq_gemv1(torch.randn(1, 64), qweight, qzeros, s, 32, block_n=32)
