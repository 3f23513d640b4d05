"""The FP8 (e4m3) KV cache: the store kernels (plain and fused with rotary) write what their
references write, saturating at +-448; the attention kernels (decode and varlen, interpreted)
read an FP8 cache as their reference does; and a tiny model's logits with an FP8 cache stay
within a stated tolerance of those with a full-precision cache."""

import pytest
import torch
from helpers.models import (  # noqa: F401  (single_thread: autouse fixture)
    build_model,
    checkpoint_weights,
    paged_logits,
    single_thread,
    tiny_hf_model,
)

from tinypaged.kernels import attention, kv_cache, rotary_kv_cache
from tinypaged.kernels.rotary import build_cos_sin_cache

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")
FP8 = torch.float8_e4m3fn


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def caches(shape):
    return [torch.zeros(shape, dtype=FP8) for _ in range(4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_matches_reference_and_saturates(interpret, dtype):
    gen = torch.Generator().manual_seed(0)
    k = (torch.randn(6, 2, 16, generator=gen) * 200).to(dtype)  # past 448: saturated, not NaN
    v = torch.randn(6, 2, 16, generator=gen).to(dtype) * 1e-3  # down to e4m3's subnormals
    slots = torch.tensor([0, 3, -1, 9, 15, 6])
    kc, vc, kr, vr = caches((4, 4, 2, 16))
    kv_cache.store_kv(k, v, kc, vc, slots)
    kv_cache.store_kv_ref(k, v, kr, vr, slots)
    assert torch.equal(kc.float(), kr.float()) and torch.equal(vc.float(), vr.float())
    stored = kr.view(-1, 2, 16)[slots[slots >= 0]].float()
    assert stored.abs().max() == 448.0 and not stored.isnan().any()
    expected = k[slots >= 0].float().clamp(-448, 448)
    assert ((stored - expected).abs() <= expected.abs() / 16 + 1e-9).all()  # half an e4m3 step


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scaled", [False, True], ids=["scale-1", "checkpoint-scales"])
def test_rotary_store_matches_reference(interpret, dtype, scaled):
    """The fused rotary + store writes what its reference writes; with a checkpoint's k_scale /
    v_scale (models/kv_scales.py) it stores x / scale, so scale * stored gives x back."""
    gen = torch.Generator().manual_seed(1)
    T, Hq, Hk, D = 5, 4, 2, 32
    size = 0.05 if scaled else 3.0  # small values: without their scales they would be subnormal
    q, k, v = (torch.randn(T, h, D, generator=gen).to(dtype) * size for h in (Hq, Hk, Hk))
    positions = torch.randint(0, 64, (T,), generator=gen)
    slots = torch.tensor([2, -1, 7, 30, 11])
    cos_sin = build_cos_sin_cache(D, 64, 10000.0)
    kc, vc, kr, vr = caches((4, 8, Hk, D))
    scales = dict(k_scale=0.05 / 448 * 4, v_scale=0.05 / 448 * 3) if scaled else {}
    q1, q2 = q.clone(), q.clone()
    rotary_kv_cache.rotary_store_kv(positions, q1, k, v, kc, vc, slots, cos_sin, D, **scales)
    rotary_kv_cache.rotary_store_kv_ref(positions, q2, k, v, kr, vr, slots, cos_sin, D,
                                        **scales)
    assert torch.equal(kc.float(), kr.float()) and torch.equal(vc.float(), vr.float())
    if scaled:
        stored_v = vc.view(-1, Hk, D)[slots[slots >= 0]].float() * scales["v_scale"]
        want_v = v[slots >= 0].float()
        assert (stored_v - want_v).norm() / want_v.norm() < 0.05  # e4m3 rounding only


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("q_lens", [[1, 1, 1], [5, 1, 12]])  # decode kernel; varlen kernel
def test_attention_reads_fp8_cache_as_reference(interpret, dtype, q_lens):
    gen = torch.Generator().manual_seed(len(q_lens) + sum(q_lens))
    Hq, Hk, D, bs, nb = 4, 2, 32, 8, 12
    seq_lens = torch.tensor([9, 17, 20], dtype=torch.int32)
    kc = (torch.randn(nb, bs, Hk, D, generator=gen) * 2).to(FP8)
    vc = torch.randn(nb, bs, Hk, D, generator=gen).to(FP8)
    tables = torch.randperm(nb, generator=gen)[:9].reshape(3, 3).int()
    T = sum(q_lens)
    q = torch.randn(T, Hq, D, generator=gen).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = attention.paged_attention(q, kc, vc, tables, seq_lens, qsl, D ** -0.5)
    ref = attention.paged_attention_ref(q, kc, vc, tables, seq_lens, qsl, D ** -0.5)
    # the reference on the widened cache is the exact definition
    ref_wide = attention.paged_attention_ref(q, kc.to(dtype), vc.to(dtype), tables, seq_lens,
                                             qsl, D ** -0.5)
    torch.testing.assert_close(ref, ref_wide)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


def test_tiny_model_logits_close_to_full_precision_cache():
    """Llama-like tiny model, fp32, prefill then decode steps: with an FP8 cache the logits stay
    within 10% (relative L2) of the fp32-cache run's on this tiny random model (every K and V
    rounded to 3 mantissa bits; 4.4% measured)."""
    hf = tiny_hf_model("llama")
    model = build_model(hf.config, checkpoint_weights(hf))
    prompts = [[5, 17, 99, 3, 250, 42, 7, 8, 9, 10], list(range(11, 31))]
    outs = [paged_logits(model, prompts, 3, dtype) for dtype in (None, FP8)]  # same blocks
    err = ((outs[1] - outs[0]).norm() / outs[0].norm()).item()
    print(f"fp8 KV cache: relative L2 error of the logits {err:.4f}")
    assert 0 < err < 0.1, err


def test_llm_with_fp8_cache_holds_twice_the_blocks(tmp_path):
    """kv_cache_dtype="fp8": the same KV memory holds twice the blocks, and generation runs."""
    from helpers.quantize import save_tiny

    from tinypaged import LLM, SamplingParams

    save_tiny("llama", tmp_path)
    blocks, tokens = {}, {}
    for kv in ("auto", "fp8"):
        llm = LLM(str(tmp_path), kv_cache_dtype=kv, cpu_kv_cache_space=1 / 1024, block_size=16,
                  max_model_len=128)
        info = llm.engine.runner.kv_cache_info
        blocks[kv] = info.num_blocks
        assert info.dtype == (torch.float32 if kv == "auto" else FP8)
        out = llm.generate([{"prompt_token_ids": list(range(3, 40))}],
                           SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)
        tokens[kv] = out[0].outputs[0].token_ids
    assert blocks["fp8"] == 4 * blocks["auto"]  # fp32 model: 4 bytes a value -> 1
    assert len(tokens["fp8"]) == 8
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(str(tmp_path), kv_cache_dtype="fp8_e5m2")
