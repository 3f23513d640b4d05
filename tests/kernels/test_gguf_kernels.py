"""GGUF block formats: the torch references against the `gguf` package's dequantizers, the
device layout against the file's, and the Triton dequantize and GEMV kernels (which read the
device layout) against the references under the Triton interpreter."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from helpers.compile_sm90 import compile_for_sm90
from helpers.gguf import random_blocks
from helpers.ptx import float_to_half, run_ptx

from tinypaged.kernels import gguf
from tinypaged.kernels import gguf_subdot as subdot_module
from tinypaged.kernels.gguf_format import (
    GGML_TYPES,
    QUANTIZED_TYPES,
    gguf_dequantize_reference,
)
from tinypaged.kernels.gguf_layout import to_device_layout, to_file_layout
from tinypaged.kernels.gguf_mma import gguf_mma
from tinypaged.kernels.gguf_rows import gguf_rows, gguf_rows_reference
from tinypaged.kernels.gguf_subdot import gguf_subdot, gguf_subdot_reference

NAMES = {t: GGML_TYPES[t].name for t in QUANTIZED_TYPES}


def _k(type_id: int) -> int:
    # legacy rows of 576 (SmolLM2's hidden size) leave a partial 256-weight chunk
    return 576 if GGML_TYPES[type_id].block_elems == 32 else 512


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("type_id", QUANTIZED_TYPES, ids=NAMES.get)
def test_reference_equals_the_gguf_package(type_id):
    raw = random_blocks(type_id, 6, 2 * _k(type_id), seed=type_id)
    oracle = dequantize(raw, GGMLQuantizationType(type_id))
    ours = gguf_dequantize_reference(torch.from_numpy(raw), type_id, 2 * _k(type_id))
    assert np.abs(oracle).max() > 0
    assert torch.equal(ours, torch.from_numpy(oracle))


@pytest.mark.parametrize("type_id", QUANTIZED_TYPES, ids=NAMES.get)
def test_device_layout_round_trip(type_id):
    K = _k(type_id)
    raw = torch.from_numpy(random_blocks(type_id, 5, K, seed=4))
    device = to_device_layout(raw, type_id, K)
    assert device.shape == raw.shape and not torch.equal(device, raw)
    assert torch.equal(to_file_layout(device, type_id, K), raw)


def test_device_layout_of_q4_k():
    """Row = the quant plane (16-byte chunks transposed as 4 x 4 bytes, the first halves of the
    sub-block pairs first), then the headers."""
    raw = torch.from_numpy(random_blocks(12, 2, 512, seed=5))  # two blocks of 144 bytes a row
    device = to_device_layout(raw, 12, 512)
    quants = torch.stack([raw[:, 16:144], raw[:, 160:288]], dim=1)  # blocks 0 and 1
    chunks = quants.reshape(2, 2, 8, 16)[:, :, [0, 2, 4, 6, 1, 3, 5, 7]]  # halves of pairs first
    transposed = chunks.reshape(2, 2, 8, 4, 4).transpose(-1, -2).reshape(2, 256)
    assert torch.equal(device[:, :256], transposed)
    assert torch.equal(device[:, 1:4], raw[:, [20, 24, 28]])  # word 0 = bytes 0, 4, 8, 12
    assert torch.equal(device[:, 16:20], raw[:, [48, 52, 56, 60]])  # chunk 2 follows chunk 0
    assert torch.equal(device[:, 256:], torch.cat([raw[:, :16], raw[:, 144:160]], dim=1))


def test_device_layout_of_q6_k():
    """Row = ql (chunks in the order 0 1 4 5 2 3 6 7, transposed), qh (transposed), the scales
    of GEMV thread h = 2n + lh (sub-blocks 8n + 2i + lh) in word h, d."""
    raw = torch.from_numpy(random_blocks(14, 3, 256, seed=7))  # one block of 210 bytes a row
    device = to_device_layout(raw, 14, 256)
    chunks = raw[:, :128].reshape(3, 8, 16)[:, [0, 1, 4, 5, 2, 3, 6, 7]]
    transposed = chunks.reshape(3, 8, 4, 4).transpose(-1, -2).reshape(3, 128)
    assert torch.equal(device[:, :128], transposed)
    assert torch.equal(device[:, 128:192],
                       raw[:, 128:192].reshape(3, 4, 4, 4).transpose(-1, -2).reshape(3, 64))
    subs = [8 * (h // 2) + 2 * i + h % 2 for h in range(4) for i in range(4)]
    assert subs[:8] == [0, 2, 4, 6, 1, 3, 5, 7]
    assert torch.equal(device[:, 192:208], raw[:, 192:208][:, subs])
    assert torch.equal(device[:, 208:], raw[:, 208:])


@pytest.mark.parametrize("type_id", [0, 1, 30], ids=["F32", "F16", "BF16"])
def test_float_types_pass_through(type_id):
    w = torch.randn(3, 64).to({0: torch.float32, 1: torch.float16, 30: torch.bfloat16}[type_id])
    raw = w.view(torch.uint8)
    assert torch.equal(gguf_dequantize_reference(raw, type_id, 64), w.float())
    x = torch.randn(2, 64)
    torch.testing.assert_close(gguf.gguf_linear(x, raw, type_id), x @ w.float().T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("type_id", QUANTIZED_TYPES, ids=NAMES.get)
def test_dequantize_kernel(interpret, type_id, dtype):
    K = _k(type_id)
    raw = torch.from_numpy(random_blocks(type_id, 20, K, seed=1))
    ours = gguf.gguf_dequantize(to_device_layout(raw, type_id, K), type_id, K, dtype)
    assert ours.dtype == dtype
    reference = gguf_dequantize_reference(raw, type_id, K).to(dtype)
    assert torch.equal(ours, reference)


@pytest.mark.parametrize("dtype,M", [(torch.float32, 1), (torch.float16, 3), (torch.float32, 5)])
@pytest.mark.parametrize("type_id", QUANTIZED_TYPES, ids=NAMES.get)
def test_gemv_kernel(interpret, type_id, dtype, M):
    K = _k(type_id)
    raw = torch.from_numpy(random_blocks(type_id, 20, K, seed=2))
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(0)).to(dtype)
    # two programs, the second half empty
    y = gguf.gguf_gemv(x, to_device_layout(raw, type_id, K), type_id, block_n=16)
    assert y.shape == (M, 20) and y.dtype == dtype
    reference = x.float() @ gguf_dequantize_reference(raw, type_id, K).T
    # fp32: sums of 1 + q * 2**-8 spend up to 8 of fp32's 24 bits before the subtraction
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(y.float(), reference, rtol=tol, atol=tol * reference.abs().max())


@pytest.mark.parametrize("prefetch", [False, True], ids=["", "prefetch"])
@pytest.mark.parametrize("type_id", [12, 14, 8], ids=["Q4_K", "Q6_K", "Q8_0"])
def test_gemv_split_k(interpret, type_id, prefetch):
    """K split over 3 (Q6_K: 2) programs a row block (one with a partial step for Q8_0's 36
    blocks): the last to finish writes y and leaves the workspace zeroed, so a second call
    agrees; with prefetch, no program reads the step after its own range."""
    K = {12: 768, 14: 1024, 8: 1152}[type_id]
    raw = torch.from_numpy(random_blocks(type_id, 8, K, seed=6))
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(1))
    qweight = to_device_layout(raw, type_id, K)
    reference = x @ gguf_dequantize_reference(raw, type_id, K).T
    for _ in range(2):
        y = gguf.gguf_gemv(x, qweight, type_id, block_n=8, split_k=3, prefetch=prefetch)
        torch.testing.assert_close(y, reference, rtol=1e-4, atol=1e-4 * reference.abs().max())


@pytest.mark.parametrize("dtype,M,split_k,xs_dot", [(torch.float32, 2, 1, False),
                                                    (torch.float16, 11, 2, True)])
@pytest.mark.parametrize("type_id", [12, 14], ids=["Q4_K", "Q6_K"])
def test_mma_kernel(interpret, type_id, dtype, M, split_k, xs_dot):
    """The tensor-core path for M > 1: rows of x padded to 16, K split over 2 programs."""
    K = 512
    raw = torch.from_numpy(random_blocks(type_id, 20, K, seed=8))
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(2)).to(dtype)
    y = gguf_mma(x, to_device_layout(raw, type_id, K), type_id, block_n=16, split_k=split_k,
                 xs_dot=xs_dot)
    assert y.shape == (M, 20) and y.dtype == dtype
    reference = x.float() @ gguf_dequantize_reference(raw, type_id, K).T
    # fp16: the 16-bit x and 1024 + q are exact, products summed in fp32; y rounds to fp16
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(y.float(), reference, rtol=tol, atol=tol * reference.abs().max())


def test_linear_dispatch(interpret, monkeypatch):
    """DECODE_PATHS picks the kernel by M: Q4_K's GEMV up to 3 rows, gguf_rows up to 64 (a
    verification's k + 1 rows a sequence), then dequantize + cuBLAS; each agrees with the
    reference (the kernels are spied on). Q4_K's gguf_subdot is off here
    (test_subdot_dispatch)."""
    monkeypatch.setenv("TINYPAGED_GGUF_SUBDOT", "0")
    K, type_id = 256, 12
    raw = torch.from_numpy(random_blocks(type_id, 16, K, seed=3))
    qweight = to_device_layout(raw, type_id, K)
    x = torch.randn(65, K)
    reference = x @ gguf_dequantize_reference(raw, type_id, K).T
    assert torch.equal(gguf.linear_reference(x, qweight, type_id), reference)
    calls = []
    for name in ("gguf_gemv", "gguf_rows", "gguf_dequantize"):
        kernel = getattr(gguf, name)
        monkeypatch.setattr(gguf, name, lambda *a, _k=kernel, _n=name, **kw: (
            calls.append(_n), _k(*a, **kw))[1])
    tol = dict(rtol=1e-4, atol=1e-4 * reference.abs().max())
    for M, kernel in ((2, "gguf_gemv"), (3, "gguf_gemv"), (4, "gguf_rows"), (16, "gguf_rows"),
                      (40, "gguf_rows"), (65, "gguf_dequantize")):
        torch.testing.assert_close(gguf.gguf_linear(x[:M], qweight, type_id), reference[:M], **tol)
        assert calls.pop() == kernel, M
    assert gguf.decode_path(14, 512, 1) == ("gemv", {"prefetch": True, "asm": True})
    assert gguf.decode_path(14, 256, 1) is None  # 210-byte rows: not whole words
    assert gguf.decode_path(8, 256, 9) is None  # Q8_0: the GEMV up to 8 rows, then cuBLAS
    assert gguf.decode_path(3, 256, 40) is None  # (gguf_rows lost to it on the default model)
    assert gguf.decode_path(13, 256, 8) == ("gemv", {})  # Q5_K: the GEMV up to 8 rows
    assert gguf.decode_path(13, 256, 9) == ("rows", {})  # then gguf_rows, as the k-quants
    assert gguf.decode_path(14, 256, 40) is None  # 210-byte rows: no GEMV, so no decode path
    assert gguf.decode_path(14, 512, 40) == ("rows", {})  # Q6_K: gguf_rows up to 40 rows
    assert gguf.decode_path(14, 512, 41) is None
    assert gguf.decode_path(3, 256, 5) == ("gemv", {"num_warps": 1})  # from 2 rows, one warp
    assert gguf.gguf_linear(x[:0], qweight, type_id).shape == (0, 16)


def linear_calls(monkeypatch, kernel: str, type_id: int, K: int, seed: int) -> list[dict]:
    """gguf_linear over 6 rows of x and 16 random rows of W, with gguf.`kernel` spied on: the
    keyword arguments of each call it got (the output is checked against the reference)."""
    raw = torch.from_numpy(random_blocks(type_id, 16, K, seed=seed))
    qweight = to_device_layout(raw, type_id, K)
    x = torch.randn(6, K)
    calls, real = [], getattr(gguf, kernel)
    monkeypatch.setattr(gguf, kernel, lambda *a, **kw: (calls.append(kw), real(*a, **kw))[1])
    y = gguf.gguf_linear(x, qweight, type_id)
    reference = gguf.linear_reference(x, qweight, type_id)
    torch.testing.assert_close(y, reference, rtol=1e-4, atol=1e-4 * reference.abs().max())
    return calls

def test_shape_errors_name_the_layout():
    qweight = torch.zeros(4, 100, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"Q4_K weight with K=256 is uint8 \[N, 144\]"):
        gguf.gguf_linear(torch.randn(1, 256), qweight, 12)
    for launcher in (gguf.gguf_gemv, gguf_mma):  # the kernels' launchers check it too
        with pytest.raises(ValueError, match=rf"^{launcher.__name__}: a Q4_K weight .* \[N, 144\]"):
            launcher(torch.randn(1, 256), qweight, 12)
    with pytest.raises(ValueError, match="whole blocks of 32"):
        gguf.gguf_dequantize(qweight, 8, 100)
    with pytest.raises(ValueError, match="type 99 is not supported"):
        gguf.gguf_dequantize(qweight, 99, 100)


GGUF_LAUNCHES = r"""import os

from tinypaged.kernels import gguf
from tinypaged.kernels.gguf_format import QUANTIZED_TYPES, row_bytes
from tinypaged.kernels.gguf_mma import gguf_mma
from tinypaged.kernels import gguf_rows as rows_module
from tinypaged.kernels.gguf_rows import gguf_rows

os.environ["TRITON_INTERPRET"] = "1"  # after the import: only so the launchers pick the kernels
rows_module.interpreting = lambda: False  # gguf_rows' PTX (asm=True) is compiled, not skipped
from tinypaged.kernels import gguf_subdot as subdot_module
subdot_module.interpreting = lambda: False  # and gguf_subdot's

for type_id in QUANTIZED_TYPES:  # every type in bf16; M = 8, split K and fp16 on Q4_K_M's two
    qweight = torch.zeros(4096, row_bytes(type_id, 4096), dtype=torch.uint8)
    gguf.gguf_gemv(torch.randn(1, 4096).to(torch.bfloat16), qweight, type_id)
    gguf.gguf_dequantize(qweight, type_id, 4096, torch.bfloat16)
    if type_id in (2, 3, 8):  # every row of x at once, as decode_path gives 2-8 rows
        gguf.gguf_gemv(torch.randn(5, 4096).to(torch.bfloat16), qweight, type_id, split_k=4,
                       **gguf.decode_path(type_id, 4096, 5)[1])
    if type_id in (12, 14):
        gguf.gguf_gemv(torch.randn(8, 4096).to(torch.float16), qweight, type_id, split_k=4)
        gguf_mma(torch.randn(8, 4096).to(torch.bfloat16), qweight, type_id, split_k=4)
        gguf_mma(torch.randn(8, 4096).to(torch.bfloat16), qweight, type_id, xs_dot=True)
        gguf.gguf_gemv(torch.randn(1, 4096).to(torch.bfloat16), qweight, type_id, block_n=32,
                       prefetch=True, asm=True)
    for config in ({}, dict(block_n=128, num_warps=8, num_stages=3, asm=True)):  # the sweep's
        gguf_rows(torch.randn(8, 4096).to(torch.bfloat16), qweight, type_id, split_k=4, **config)
    gguf_rows(torch.randn(16, 4096).to(torch.float16), qweight, type_id, block_n=32, split_k=1)
    gguf_rows(torch.randn(40, 4096).to(torch.bfloat16), qweight, type_id)  # x^T of 64 columns
    if type_id == 12:  # gguf_subdot: PTX and portable, wgmma (64 rows, 4 warps) and mma.sync
        for config in (dict(asm=True), dict(block_n=32, num_warps=2), dict(join=True, asm=True),
                       dict(join=True), dict(block_n=128, num_warps=8, num_stages=4)):
            subdot_module.gguf_subdot(torch.randn(8, 4096).to(torch.bfloat16), qweight,
                                      type_id, split_k=4, **config)
        subdot_module.gguf_subdot(torch.randn(16, 4096).to(torch.float16), qweight, type_id,
                                  split_k=1, asm=True)
"""


def test_kernels_compile_for_sm90():
    """The interpreter accepts programs ptxas rejects: build every variant for the H200."""
    assert compile_for_sm90(GGUF_LAUNCHES) == ["_gguf_dequantize_kernel", "_gguf_gemv_kernel",
                                               "_gguf_mma_kernel", "_gguf_rows_kernel",
                                               "_gguf_subdot_kernel"]


ROWS_CASES = [(torch.float32, 2), (torch.float16, 5), (torch.float32, 8), (torch.float16, 16),
              (torch.float32, 40)]


@pytest.mark.parametrize("dtype,M", ROWS_CASES, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("type_id", [12, 13, 14, 8, 2, 3], ids=NAMES.get)
def test_rows_kernel(interpret, type_id, dtype, M):
    """gguf_rows (2..64 rows, every type) against its torch reference: 20 rows of W in two
    programs of 16 (the second mostly past N), legacy rows of 576 with a short last step."""
    K = _k(type_id)
    raw = torch.from_numpy(random_blocks(type_id, 20, K, seed=9))
    qweight = to_device_layout(raw, type_id, K)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(3)).to(dtype)
    y = gguf_rows(x, qweight, type_id, block_n=16)
    assert y.shape == (M, 20) and y.dtype == dtype
    reference = gguf_rows_reference(x, qweight, type_id, block_n=16)
    assert torch.equal(reference.float(), (x.float() @ gguf_dequantize_reference(
        raw, type_id, K).T).to(dtype).float())
    # fp32: f = 1 + q 2**-BITS times scale 2**BITS spends BITS of fp32's bits; fp16: W and y are
    # rounded to fp16
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(y.float(), reference.float(), rtol=tol,
                               atol=tol * reference.float().abs().max())


@pytest.mark.parametrize("type_id", [12, 14, 8], ids=["Q4_K", "Q6_K", "Q8_0"])
def test_rows_split_k(interpret, type_id):
    """K split over 3 programs a row block (Q8_0's 36 blocks: a short last step): the last to
    finish writes y and re-zeroes the workspace, so a second call agrees."""
    K = {12: 768, 14: 1024, 8: 1152}[type_id]
    raw = torch.from_numpy(random_blocks(type_id, 24, K, seed=10))
    qweight = to_device_layout(raw, type_id, K)
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(4))
    reference = gguf_rows_reference(x, qweight, type_id)
    for _ in range(2):
        y = gguf_rows(x, qweight, type_id, block_n=16, split_k=3)
        torch.testing.assert_close(y, reference, rtol=1e-4, atol=1e-4 * reference.abs().max())


def test_rows_dispatch(interpret, monkeypatch):
    """$TINYPAGED_GGUF_ROWS=1 sends 2..64 rows of every type to gguf_rows (ROWS_CONFIGS' tiles),
    one row and prefill keep their paths; unset, DECODE_PATHS: gguf_rows from 4 rows for Q4_K
    and Q6_K, the GEMV below, and Q5_K's GEMV to 8 rows (gguf_subdot off)."""
    monkeypatch.setenv("TINYPAGED_GGUF_SUBDOT", "0")
    assert gguf.decode_path(12, 512, 3) == ("gemv", {})
    assert gguf.decode_path(12, 512, 8) == ("rows", gguf.rows_config(12, 8))
    assert gguf.decode_path(14, 512, 16) == ("rows", gguf.rows_config(14, 16))
    assert gguf.decode_path(13, 512, 8) == ("gemv", {})
    monkeypatch.setenv("TINYPAGED_GGUF_ROWS", "1")
    monkeypatch.setitem(gguf.ROWS_CONFIGS, 12, ((8, {"block_n": 16}), (16, {"block_n": 32})))
    assert gguf.decode_path(12, 512, 8) == ("rows", {"block_n": 16})
    assert gguf.decode_path(12, 512, 9) == ("rows", {"block_n": 32})
    assert gguf.decode_path(13, 512, 2) == ("rows", {})
    assert gguf.decode_path(14, 256, 16) == ("rows", {})  # 210-byte rows: fine here
    assert gguf.decode_path(12, 512, 1) == ("gemv", {})
    assert gguf.decode_path(8, 512, 64) == ("rows", {})
    assert gguf.decode_path(8, 512, 65) is None
    assert linear_calls(monkeypatch, "gguf_rows", type_id=13, K=256, seed=11) == [{}]


SUBDOT_CASES = [(torch.float32, 2), (torch.float16, 3), (torch.float32, 5), (torch.float16, 8),
                (torch.float32, 11), (torch.float16, 16)]


@pytest.mark.parametrize("join", [False, True], ids=["sub-blocks", "join"])
@pytest.mark.parametrize("dtype,M", SUBDOT_CASES, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("K", [256, 768])
def test_subdot_kernel(interpret, K, dtype, M, join):
    """gguf_subdot (Q4_K, 2..16 rows; a product a sub-block, or one a super-block) against its
    torch reference and the dequantized blocks: 21 rows of W in two programs of 16."""
    raw = torch.from_numpy(random_blocks(12, 21, K, seed=12))
    qweight = to_device_layout(raw, 12, K)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(dtype)
    y = gguf_subdot(x, qweight, 12, block_n=16, join=join)
    assert y.shape == (M, 21) and y.dtype == dtype
    reference = gguf_subdot_reference(x, qweight, 12, block_n=16)
    assert torch.equal(reference.float(), (x.float() @ gguf_dequantize_reference(
        raw, 12, K).T).to(dtype).float())
    # fp16: s and mn are rounded to fp16 before the weight's own rounding
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(y.float(), reference.float(), rtol=tol,
                               atol=tol * reference.float().abs().max())


@pytest.mark.parametrize("join", [False, True], ids=["sub-blocks", "join"])
def test_subdot_split_k(interpret, join):
    """K split over 3 programs a row block, twice (the workspace is re-zeroed between)."""
    K = 1536
    raw = torch.from_numpy(random_blocks(12, 24, K, seed=13))
    qweight = to_device_layout(raw, 12, K)
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(5))
    reference = gguf_subdot_reference(x, qweight, 12)
    for _ in range(2):
        y = gguf_subdot(x, qweight, 12, block_n=16, split_k=3, join=join)
        torch.testing.assert_close(y, reference, rtol=1e-4, atol=1e-4 * reference.abs().max())


def test_subdot_dispatch(interpret, monkeypatch):
    """$TINYPAGED_GGUF_SUBDOT=1 (the default) sends what would take gguf_rows to gguf_subdot
    for the types SUBDOT_CONFIGS lists that subdot_supported takes (Q4_K only: Q6_K keeps
    gguf_rows even if listed); everything else keeps its path."""
    assert gguf.decode_path(12, 512, 8) == ("subdot", gguf.subdot_config(12, 8))
    assert gguf.decode_path(12, 512, 17) == ("rows", gguf.rows_config(12, 17))  # past 16 rows
    assert gguf.decode_path(14, 1024, 16) == ("rows", gguf.rows_config(14, 16))  # not listed
    monkeypatch.setitem(gguf.SUBDOT_CONFIGS, 14, ((16, {"block_n": 16}),))
    assert gguf.decode_path(14, 1024, 16) == ("rows", gguf.rows_config(14, 16))  # unsupported
    assert gguf.decode_path(12, 512, 3) == ("gemv", {})
    assert gguf.decode_path(13, 512, 8) == ("gemv", {})
    monkeypatch.setenv("TINYPAGED_GGUF_ROWS", "1")
    assert gguf.decode_path(8, 512, 8) == ("rows", gguf.rows_config(8, 8))
    assert gguf.decode_path(12, 512, 2) == ("subdot", gguf.subdot_config(12, 2))
    monkeypatch.setitem(gguf.SUBDOT_CONFIGS, 12, ((16, {"block_n": 16}),))
    assert linear_calls(monkeypatch, "gguf_subdot", type_id=12, K=512, seed=14) == [
        {"block_n": 16}]


@pytest.mark.parametrize("magic", [0x4300, 0x6400], ids=["bf16", "fp16"])
def test_subdot_ptx_matches_the_portable_quants(magic):
    """gguf_subdot's QUANT_ASM (GPU only; the interpreter runs the portable code), emulated on
    random bytes: 4 packed bytes give s q + mn rounded once, for element j from nibble `high`
    of byte j."""
    dtype = torch.bfloat16 if magic == 0x4300 else torch.float16
    g = torch.Generator().manual_seed(15)
    for high in (0, 1):
        asm = subdot_module.QUANT_ASM.value[high, magic]
        for _ in range(50):
            qs = torch.randint(0, 256, (4,), generator=g).tolist()
            s, mn = (torch.randn(2, generator=g) * 0.01).to(dtype).tolist()
            registers = {"$2": sum(b << 8 * j for j, b in enumerate(qs))}
            for p, v in itertools.product(range(2), (0, 1)):
                bits = float_to_half((s, mn)[v], dtype)
                registers[f"${3 + 2 * v + p}"] = bits | bits << 16
            out = run_ptx(asm, registers)
            for j in range(4):
                want = float_to_half(s * (qs[j] >> 4 * high & 0xF) + mn, dtype)
                assert out[f"${j // 2}"] >> 16 * (j % 2) & 0xFFFF == want, (high, j)
