"""The dense decode GEMV (kernels/dense_gemv.py) under the Triton interpreter, fp32 and fp16,
against its torch reference and F.linear, and dense_linear's dispatch; with FP8 weights (W8A16,
and W8A8 on FP8 tensor cores: quantize_x, bf16 included) in every scale layout too. bf16
W8A16 (whose tl.dot the interpreter gets wrong: only the one-row CUDA-core path is checked
here) and the timings are checked on the GPU (benchmarks/dense_gemv.py,
benchmarks/fp8_gemv.py)."""

import pytest
import torch
import torch.nn.functional as F

from tinypaged.kernels import activation, dense_gemv
from tinypaged.kernels._triton import jit as triton_jit
from tinypaged.kernels._triton import tl
from tinypaged.kernels.split_k import SPLIT_K_WORKSPACE
from tinypaged.models.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=1e-2, atol=1e-2)}


def random_linear(M, K, N, dtype, seed, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, w, b


def assert_workspace_zero():
    for partial, count in SPLIT_K_WORKSPACE.values():
        assert not partial.any() and not count.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,K,N,bias,split_k", [
    (1, 512, 96, False, 1),  # batch 1, one program per column block
    (1, 300, 50, True, 3),  # odd K (last step masked) and N (rows past N not stored), split K
    (2, 256, 64, True, 1),  # tensor cores from two rows
    (5, 777, 33, False, 2),
    (16, 512, 128, True, 4),
    (9, 256, 100, False, 16),  # more splits than K steps: empty splits dropped
    (40, 384, 96, True, 2),  # a batch-8 verification's rows: x^T padded to 64 columns
    (64, 256, 64, False, 1),
])
def test_gemv_matches_reference(dtype, M, K, N, bias, split_k):
    x, w, b = random_linear(M, K, N, dtype, seed=M * K + N, bias=bias)
    ref = dense_gemv.dense_gemv_reference(x, w, b)
    for _ in range(2):  # the split-K workspace is left zeroed for the next call
        y = dense_gemv.dense_gemv(x, w, b, block_n=64, block_k=128, split_k=split_k)
        assert y.dtype == dtype and y.shape == (M, N)
        torch.testing.assert_close(y, ref, **TOL[dtype])
        torch.testing.assert_close(y.float(), F.linear(x.float(), w.float(),
                                   None if b is None else b.float()), **TOL[dtype])
        assert_workspace_zero()


def test_strided_x_and_every_m():
    # x as a view with a row stride wider than K (e.g. a slice of a larger activation)
    x_full, w, b = random_linear(16, 384, 48, torch.float32, seed=7, bias=True)
    wide = torch.cat([x_full, torch.randn(16, 5)], dim=1)
    for M in range(1, 17):
        x = wide[:M, :384]
        y = dense_gemv.dense_gemv(x, w, b, block_n=64, block_k=128, split_k=2)
        torch.testing.assert_close(y, dense_gemv.dense_gemv_reference(x, w, b), **TOL[x.dtype])
    # one row on tensor cores (x^T padded to 16 columns) instead of CUDA-core FMAs
    y = dense_gemv.dense_gemv(wide[:1, :384], w, b, block_n=64, block_k=128, tensor_cores=True)
    torch.testing.assert_close(y, dense_gemv.dense_gemv_reference(wide[:1, :384], w, b))


def fp8_linear(M, K, N, kind, dtype, seed, bias=False):
    """x, an e4m3 weight [N, K] and its fp32 scale for `kind` (per tensor, per channel, or per
    [128, 128] block), the weight block, a bias."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    rows, cols, block = {"tensor": (1, 1, None), "channel": (N, 1, None),
                         "block": (-(-N // 128), -(-K // 128), (128, 128))}[kind]
    scale = torch.rand(rows, cols, generator=g) * 1e-3 + 1e-4
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, w, scale, block, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", ["tensor", "channel", "block"])
def test_fp8_weight_every_m(dtype, kind):
    # N and K not multiples of the tiles nor of the 128-blocks (a partial last scale block)
    K, N = 300, 200
    x_all, w, scale, block, b = fp8_linear(16, K, N, kind, dtype, seed=5, bias=kind != "tensor")
    for M in range(1, 17):
        x = x_all[:M]
        ref = dense_gemv.dense_gemv_reference(x, w, b, scale, block)
        dequantized = w.float() * (scale if block is None else scale.repeat_interleave(
            128, 0)[:N].repeat_interleave(128, 1)[:, :K])
        torch.testing.assert_close(ref.float(), F.linear(x.float(), dequantized, None if b is None
                                   else b.float()).to(dtype).float(), **TOL[dtype])
        for config in (dense_gemv.fp8_gemv_config(M, block), dict(block_n=32, split_k=1)):
            y = dense_gemv.dense_gemv(x, w, b, scale, block, **config)
            assert y.dtype == dtype and y.shape == (M, N)
            torch.testing.assert_close(y, ref, **TOL[dtype])
        assert_workspace_zero()


@pytest.mark.parametrize("kind", ["channel", "block"])
def test_fp8_weight_bf16_one_row(kind):
    # one bf16 row: the CUDA-core path, e4m3 converted to bf16 in registers
    x, w, scale, block, b = fp8_linear(1, 1000, 130, kind, torch.bfloat16, seed=6, bias=True)
    y = dense_gemv.dense_gemv(x, w, b, scale, block, **dense_gemv.fp8_gemv_config(1, block))
    ref = dense_gemv.dense_gemv_reference(x, w, b, scale, block)
    torch.testing.assert_close(y, ref, rtol=1.6e-2, atol=1.6e-2)
    assert_workspace_zero()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("kind", ["dense", "channel", "block"])
def test_silu_and_mul_input(dtype, M, kind):
    # x = silu(gate) * up formed as the input is loaded: the down projection at decode
    K, N = 200, 136
    if kind == "dense":
        _, w, b = random_linear(M, K, N, dtype, seed=8, bias=True)
        scale = block = None
    else:
        _, w, scale, block, b = fp8_linear(M, K, N, kind, dtype, seed=8, bias=True)
    gate_up = torch.randn(M, 2 * K, generator=torch.Generator().manual_seed(9)).to(dtype)
    config = dict(block_n=32, block_k=128, split_k=2)
    y = dense_gemv.dense_gemv(gate_up, w, b, scale, block, silu_and_mul=True, **config)
    act = activation.silu_and_mul_ref(gate_up)
    torch.testing.assert_close(y, dense_gemv.dense_gemv_reference(gate_up, w, b, scale, block,
                                                                  silu_and_mul=True),
                               **TOL[dtype])
    torch.testing.assert_close(y, dense_gemv.dense_gemv(act, w, b, scale, block, **config),
                               **TOL[dtype])
    with pytest.raises(ValueError, match="2K"):
        dense_gemv.dense_gemv(act, w, b, scale, block, silu_and_mul=True)


DOT_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=1e-3),
           torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}  # one ulp of the output dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["tensor", "channel", "block"])
@pytest.mark.parametrize("M", [1, 3, 8, 16])
def test_fp8_dot_quantizes_x_per_row_and_step(dtype, kind, M):
    # W8A8 in the GEMV (quantize_x): the e4m3 x^T of each K step on FP8 tensor cores; the
    # reference quantizes the same [M, block_k] slices, so only fp32 sums differ. K = 300 is
    # no multiple of block_k (a masked last step), x^T padded to 8 or 16 columns
    K, N = 300, 200
    x, w, scale, block, b = fp8_linear(M, K, N, kind, dtype, seed=M + 10, bias=kind != "tensor")
    x[0, :40] *= 50  # one large step: its own scale, not the row's
    full = dense_gemv.dense_gemv_reference(x, w, b, scale, block).float()
    for config in (dense_gemv.fp8_gemv_config(M, block, "w8a8dot"),
                   dict(block_n=32, block_k=64, split_k=2, min_block_m=8, quantize_x=True)):
        y = dense_gemv.dense_gemv(x, w, b, scale, block, **config)
        assert y.dtype == dtype and y.shape == (M, N)
        ref = dense_gemv.dense_gemv_reference(x, w, b, scale, block, **config)
        torch.testing.assert_close(y, ref, **DOT_TOL[dtype])
        assert (ref.float() - full).norm() / full.norm() < 0.05  # x's e4m3 rounding, no more
        assert_workspace_zero()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("kind", ["channel", "block"])
def test_fp8_dot_silu_and_mul_input(dtype, M, kind):
    # (not bf16: the interpreter rounds fp32 -> bf16 otherwise than torch, and the product
    # formed on load is rounded to x's dtype before it is quantized)
    K, N = 200, 136
    _, w, scale, block, b = fp8_linear(M, K, N, kind, dtype, seed=8, bias=True)
    gate_up = torch.randn(M, 2 * K, generator=torch.Generator().manual_seed(9)).to(dtype)
    config = dict(block_n=32, block_k=128, split_k=2, min_block_m=8, quantize_x=True)
    y = dense_gemv.dense_gemv(gate_up, w, b, scale, block, silu_and_mul=True, **config)
    act = activation.silu_and_mul_ref(gate_up)  # x rounded to its dtype before the quantization
    torch.testing.assert_close(y, dense_gemv.dense_gemv_reference(
        gate_up, w, b, scale, block, silu_and_mul=True, **config), **DOT_TOL[dtype])
    torch.testing.assert_close(y, dense_gemv.dense_gemv(act, w, b, scale, block, **config),
                               **DOT_TOL[dtype])


def test_fp8_dot_configs_cover_every_m():
    for M in range(1, dense_gemv.FP8_GEMV_MAX_M["w8a8dot"] + 1):
        for block in (None, (128, 128)):
            config = dense_gemv.fp8_gemv_config(M, block, "w8a8dot")
            assert config["quantize_x"] and (block is None or 128 % config["block_n"] == 0)
    assert "quantize_x" not in dense_gemv.fp8_gemv_config(1, None)  # W8A16, the default
    assert dense_gemv.FP8_GEMV_MAX_M["w8a16"] == 1


def test_fp8_rejects_bad_scales():
    x, w, scale, block, _ = fp8_linear(2, 256, 128, "block", torch.float32, seed=1)
    with pytest.raises(ValueError, match="needs its weight_scale"):
        dense_gemv.dense_gemv(x, w)
    with pytest.raises(ValueError, match="must be \\[1, 2\\]"):
        dense_gemv.dense_gemv(x, w, None, scale[:, :1], block)
    with pytest.raises(ValueError, match="whole tiles"):
        dense_gemv.dense_gemv(x, w, None, scale, block, block_n=256)
    with pytest.raises(ValueError, match="per channel"):
        dense_gemv.dense_gemv(x, w, None, torch.ones(3, 1))
    with pytest.raises(ValueError, match="float32"):
        dense_gemv.dense_gemv(x, w, None, torch.ones(128, 1).half())
    with pytest.raises(ValueError, match="quantize_x needs an FP8 weight"):
        dense_gemv.dense_gemv(x, torch.randn(128, 256), quantize_x=True)
    with pytest.raises(ValueError, match="quantize_x=True"):
        dense_gemv.dense_gemv(x[:1], w, None, scale, block, quantize_x=True, tensor_cores=False)


def test_rejects_bad_arguments():
    x, w, _ = random_linear(65, 64, 32, torch.float32, seed=1)
    with pytest.raises(ValueError, match="1 to 64"):
        dense_gemv.dense_gemv(x, w)
    with pytest.raises(ValueError, match="contiguous along K"):
        dense_gemv.dense_gemv(x[:2], w.t().contiguous().t())
    with pytest.raises(ValueError, match="x's dtype"):
        dense_gemv.dense_gemv(x[:2], w.half())
    with pytest.raises(ValueError, match="one row"):
        dense_gemv.dense_gemv(x[:2], w, tensor_cores=False)


def test_every_decode_shape_has_a_path_or_cublas():
    for M in range(1, dense_gemv.GEMV_MAX_M + 1):
        for N, K in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)):
            config = dense_gemv.gemv_config(M, N, K)
            assert config is None or isinstance(config, dict)


def test_dense_linear_keeps_torch_on_cpu(monkeypatch):
    # on CPU (even under the interpreter) the dense linear is F.linear: the GEMV is not called
    def fail(*args, **kwargs):
        raise AssertionError("dense_gemv called on CPU")

    monkeypatch.setattr(dense_gemv, "dense_gemv", fail)
    x, w, b = random_linear(3, 64, 32, torch.float32, seed=2, bias=True)
    torch.testing.assert_close(dense_gemv.dense_linear(x, w, b), F.linear(x, w, b))


def test_parallel_linears_use_dense_linear(monkeypatch):
    # column- and row-parallel layers and the LM head (TP size 1 here: the shard shapes are what
    # they hold) go through dense_linear, so the GEMV sees each rank's [out_r, in_r] weight
    seen = []
    real = dense_gemv.dense_linear

    def spy(x, weight, bias=None):
        seen.append(tuple(weight.shape))
        return real(x, weight, bias)

    monkeypatch.setattr(dense_gemv, "dense_linear", spy)
    col, row = ColumnParallelLinear(64, 96, bias=True), RowParallelLinear(96, 64, bias=True)
    head = ParallelLMHead(100, 64)
    for layer in (col, row, head):
        for p in layer.parameters():
            p.data.normal_()
    x = torch.randn(2, 64)
    y = row(col(x))
    torch.testing.assert_close(y, F.linear(F.linear(x, col.weight, col.bias), row.weight,
                                           row.bias))
    torch.testing.assert_close(head(y), F.linear(y, head.weight))
    assert seen == [(96, 64), (64, 96), (100, 64)]


def test_table_picks_the_measured_paths():
    # the H200 table: every one-row shape takes the GEMV; at 2..8 rows the Llama-3-8B layers
    # take it with a tile each, a small model's wide layers keep cuBLAS; 9..16 rows cuBLAS but
    # for the LM heads
    assert dense_gemv.gemv_config(1, 6144, 1024) == dict(split_k=1)
    assert dense_gemv.gemv_config(1, 28672, 4096) == dict(programs_per_sm=2)
    layers = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
              "down": (4096, 14336)}
    tiles = {name: dense_gemv.gemv_config(5, N, K) for name, (N, K) in layers.items()}
    assert all(tile is not None and tile["min_block_m"] == 8 for tile in tiles.values())
    assert tiles["o"]["block_n"] == 128 and tiles["qkv"]["programs_per_sm"] == 4
    assert tiles["gate_up"]["programs_per_sm"] == tiles["down"]["programs_per_sm"] == 1
    assert tiles["gate_up"].get("w_tma") and not tiles["down"].get("w_tma")
    assert all(dense_gemv.gemv_config(9, N, K) is None for N, K in layers.values())
    assert dense_gemv.gemv_config(8, 6144, 1024) is None  # Qwen3-0.6B's gate-up
    assert dense_gemv.gemv_config(8, 1024, 2048) == dense_gemv._TENSOR_CORES  # its o
    assert dense_gemv.gemv_config(16, 128256, 4096)["min_block_m"] == 8
    # past GEMV_MAX_M rows dense_linear keeps cuBLAS, though the kernel takes up to DOT_MAX_M
    assert dense_gemv.GEMV_MAX_M < dense_gemv.DOT_MAX_M
    assert dense_gemv.gemv_config(dense_gemv.GEMV_MAX_M + 1, 128256, 4096) is None


@triton_jit
def _bytes_as_f32_kernel(words_ptr, out_ptr, N: tl.constexpr):
    words = tl.load(words_ptr + tl.arange(0, N))
    for j in tl.static_range(4):
        tl.store(out_ptr + j * N + tl.arange(0, N), dense_gemv._e4m3_byte_as_f32(words, j))


def test_e4m3_bit_trick_is_exact_for_every_byte():
    # w8_words' conversion: byte j of a word -> e4m3 * 2^-120 in fp32, for all 256 patterns in
    # each of the 4 positions (subnormals, both zeros, +-448; the NaN patterns left out)
    codes = torch.arange(256, dtype=torch.uint8)
    packed = torch.stack([codes.roll(64 * j) for j in range(4)], 1)  # [256 words, 4 bytes]
    out = torch.empty(4, 256)
    _bytes_as_f32_kernel[(1,)](packed.reshape(-1).view(torch.int32), out, N=256)
    for j in range(4):
        values = packed[:, j].view(torch.float8_e4m3fn).float()
        finite = ~values.isnan()
        assert torch.equal(out[j][finite], values[finite] * 2.0**-120), j
        assert torch.equal(out[j][finite].signbit(), values[finite].signbit())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["tensor", "channel", "block"])
def test_fp8_one_row_words_match_the_conversion(dtype, kind):
    # w8_words: the same products as the converted weights (every byte value among the weights),
    # summed in another order; K = 1000 with block_k 128: a masked last step; silu_and_mul too
    x, w, scale, block, b = fp8_linear(1, 1000, 130, kind, dtype, seed=11, bias=kind != "tensor")
    w[:, :256] = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float() \
        .nan_to_num(0.0).to(torch.float8_e4m3fn)
    tol = DOT_TOL[dtype] if dtype != torch.float32 else dict(rtol=1e-5, atol=1e-4)
    for silu in (False, True):
        xs = torch.cat([x, x.flip(1)], 1) if silu else x
        ref = dense_gemv.dense_gemv_reference(xs, w, b, scale, block, silu_and_mul=silu)
        config = dict(block_n=16, block_k=128, split_k=3, silu_and_mul=silu)
        y = dense_gemv.dense_gemv(xs, w, b, scale, block, w8_words=True, **config)
        torch.testing.assert_close(y, ref, **tol)
        torch.testing.assert_close(y, dense_gemv.dense_gemv(xs, w, b, scale, block, **config),
                                   **tol)
        assert_workspace_zero()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["tensor", "channel", "block"])
def test_fp8_one_row_tma_matches_pointer_loads(monkeypatch, dtype, kind):
    # w_tma: the one-row tiles by TMA descriptor (rows past N = 130 and columns past K = 1008 =
    # 7 * 128 + 112 in as zeros), against pointer loads and the reference; silu_and_mul too
    operands = []
    make = dense_gemv.w_operand
    monkeypatch.setattr(dense_gemv, "w_operand", lambda *args: operands.append(make(*args))
                        or operands[-1])
    x, w, scale, block, b = fp8_linear(1, 1008, 130, kind, dtype, seed=12, bias=kind != "tensor")
    tol = DOT_TOL[dtype] if dtype != torch.float32 else dict(rtol=1e-5, atol=1e-4)
    for silu in (False, True):
        xs = torch.cat([x, x.flip(1)], 1) if silu else x
        ref = dense_gemv.dense_gemv_reference(xs, w, b, scale, block, silu_and_mul=silu)
        for config in (dict(block_n=16, block_k=128, split_k=3, num_stages=6),
                       dict(block_n=64, block_k=256 if block is None else 128, split_k=1)):
            operands.clear()
            y = dense_gemv.dense_gemv(xs, w, b, scale, block, silu_and_mul=silu, w_tma=True,
                                      **config)
            assert not isinstance(operands[0], torch.Tensor)  # a descriptor
            torch.testing.assert_close(y, ref, **tol)
            torch.testing.assert_close(y, dense_gemv.dense_gemv(
                xs, w, b, scale, block, silu_and_mul=silu, **config), **tol)
            assert_workspace_zero()
    operands.clear()  # K 1000: rows 1000 bytes apart, no descriptor; w8_words: no descriptor
    x, w, scale, block, b = fp8_linear(1, 1000, 130, kind, dtype, seed=12)
    for words in (False, True):
        y = dense_gemv.dense_gemv(x, w, b, scale, block, w_tma=True, w8_words=words,
                                  block_k=128)
        torch.testing.assert_close(y, dense_gemv.dense_gemv_reference(x, w, b, scale, block),
                                   **tol)
    w16 = w[:, :992].contiguous()
    dense_gemv.dense_gemv(x[:, :992], w16, b, scale[:, :8] if block else scale, block,
                          w_tma=True, w8_words=True, block_k=128)
    assert all(isinstance(op, torch.Tensor) for op in operands) and len(operands) == 3
