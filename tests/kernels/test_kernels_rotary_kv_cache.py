"""Rotary fused with the KV store (and the q/k RMSNorm) under the Triton interpreter: the kernel vs
its reference (the separate ops in a row), and the reference vs an independent computation."""

import pytest
import torch

from tinypaged.kernels import rotary_kv_cache
from tinypaged.kernels.rotary import build_cos_sin_cache
from tinypaged.models.rope import RopeSpec

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")

DTYPES = [torch.float32, torch.float16]
BLOCK_SIZE, NUM_BLOCKS = 16, 3


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def tol(dtype):
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 2e-3}


def step(tokens, num_q_heads, num_kv_heads, head_dim, dtype, seed=0):
    """q, k, v as strided views into one fused QKV output, caches, slots with padding rows."""
    sizes = [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    qkv = randn(tokens, sum(sizes), dtype=dtype, seed=seed) * 2
    q, k, v = (t.view(tokens, -1, head_dim) for t in qkv.split(sizes, dim=-1))
    gen = torch.Generator().manual_seed(seed + 1)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:tokens]
    slots[1::4] = -1  # padding rows of a CUDA-graph batch: nothing stored
    positions = torch.randint(0, 256, (tokens,), generator=gen)
    caches = [randn(NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim, dtype=dtype, seed=seed + i)
              for i in (2, 3)]
    return positions, q, k, v, caches, slots


def cos_sin_tables(rotary_dim):
    """A plain table, Llama 3.1's scaled one and a yarn-like one (own inv_freq, cos/sin scaled)."""
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    inv_freq = tuple((0.5 ** torch.arange(rotary_dim // 2).float()).tolist())
    return {
        "default": build_cos_sin_cache(rotary_dim, 256, 10000.0),
        "llama3": RopeSpec(500000.0, rotary_dim, 256, scaling=llama3).cos_sin_cache(),
        "yarn": RopeSpec(10000.0, rotary_dim, 256, inv_freq=inv_freq,
                         attention_factor=1.2).cos_sin_cache(),
    }


def run_both(dtype, heads, head_dim, rotary_dim, interleaved, table, with_norm, tokens=7):
    positions, q, k, v, (k_cache, v_cache), slots = step(tokens, *heads, head_dim, dtype)
    cache = cos_sin_tables(rotary_dim)[table]
    weights = (None, None)
    if with_norm:
        weights = (randn(head_dim, seed=7) + 1, randn(head_dim, seed=8) + 1)
    k_before, v_before = k.clone(), v.clone()
    q_ref, k_ref_cache, v_ref_cache = q.clone(), k_cache.clone(), v_cache.clone()
    got = rotary_kv_cache.rotary_store_kv_triton(positions, q, k, v, k_cache, v_cache, slots,
                                                 cache, rotary_dim, interleaved, *weights, 1e-6)
    assert got is q  # in place
    rotary_kv_cache.rotary_store_kv_ref(positions, q_ref, k.clone(), v, k_ref_cache, v_ref_cache,
                                        slots, cache, rotary_dim, interleaved, *weights, 1e-6)
    torch.testing.assert_close(q, q_ref, **tol(dtype))
    torch.testing.assert_close(k_cache, k_ref_cache, **tol(dtype))
    assert torch.equal(v_cache, v_ref_cache)
    assert torch.equal(k, k_before) and torch.equal(v, v_before)  # k rotates into the cache only
    return positions, q, k, v, k_cache, v_cache, slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (80, 40), (96, 32)],
                         ids=["full", "partial-odd", "partial-third"])
@pytest.mark.parametrize("with_norm", [False, True], ids=["plain", "qk_norm"])
def test_rotary_store_kv_kernel(dtype, interleaved, head_dim, rotary_dim, with_norm):
    positions, q, k, v, k_cache, v_cache, slots = run_both(
        dtype, (6, 3), head_dim, rotary_dim, interleaved, "default", with_norm)
    cached = [t for t, s in enumerate(slots.tolist()) if s >= 0]
    s = slots[cached]
    stored_v = v_cache[s // BLOCK_SIZE, s % BLOCK_SIZE]  # [n, Hk, D]
    assert torch.equal(stored_v, v[cached])
    if not with_norm:  # dims past rotary_dim reach the cache unchanged
        stored_k = k_cache[s // BLOCK_SIZE, s % BLOCK_SIZE]
        assert torch.equal(stored_k[..., rotary_dim:], k[cached][..., rotary_dim:])


@pytest.mark.parametrize("table", ["llama3", "yarn"])
def test_rotary_store_kv_kernel_scaled_tables(table):
    run_both(torch.float32, (4, 2), 64, 64, False, table, with_norm=False)


def test_padding_rows_leave_the_cache_alone():
    positions, q, k, v, (k_cache, v_cache), slots = step(4, 2, 1, 32, torch.float32)
    slots[:] = -1
    k_before, v_before, q_before = k_cache.clone(), v_cache.clone(), q.clone()
    cache = build_cos_sin_cache(32, 256, 10000.0)
    rotary_kv_cache.rotary_store_kv_triton(positions, q, k, v, k_cache, v_cache, slots, cache, 32)
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)
    assert not torch.equal(q, q_before)  # q still rotates (its row is computed, then ignored)


def test_reference_matches_float64_norm_then_rotation():
    head_dim, rotary_dim, eps = 16, 8, 1e-6
    positions, q, k, v, (k_cache, v_cache), slots = step(5, 2, 1, head_dim, torch.float32)
    slots[:] = torch.arange(5)
    cache = build_cos_sin_cache(rotary_dim, 256, 10000.0)
    wq, wk = randn(head_dim, seed=7), randn(head_dim, seed=8)
    q_in, k_in = q.double(), k.double()
    rotary_kv_cache.rotary_store_kv_ref(positions, q, k, v, k_cache, v_cache, slots, cache,
                                        rotary_dim, False, wq, wk, eps)
    freqs = 10000.0 ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angle = positions.double()[:, None, None] * freqs  # [T, 1, rotary_dim / 2]
    for x, w, got in ((q_in, wq, q), (k_in, wk, k_cache[0, :5])):
        x = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()
        x1, x2 = x[..., : rotary_dim // 2], x[..., rotary_dim // 2: rotary_dim]
        want = torch.cat((x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin(),
                          x[..., rotary_dim:]), dim=-1)
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v_cache[0, :5], v)


def test_rotary_store_kv_bad_arguments():
    positions, q, k, v, (k_cache, v_cache), slots = step(4, 2, 1, 32, torch.float32)
    cache = build_cos_sin_cache(32, 256, 10000.0)
    args = (positions, q, k, v, k_cache, v_cache, slots, cache, 32)
    with pytest.raises(ValueError, match="both"):
        rotary_kv_cache.rotary_store_kv(*args, False, torch.ones(32), None)
    with pytest.raises(ValueError, match="q_norm_weight must be"):
        rotary_kv_cache.rotary_store_kv(*args, False, torch.ones(16), torch.ones(32))
    with pytest.raises(ValueError, match="slot_mapping"):
        rotary_kv_cache.rotary_store_kv(*args[:6], slots[:2], cache, 32)
    with pytest.raises(ValueError, match="rotary_dim"):
        rotary_kv_cache.rotary_store_kv(*args[:8], 33)
