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


def test_separate_down_tiles_match_reference(monkeypatch):
    """The down launch on its own tiles (FP8_MOE_CONFIGS keeps one entry per launch); both walk
    one sort by expert, so a BLOCK_M that differs is refused."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    T, E, H, inter, k, block = 5, 4, 256, 128, 2, (128, 128)
    (w13, s13, _), (w2, s2, _) = experts(E, H, inter, block, seed=11)
    weights, ids = routing(T, E, k, seed=12)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(13))
    gate_up = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=2)
    down = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)
    args = (x, w13, w2, s13, s2, weights, ids, block)
    got = moe_fp8.fused_experts_fp8_triton(*args, config=gate_up, down_config=down)
    want = moe_fp8.fused_experts_fp8_reference(*args)
    assert (got - want).abs().max() <= 2e-3 * want.abs().max()
    with pytest.raises(ValueError, match="BLOCK_M"):
        moe_fp8.fused_experts_fp8_triton(*args, config=gate_up, down_config=dict(down,
                                                                                 BLOCK_M=32))


def test_table_covers_every_token_count():
    """FP8_MOE_CONFIGS has both launches at every T of FP8_MOE_TOKENS for both scale kinds, the
    two sharing a BLOCK_M; block-wise BLOCK_K divides the 128-input scale group; each entry's
    pipeline fits sm_90's shared memory (num_stages buffers of A and the B tiles, e4m3); and
    every T from 1 to past the largest finds its entry."""
    table = moe_fp8.FP8_MOE_CONFIGS
    keys = {f"{launch}_t{t}{suffix}" for launch in ("gate_up", "down")
            for t in moe_fp8.FP8_MOE_TOKENS for suffix in ("", "_block")}
    assert table.keys() == keys
    for key, c in table.items():
        assert c.keys() == {"BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"}, key
        assert all(v > 0 and v & (v - 1) == 0 for k, v in c.items() if k != "num_stages"), key
        b_tiles = 2 if key.startswith("gate_up") else 1
        stage = c["BLOCK_K"] * (c["BLOCK_M"] + b_tiles * c["BLOCK_N"])
        assert c["num_stages"] * stage <= 227 * 1024, key
        if key.endswith("_block"):
            assert 128 % c["BLOCK_K"] == 0, key
    for block in (None, (128, 128)):
        for t in range(1, 20000):
            gate_up, down = moe_fp8.fp8_moe_config(t, block)
            assert gate_up["BLOCK_M"] == down["BLOCK_M"]
        for t in moe_fp8.FP8_MOE_TOKENS:  # each table T is its own entry, the next one above
            assert moe_fp8.fp8_moe_key(t, block).startswith(f"t{t}")
            if t < moe_fp8.FP8_MOE_TOKENS[-1]:
                assert moe_fp8.fp8_moe_key(t + 1, block).startswith(f"t{2 * t}")


def test_sweep_prints_a_table_that_pastes():
    # benchmarks/moe_fp8_gpu.py --sweep on made-up timings: the FP8_MOE_CONFIGS it prints for
    # .gpu/paste.py is Python with every key the kernels look up
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "benchmarks/moe_fp8_gpu.py", "--sweep", "--dry-run"],
                         cwd=repo, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(repo)}, check=True).stdout
    block = re.findall(r"^FP8_MOE_CONFIGS = \{\n.*?^\}$", out, flags=re.S | re.M)[-1]
    assert all(len(line) <= 100 for line in block.splitlines())
    pasted = {}
    exec(block, {}, pasted)  # noqa: S102  (our own printed table)
    assert pasted["FP8_MOE_CONFIGS"].keys() == moe_fp8.FP8_MOE_CONFIGS.keys()
    for key, c in pasted["FP8_MOE_CONFIGS"].items():
        if key.startswith("gate_up"):
            assert c["BLOCK_M"] == pasted["FP8_MOE_CONFIGS"]["down" + key[7:]]["BLOCK_M"]
