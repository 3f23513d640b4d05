"""kernels/fp8_rows.py (the W8A8 decode product of an e4m3 x, 1-16 rows) under the Triton
interpreter against its torch reference: per-tensor, per-channel and [128, 128] block scales,
fp32 and fp16 outputs, every M from 1 to 16, odd N (rows past N read but not stored) and odd K
(a masked last step), split K or not; the split-K workspace left zeroed; the weight streamed
by TMA descriptor (w_tma) as by pointer loads; and the tables that benchmarks/fp8_gemv.py
--sweep-rows prints to paste."""

import os

import pytest
import torch

from tinypaged.kernels import fp8, fp8_rows, tma
from tinypaged.kernels.split_k import SPLIT_K_WORKSPACE

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def quantized(M, K, N, kind, seed):
    """(a e4m3 [M, K], a_scale, w e4m3 [N, K], w_scale, block) as the W8A8 path holds them: x
    quantized per token (per token group of 128 with block-wise weights, static per tensor)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    x[0, :7] *= 30  # one large row: its own scale
    block = (128, 128) if kind == "block" else None
    if kind == "static":
        a, a_scale = fp8.quantize_fp8(x, scale=torch.tensor(0.05))
    else:
        a, a_scale = fp8.quantize_fp8(x, 128 if block else None)
    w = (torch.randn(N, K, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    rows, cols = {"static": (1, 1), "channel": (N, 1),
                  "block": (-(-N // 128), -(-K // 128))}[kind]
    w_scale = torch.rand(rows, cols, generator=g) * 1e-3 + 1e-4
    return a, a_scale, w, w_scale, block


def assert_workspace_zero():
    for partial, count in SPLIT_K_WORKSPACE.values():
        assert not partial.any() and not count.any()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind,K,N", [("channel", 300, 200), ("static", 512, 136),
                                      ("block", 384, 200)])
def test_every_m_matches_reference(out_dtype, kind, K, N):
    tol = dict(rtol=1e-5, atol=1e-5) if out_dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
    for M in range(1, 17):
        a, a_scale, w, w_scale, block = quantized(M, K, N, kind, seed=M)
        ref = fp8_rows.fp8_rows_reference(a, a_scale, w, w_scale, out_dtype, block)
        configs = [fp8_rows.fp8_rows_config(M, block)]
        if M in (1, 3, 16):
            configs += [dict(block_n=64, block_k=64, split_k=3),  # masked last step (K 300)
                        dict(block_n=32, block_k=128, split_k=1)]  # no split: y stored at once
        for config in configs:
            y = fp8_rows.fp8_rows(a, a_scale, w, w_scale, out_dtype, block, **config)
            assert y.dtype == out_dtype and y.shape == (M, N)
            torch.testing.assert_close(y, ref, **tol)
            assert_workspace_zero()


@pytest.mark.parametrize("kind,K,N", [("channel", 304, 200), ("block", 384, 200),
                                      ("static", 512, 136)])
def test_tma_weight_loads_match_pointer_loads(monkeypatch, kind, K, N):
    # W by TMA descriptor: rows past N (200, 136) and columns past K (304 = 2 * 128 + 48) come
    # in as zeros from the copy engine, not by masks
    operands = []
    make = fp8_rows.w_operand
    monkeypatch.setattr(fp8_rows, "w_operand", lambda *args: operands.append(make(*args))
                        or operands[-1])
    for M in (2, 5, 16):
        a, a_scale, w, w_scale, block = quantized(M, K, N, kind, seed=M)
        ref = fp8_rows.fp8_rows_reference(a, a_scale, w, w_scale, torch.float32, block)
        for config in (dict(block_n=64, block_k=128, split_k=3, num_stages=6),
                       dict(block_n=128, block_k=64, split_k=1)):
            for w_tma in (False, True):
                operands.clear()
                y = fp8_rows.fp8_rows(a, a_scale, w, w_scale, torch.float32, block, **config,
                                      w_tma=w_tma)
                assert isinstance(operands[0], torch.Tensor) != w_tma  # a descriptor, or W
                torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
                assert_workspace_zero()


def test_tma_falls_back_where_no_descriptor_fits(monkeypatch):
    # K 300: rows 300 bytes apart, not the 16-byte multiple TMA needs; boxes over 256 a side;
    # $TINYPAGED_FP8_TMA=0 (the A/B switch): pointer loads, the same result
    a, a_scale, w, w_scale, block = quantized(4, 300, 200, "channel", seed=1)
    w256 = w[:, :256].contiguous()
    assert not tma.w_tma_fits(w, 64, 128) and not tma.w_tma_fits(w[:, :256], 64, 128)
    assert not tma.w_tma_fits(w256, 64, 512) and tma.w_tma_fits(w256, 64, 256)

    class OnGPU:  # w256 as a CUDA tensor would present it: a GPU before Hopper has no TMA
        is_cuda, device = True, torch.device("cuda", 0)

        def __getattr__(self, name):
            return getattr(w256, name)

    monkeypatch.setattr(tma, "tma_device", lambda index: False)
    assert not tma.w_tma_fits(OnGPU(), 64, 256)
    monkeypatch.setattr(tma, "tma_device", lambda index: True)
    assert tma.w_tma_fits(OnGPU(), 64, 256)
    ref = fp8_rows.fp8_rows_reference(a, a_scale, w, w_scale, torch.float32, block)
    y = fp8_rows.fp8_rows(a, a_scale, w, w_scale, torch.float32, block, w_tma=True)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    operands = []
    make = fp8_rows.w_operand
    monkeypatch.setattr(fp8_rows, "w_operand", lambda *args: operands.append(make(*args))
                        or operands[-1])
    monkeypatch.setenv("TINYPAGED_FP8_TMA", "0")
    fp8_rows.fp8_rows(a[:, :256].contiguous(), a_scale, w256, w_scale, torch.float32, block,
                      w_tma=True)
    assert operands[0] is w256


def test_matches_the_w8a8_gemm():
    # what it replaces at decode: fp8_gemm on the same quantized operands
    a, a_scale, w, w_scale, block = quantized(8, 512, 192, "channel", seed=3)
    torch.testing.assert_close(fp8_rows.fp8_rows(a, a_scale, w, w_scale, torch.float32),
                               fp8.fp8_gemm(a, a_scale, w, w_scale, torch.float32),
                               rtol=1e-5, atol=1e-5)


def test_configs_cover_every_m():
    for M in range(1, fp8_rows.ROWS_MAX_M + 1):
        for block in (None, (128, 128)):
            config = fp8_rows.fp8_rows_config(M, block)
            assert config["block_n"] >= 16 * config.get("num_warps", 4)  # a wgmma a warpgroup
            assert block is None or (128 % config["block_n"] == 0 and config["block_k"] <= 128)


def test_rejects_bad_arguments():
    a, a_scale, w, w_scale, block = quantized(2, 256, 128, "block", seed=1)
    with pytest.raises(ValueError, match="1 to 16"):
        fp8_rows.fp8_rows(torch.cat([a] * 9), a_scale, w, w_scale, torch.float32, block)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_rows.fp8_rows(a.float(), a_scale, w, w_scale, torch.float32, block)
    with pytest.raises(ValueError, match="whole tiles"):
        fp8_rows.fp8_rows(a, a_scale, w, w_scale, torch.float32, block, block_n=256)


def test_sweep_prints_tables_that_paste():
    # benchmarks/fp8_gemv.py --sweep-rows on made-up timings: the two tables it prints for
    # .gpu/paste.py are Python that gives every key the kernels look up
    import re
    import subprocess
    import sys
    from pathlib import Path

    from tinypaged.kernels import dense_gemv

    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "benchmarks/fp8_gemv.py", "--sweep-rows", "--dry-run"],
                         cwd=repo, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(repo)}, check=True).stdout
    for name, table in (("FP8_ROWS_CONFIGS", fp8_rows.FP8_ROWS_CONFIGS),
                        ("FP8_ONE_ROW_CONFIGS", dense_gemv.FP8_ONE_ROW_CONFIGS)):
        block = re.findall(rf"^{name} = \{{\n.*?^\}}$", out, flags=re.S | re.M)[-1]
        pasted = {}
        exec(block, {}, pasted)  # noqa: S102  (our own printed table)
        assert pasted[name].keys() == table.keys()
