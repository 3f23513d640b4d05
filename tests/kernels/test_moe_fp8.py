"""The FP8 fused MoE (per-channel and block-wise expert scales) under the Triton interpreter, fp32
and fp16 inputs, against its torch reference; the reference itself against the bf16-path
reference on the dequantized weights (the FP8 error is the activations' rounding only)."""

import pytest
import torch

from tinypaged.kernels import moe_fp8
from tinypaged.kernels.fp8 import FP8_MAX, dequantize_fp8
from tinypaged.kernels.moe import fused_experts_ref

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")


def experts(E, H, inter, block, seed=0):
    """Random fp8 experts and scales in the layout of `block`, and their dequantized weights."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for rows, cols in ((2 * inter, H), (H, inter)):
        w = torch.randn(E, rows, cols, generator=gen) * 0.1
        if block is None:
            s = w.abs().amax(2, keepdim=True) / FP8_MAX
            q = (w / s).to(torch.float8_e4m3fn)
        else:
            bn, bk = block
            blocks = w.reshape(E, rows // bn, bn, cols // bk, bk)
            s = blocks.abs().amax((2, 4)) / FP8_MAX
            q = (blocks / s[:, :, None, :, None]).to(torch.float8_e4m3fn).reshape(E, rows, cols)
        # vary the scales between rows / blocks so that a wrong scale index shows
        s = s * (1 + torch.rand(s.shape, generator=gen))
        deq = torch.stack([dequantize_fp8(q[e], s[e], block) for e in range(E)])
        out.append((q, s, deq))
    return out


def routing(T, E, k, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(torch.int32)
    weights = torch.rand(T, k, generator=gen)
    return weights / weights.sum(1, keepdim=True), ids


CASES = [  # (T, E, H, I, k, block, tiles)
    (7, 4, 64, 32, 2, None, dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32)),
    (5, 4, 256, 128, 2, (128, 128), dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T, E, H, inter, k, block, tiles", CASES)
def test_kernel_matches_reference(monkeypatch, dtype, T, E, H, inter, k, block, tiles):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    (w13, s13, _), (w2, s2, _) = experts(E, H, inter, block)
    weights, ids = routing(T, E, k)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2)).to(dtype)
    config = dict(tiles, num_warps=4, num_stages=2)
    got = moe_fp8.fused_experts_fp8_triton(x, w13, w2, s13, s2, weights, ids, block,
                                           config=config)
    want = moe_fp8.fused_experts_fp8_reference(x, w13, w2, s13, s2, weights, ids, block)
    assert got.dtype == dtype and got.shape == (T, H)
    # the same fp8 operands; fp32 sums in another order, act rounded to x's dtype, requantized
    tol = 1e-2 if dtype == torch.float16 else 2e-3
    scale = want.float().abs().max()
    assert (got.float() - want.float()).abs().max() <= tol * scale


@pytest.mark.parametrize("block", [None, (128, 128)])
def test_reference_is_the_dequantized_moe_up_to_activation_rounding(block):
    E, H, inter, T, k = 4, 256, 128, 6, 2
    (w13, s13, d13), (w2, s2, d2) = experts(E, H, inter, block, seed=5)
    weights, ids = routing(T, E, k, seed=6)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(7))
    got = moe_fp8.fused_experts_fp8_reference(x, w13, w2, s13, s2, weights, ids, block)
    dense = fused_experts_ref(x, d13, d2, weights, ids)
    rel = (got - dense).norm() / dense.norm()
    assert 0 < rel < 0.06  # two e4m3 activation roundings (3 mantissa bits: ~2-3% each)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("T", [1, 2])
def test_decode_gemvs_are_w8a16(monkeypatch, dtype, block, T):
    """A few tokens take moe_gemv.py's sort-free GEMVs with the FP8 experts widened in
    registers: the bf16 path's reference on the dequantized experts, x unquantized."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    E, H, inter, k = 8, 384, 256, 2  # H: three scale blocks; every expert's rows vary
    (w13, s13, d13), (w2, s2, d2) = experts(E, H, inter, block, seed=8)
    weights, ids = routing(T, E, k, seed=9)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(10)).to(dtype)
    got = moe_fp8.fused_experts_fp8(x, w13, w2, s13, s2, weights, ids, block)
    want = fused_experts_ref(x.float(), d13, d2, weights, ids)
    assert got.dtype == dtype and got.shape == (T, H)
    tol = 1e-2 if dtype == torch.float16 else 1e-5  # fp16: act and out rounded to x's dtype
    assert (got.float() - want).abs().max() <= tol * want.abs().max()
    monkeypatch.setenv("TINYPAGED_DENSE_GEMV", "0")  # the A/B switch: back to W8A8
    w8a8 = moe_fp8.fused_experts_fp8(x, w13, w2, s13, s2, weights, ids, block)
    assert 0 < (w8a8.float() - want).norm() / want.norm() < 0.06


def test_shapes_are_checked():
    (w13, s13, _), (w2, s2, _) = experts(2, 256, 128, (128, 128))
    weights, ids = routing(3, 2, 1)
    x = torch.randn(3, 256)
    with pytest.raises(ValueError, match="scales"):
        moe_fp8.fused_experts_fp8(x, w13, w2, s13, s2[:, :1], weights, ids, (128, 128))
    with pytest.raises(ValueError, match="scales"):  # per-channel scales given as blocks
        moe_fp8.fused_experts_fp8(x, w13, w2, s13, s2, weights, ids, None)
