"""RMSNorm, rotary, SiLU-and-mul and KV store under the Triton interpreter: kernels vs the torch
references, and the references vs independent float64 / complex-number computations."""

import pytest
import torch

from tinypaged.kernels import activation, kv_cache, norm, rotary
from tinypaged.kernels.rotary import build_cos_sin_cache

# Triton 3.6's interpreter turns loop bounds into ints through 1-element arrays; numpy < 2.4 warns
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")

DTYPES = [torch.float32, torch.float16]


def tol(dtype):
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 2e-3}


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ----------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 96), (3, 4, 64)], ids=["rows", "per-head"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_kernel(dtype, shape, with_residual):
    x, weight = randn(*shape, dtype=dtype), randn(shape[-1], seed=1)
    residual = randn(*shape, dtype=dtype, seed=2) if with_residual else None
    got = norm.rms_norm_triton(x, weight, 1e-6, residual)
    want = norm.rms_norm_ref(x, weight, 1e-6, residual)
    if with_residual:
        assert got[1].dtype == dtype
        torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)  # the same fp32 sum, rounded
        got, want = got[0], want[0]
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got, want, **tol(dtype))


def test_rms_norm_reference_matches_float64():
    x, weight, residual = randn(5, 48), randn(48, seed=1), randn(5, 48, seed=2)
    r = x.double() + residual.double()
    want = r / torch.sqrt((r * r).mean(-1, keepdim=True) + 1e-5) * weight.double()
    out, summed = norm.rms_norm_ref(x, weight, 1e-5, residual)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(summed.double(), r, atol=1e-6, rtol=1e-6)


def test_rms_norm_bad_arguments():
    x = randn(4, 32)
    with pytest.raises(ValueError, match="weight"):
        norm.rms_norm(x, randn(16), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        norm.rms_norm(x, randn(32), 1e-6, x.half())
    with pytest.raises(ValueError, match="residual"):
        norm.rms_norm(x, randn(32), 1e-6, x[:2])
    with pytest.raises(ValueError, match="x must"):
        norm.rms_norm(x.long(), randn(32), 1e-6)


# ----------------------------------------------------------------------------- SiLU-and-mul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter,block", [(64, None), (300, 128)])  # 300: 3 column blocks, masked
def test_silu_and_mul_kernel(dtype, inter, block):
    x = randn(5, 2 * inter, dtype=dtype) * 3
    got = activation.silu_and_mul_triton(x, block=block)
    assert got.shape == (5, inter) and got.dtype == dtype
    torch.testing.assert_close(got, activation.silu_and_mul_ref(x), **tol(dtype))


def test_silu_and_mul_reference_matches_float64():
    x = randn(3, 2, 40) * 4  # leading dims are rows
    gate, up = x.double()[..., :20], x.double()[..., 20:]
    want = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(activation.silu_and_mul_ref(x).double(), want, atol=1e-5, rtol=1e-5)


def test_silu_and_mul_bad_arguments():
    with pytest.raises(ValueError, match="even"):
        activation.silu_and_mul(randn(2, 7))
    with pytest.raises(ValueError, match="even"):
        activation.gelu_tanh_and_mul(randn(2, 7))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp2")  # tanh's exp2 -> inf -> 1
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter,block", [(64, None), (300, 128)])
def test_gelu_tanh_and_mul_kernel(dtype, inter, block):
    x = randn(5, 2 * inter, dtype=dtype) * 4  # tanh saturates at both ends
    got = activation.gelu_tanh_and_mul_triton(x, block=block)
    assert got.shape == (5, inter) and got.dtype == dtype
    torch.testing.assert_close(got, activation.gelu_tanh_and_mul_ref(x), **tol(dtype))
    assert not torch.allclose(got.float(), activation.silu_and_mul_ref(x).float(), atol=0.05)


def test_gelu_tanh_and_mul_reference_matches_float64():
    x = randn(3, 2, 40) * 4
    gate, up = x.double()[..., :20], x.double()[..., 20:]
    inner = (2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3)
    want = 0.5 * gate * (1 + torch.tanh(inner)) * up
    torch.testing.assert_close(activation.gelu_tanh_and_mul_ref(x).double(), want, atol=1e-5,
                               rtol=1e-5)


# ----------------------------------------------------------------------------- rotary


def fused_qkv(tokens, num_q_heads, num_kv_heads, head_dim, dtype):
    """q and k as the model gets them: non-contiguous views into one fused QKV output."""
    qkv = randn(tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    sizes = [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    q, k, _ = qkv.split(sizes, dim=-1)
    return q.view(tokens, num_q_heads, head_dim), k.view(tokens, num_kv_heads, head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "glm"])
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (128, 64)], ids=["full", "partial"])
def test_rotary_kernel(dtype, interleaved, head_dim, rotary_dim):
    cache = build_cos_sin_cache(rotary_dim, 512, 10000.0)
    positions = torch.randint(0, 512, (6,), generator=torch.Generator().manual_seed(3))
    q, k = fused_qkv(6, 6, 2, head_dim, dtype)
    q_ref, k_ref = q.clone(), k.clone()
    q_before = q.clone()
    got = rotary.rotary_embedding_triton(positions, q, k, cache, rotary_dim, interleaved)
    assert got[0] is q and got[1] is k  # in place
    rotary.rotary_embedding_ref(positions, q_ref, k_ref, cache, rotary_dim, interleaved)
    torch.testing.assert_close(q, q_ref, **tol(dtype))
    torch.testing.assert_close(k, k_ref, **tol(dtype))
    assert torch.equal(q[..., rotary_dim:], q_before[..., rotary_dim:])  # partial: rest untouched
    assert not torch.equal(q[..., :rotary_dim], q_before[..., :rotary_dim])


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "glm"])
def test_rotary_reference_matches_complex_multiplication(interleaved):
    head_dim, rotary_dim, base = 16, 8, 10000.0
    positions = torch.tensor([0, 1, 5, 1000])
    q, k = randn(4, 3, head_dim), randn(4, 1, head_dim, seed=1)
    q_ref, k_ref = q.clone(), k.clone()
    cache = build_cos_sin_cache(rotary_dim, 1024, base)
    rotary.rotary_embedding_ref(positions, q_ref, k_ref, cache, rotary_dim, interleaved)
    freqs = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    turn = torch.polar(torch.ones(4, rotary_dim // 2, dtype=torch.float64),
                       positions.double()[:, None] * freqs)[:, None, :]  # e^{i pos f_j}
    for x, x_ref in ((q, q_ref), (k, k_ref)):
        rot = x[..., :rotary_dim].double()
        if interleaved:  # pair (2j, 2j+1) is the complex number x_2j + i x_2j+1
            z = torch.complex(rot[..., 0::2], rot[..., 1::2]) * turn
            want = torch.stack((z.real, z.imag), dim=-1).flatten(-2)
        else:  # pair (j, j + rotary_dim/2)
            z = torch.complex(rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2:]) * turn
            want = torch.cat((z.real, z.imag), dim=-1)
        torch.testing.assert_close(x_ref[..., :rotary_dim].double(), want, atol=1e-4, rtol=1e-4)
        assert torch.equal(x_ref[..., rotary_dim:], x[..., rotary_dim:])


def test_cos_sin_cache_llama3_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config = LlamaConfig(hidden_size=1024, num_attention_heads=8, head_dim=128,
                         rope_parameters=params, max_position_embeddings=131072)
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    cache = build_cos_sin_cache(128, 4096, 500000.0, params)
    angles = torch.arange(4096).float()[:, None] * inv_freq  # as transformers computes them
    assert cache.dtype == torch.float32 and cache.shape == (4096, 128)
    torch.testing.assert_close(cache, torch.cat((angles.cos(), angles.sin()), dim=-1))
    plain = build_cos_sin_cache(128, 4096, 500000.0)
    assert not torch.allclose(cache, plain)  # the scaling changed the low frequencies


def test_cos_sin_cache_linear_scaling_divides_positions():
    scaled = build_cos_sin_cache(32, 64, 10000.0, {"rope_type": "linear", "factor": 4.0})
    plain = build_cos_sin_cache(32, 16, 10000.0)
    torch.testing.assert_close(scaled[0::4], plain)  # position 4j scaled = position j plain
    legacy = build_cos_sin_cache(32, 64, 10000.0, {"type": "linear", "factor": 4.0})
    assert torch.equal(legacy, scaled)  # older configs spell the key "type"
    with pytest.raises(ValueError, match="rope_scaling"):
        build_cos_sin_cache(32, 64, 10000.0, {"rope_type": "yarn", "factor": 4.0})


def test_rotary_bad_arguments():
    cache = build_cos_sin_cache(32, 16, 10000.0)
    q, k, positions = randn(3, 4, 32), randn(3, 2, 32), torch.arange(3)
    with pytest.raises(ValueError, match="positions"):
        rotary.rotary_embedding(torch.arange(4), q, k, cache, 32)
    with pytest.raises(ValueError, match="k must match"):
        rotary.rotary_embedding(positions, q, k.half(), cache, 32)
    with pytest.raises(ValueError, match="rotary_dim"):
        rotary.rotary_embedding(positions, q, k, cache, 33)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rotary.rotary_embedding(positions, q, k, cache, 16)


# ----------------------------------------------------------------------------- KV store


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (32, 128)])
def test_store_kv_kernel(dtype, block_size, head_dim):
    num_blocks, num_kv_heads, tokens = 4, 2, 9
    g = torch.Generator().manual_seed(0)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[3] = -1  # skipped
    qkv = randn(tokens, 3 * num_kv_heads * head_dim, dtype=dtype)  # k, v: strided views
    _, k, v = (t.view(tokens, num_kv_heads, head_dim) for t in qkv.chunk(3, dim=-1))
    k_cache = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, seed=5)
    v_cache = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, seed=6)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    k_loop, v_loop = k_cache.clone(), v_cache.clone()
    kv_cache.store_kv_triton(k, v, k_cache, v_cache, slots)
    kv_cache.store_kv_ref(k, v, k_ref, v_ref, slots)
    for t, slot in enumerate(slots.tolist()):  # the independent check of the slot layout
        if slot >= 0:
            k_loop[slot // block_size, slot % block_size] = k[t]
            v_loop[slot // block_size, slot % block_size] = v[t]
    for got in (k_ref, k_cache):
        assert torch.equal(got, k_loop)
    for got in (v_ref, v_cache):
        assert torch.equal(got, v_loop)
    assert not torch.equal(k_cache, randn(*k_cache.shape, dtype=dtype, seed=5))


def test_store_kv_bad_arguments():
    k = randn(3, 2, 16)
    cache = randn(4, 16, 2, 16)
    slots = torch.arange(3)
    with pytest.raises(ValueError, match="slot_mapping"):
        kv_cache.store_kv(k, k, cache, cache.clone(), torch.arange(4))
    with pytest.raises(ValueError, match="slot_mapping"):
        kv_cache.store_kv(k, k, cache, cache.clone(), slots.float())
    with pytest.raises(ValueError, match="k and v"):
        kv_cache.store_kv(k, k[:, :1], cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="k_cache"):
        kv_cache.store_kv(k, k, randn(4, 16, 3, 16), cache.clone(), slots)
    with pytest.raises(ValueError, match="v_cache"):
        kv_cache.store_kv(k, k, cache, cache.half(), slots)


@pytest.mark.parametrize("dtype", DTYPES)  # bf16: the interpreter truncates where the GPU
@pytest.mark.parametrize("group", [None, 128])  # rounds (benchmarks/kernel_bench.py --only fp8)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quant_fp8_kernel(dtype, group, with_residual):
    # H = 384: not a power of two (a padded block, three groups of 128 in a 512-wide block)
    x, weight = randn(9, 384, dtype=dtype) * 4, randn(384, seed=1)
    x[3] = 0.0  # an all-zero row keeps a finite scale
    residual = randn(9, 384, dtype=dtype, seed=2) if with_residual else None
    if residual is not None:
        residual[3] = 0.0
    got = norm.rms_norm_quant_fp8_triton(x, weight, 1e-6, residual, group)
    want = norm.rms_norm_quant_fp8_ref(x, weight, 1e-6, residual, group)
    q, s = got[:2]
    assert q.dtype == torch.float8_e4m3fn and q.shape == (9, 384)
    assert s.shape == (9, 1 if group is None else 3)
    torch.testing.assert_close(s, want[1], rtol=1e-5, atol=0)
    # the same e4m3 values but where the norm's last bit in x's dtype differed and moved an e4m3
    # rounding
    assert (q.float() != want[0].float()).float().mean() < 0.01
    torch.testing.assert_close(q.float() * s.repeat_interleave(384 // s.shape[1], 1),
                               want[0].float() * want[1].repeat_interleave(384 // s.shape[1], 1),
                               rtol=0.07, atol=1e-6)
    if with_residual:
        torch.testing.assert_close(got[2], want[2], atol=0, rtol=0)  # the same sum, rounded


def test_rms_norm_quant_fp8_reference_is_norm_then_quantize():
    x, weight = randn(4, 256), randn(256, seed=1)
    q, s = norm.rms_norm_quant_fp8(x, weight, 1e-6, group=128)  # the CPU path: the reference
    normed = norm.rms_norm_ref(x, weight, 1e-6)
    torch.testing.assert_close(q.float() * s.repeat_interleave(128, 1), normed,
                               rtol=2 ** -4, atol=1e-6)  # 3 mantissa bits
    assert s.shape == (4, 2) and q.float().abs().amax() == 448.0
    with pytest.raises(ValueError, match="whole number of groups"):
        norm.rms_norm_quant_fp8(x, weight, 1e-6, group=96)
