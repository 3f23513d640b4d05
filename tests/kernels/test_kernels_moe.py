"""Mixture-of-experts: routing against transformers' routers, the block-padded sort by expert
checked by its invariants, and the fused grouped GEMM and the small-T GEMVs under the Triton
interpreter (fp32, fp16) against the loop-over-experts reference, which is itself checked against
a per-token float64 sum."""

import pytest
import torch

from tinypaged.kernels import moe, moe_align, moe_gemv, moe_routing

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def hf_softmax_topk(logits, top_k, norm):
    """transformers' Qwen2/Qwen3-MoE router, written out."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def hf_grouped_sigmoid(logits, bias, top_k, groups, topk_group, norm, scale):
    """transformers' Glm4MoeTopkRouter, written out per token (loops, not the vectorized form)."""
    scores = logits.float().sigmoid()
    weights, ids = [], []
    per_group = logits.shape[1] // groups
    for s in scores:
        choice = s + bias
        group_score = [sorted(choice[g * per_group:(g + 1) * per_group].tolist())[-2:]
                       for g in range(groups)]
        best = sorted(range(groups), key=lambda g: -sum(group_score[g]))[:topk_group]
        allowed = [e for e in range(len(s)) if e // per_group in best]
        chosen = sorted(allowed, key=lambda e: -choice[e].item())[:top_k]
        w = s[chosen]
        if norm:
            w = w / w.sum()
        weights.append(w * scale)
        ids.append(chosen)
    return torch.stack(weights), torch.tensor(ids)


def as_sets(weights, ids):
    """Per token {expert: weight}: top-k order is not part of the contract."""
    return [dict(zip(i.tolist(), w.tolist())) for w, i in zip(weights, ids)]


def assert_same_routing(got, want):
    (gw, gi), (ww, wi) = got, want
    assert gi.dtype == torch.int32 and gw.dtype == torch.float32
    for g, w in zip(as_sets(gw, gi), as_sets(ww, wi)):
        assert g.keys() == w.keys()
        for e in g:
            assert g[e] == pytest.approx(w[e], rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_topk_matches_transformers(renormalize):
    logits = randn(9, 16, seed=1, scale=2.0)
    got = moe_routing.select_experts(logits, 4, renormalize=renormalize)
    assert_same_routing(got, hf_softmax_topk(logits, 4, renormalize))
    if not renormalize:  # the probabilities of the chosen experts, which sum to less than 1
        assert (got[0].sum(-1) < 1).all()


@pytest.mark.parametrize("groups,topk_group", [(1, 1), (4, 2)])
def test_grouped_sigmoid_matches_glm_router(groups, topk_group):
    logits, bias = randn(7, 16, seed=2, scale=2.0), randn(16, seed=3)
    got = moe_routing.select_experts(
        logits, 4, renormalize=True, scoring_func="sigmoid", e_score_correction_bias=bias,
        num_expert_group=groups, topk_group=topk_group, routed_scaling_factor=2.5)
    assert_same_routing(got, hf_grouped_sigmoid(logits, bias, 4, groups, topk_group, True, 2.5))
    if groups > 1:  # every token's experts come from at most topk_group groups
        assert all(len(set((i // 4).tolist())) <= topk_group for i in got[1])


@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,kwargs",
    [
        (9, 16, 4, {"renormalize": True}),  # Qwen3-MoE
        (5, 60, 4, {"renormalize": False}),  # Qwen1.5-MoE: 60 experts, masked to 64
        (6, 24, 3, {"renormalize": True, "scoring_func": "sigmoid",  # GLM-4.5 without groups
                    "routed_scaling_factor": 2.5}),
    ],
)
def test_routing_kernel_matches_reference(num_tokens, num_experts, top_k, kwargs):
    logits = randn(num_tokens, num_experts, seed=4, scale=2.0)
    if kwargs.get("scoring_func") == "sigmoid":
        kwargs = {**kwargs, "e_score_correction_bias": randn(num_experts, seed=5)}
    got = moe_routing.select_experts_triton(logits, top_k, **kwargs)
    want = moe_routing.select_experts_ref(logits, top_k, **kwargs)
    assert torch.equal(got[1], want[1])  # the same experts in the same (descending) order
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-5)


def test_routing_dispatch_keeps_expert_groups_in_torch(monkeypatch):
    logits, bias = randn(3, 16, seed=2), randn(16, seed=3)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []
    real = moe_routing.select_experts_triton
    monkeypatch.setattr(moe_routing, "select_experts_triton",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    for groups in (1, 4):
        moe_routing.select_experts(logits, 2, renormalize=True, scoring_func="sigmoid",
                                   e_score_correction_bias=bias, num_expert_group=groups,
                                   topk_group=2)
    assert calls == [1]


def test_routing_bad_arguments():
    logits = randn(3, 8)
    with pytest.raises(ValueError, match="top_k"):
        moe_routing.select_experts(logits, 9, renormalize=True)
    with pytest.raises(ValueError, match="scoring_func"):
        moe_routing.select_experts(logits, 2, renormalize=True, scoring_func="relu")
    with pytest.raises(ValueError, match="n_group"):
        moe_routing.select_experts(logits, 2, renormalize=True, scoring_func="sigmoid",
                                   num_expert_group=3)


@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m", [
    (5, 2, 4, 4), (1, 8, 64, 16), (40, 3, 6, 16), (70, 4, 60, 16), (300, 2, 4, 4),
    (300, 8, 128, 64),  # 19 chunks of 128 pairs: the parallel kernel sums 16 count rows a step
])
@pytest.mark.parametrize("impl", ["ref", "triton", "parallel"])
def test_align_block_size_invariants(num_tokens, top_k, num_experts, block_m, impl):
    gen = torch.Generator().manual_seed(num_tokens)
    topk_ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k]
                            for _ in range(num_tokens)]).to(torch.int32)
    align = getattr(moe_align, f"moe_align_block_size_{impl}")
    sorted_ids, expert_ids, post_padded = align(topk_ids, block_m, num_experts)
    if impl != "ref":  # the same stable layout as the reference, element for element
        for got, want in zip((sorted_ids, expert_ids, post_padded),
                             moe_align.moe_align_block_size_ref(topk_ids, block_m, num_experts)):
            assert got.dtype == torch.int32 and torch.equal(got, want)
    num_pairs = num_tokens * top_k
    used = int(post_padded)
    assert sorted_ids.numel() % block_m == 0 and expert_ids.numel() * block_m == sorted_ids.numel()
    assert used % block_m == 0 and used <= sorted_ids.numel()
    counts = torch.bincount(topk_ids.flatten().long(), minlength=num_experts)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    valid = sorted_ids[:used][sorted_ids[:used] < num_pairs]
    assert sorted(valid.tolist()) == list(range(num_pairs))  # every pair exactly once
    assert (sorted_ids[used:] == num_pairs).all()
    flat = topk_ids.flatten()
    for block in range(used // block_m):  # one expert per block, the right one
        rows = sorted_ids[block * block_m:(block + 1) * block_m]
        rows = rows[rows < num_pairs].long()
        assert (flat[rows] == expert_ids[block]).all()
    assert (expert_ids[:used // block_m].diff() >= 0).all()  # experts in order


@pytest.mark.parametrize("parallel,num_tokens,expect", [
    ("0", 64, "triton"), ("0", 129, "ref"),  # past KERNEL_MAX_PAIRS: the torch ops
    ("1", 1, "parallel"), ("1", 2048, "parallel"), ("1", 2049, "ref"),  # PARALLEL_MAX_PAIRS
])
def test_align_dispatch_by_pair_count(monkeypatch, parallel, num_tokens, expect):
    topk_ids = torch.randint(0, 16, (num_tokens, 8), generator=torch.Generator().manual_seed(0))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TINYPAGED_MOE_ALIGN_PARALLEL", parallel)
    calls = []
    for impl in ("triton", "parallel", "ref"):
        def spy(*a, impl=impl, ref=moe_align.moe_align_block_size_ref):
            calls.append(impl)
            return ref(*a)
        monkeypatch.setattr(moe_align, f"moe_align_block_size_{impl}", spy)
    moe_align.moe_align_block_size(topk_ids, 16, 16)
    assert calls == [expect]


def moe_case(num_tokens, hidden, inter, num_experts, top_k, dtype, seed=0):
    x = randn(num_tokens, hidden, dtype=dtype, seed=seed)
    w13 = randn(num_experts, 2 * inter, hidden, dtype=dtype, seed=seed + 1, scale=hidden**-0.5)
    w2 = randn(num_experts, hidden, inter, dtype=dtype, seed=seed + 2, scale=inter**-0.5)
    logits = randn(num_tokens, num_experts, seed=seed + 3)
    topk_weights, topk_ids = moe_routing.select_experts(logits, top_k, renormalize=False)
    return x, w13, w2, topk_weights, topk_ids


def test_reference_matches_per_token_float64_sum():
    x, w13, w2, weights, ids = moe_case(6, 32, 16, 4, 2, torch.float32)
    want = torch.zeros(6, 32, dtype=torch.float64)
    for t in range(6):
        for j in range(2):
            e = int(ids[t, j])
            gate_up = w13[e].double() @ x[t].double()
            act = torch.nn.functional.silu(gate_up[:16]) * gate_up[16:]
            want[t] += float(weights[t, j]) * (w2[e].double() @ act)
    got = moe.fused_experts_ref(x, w13, w2, weights, ids)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "num_tokens,hidden,inter,num_experts,top_k,config",
    [
        (5, 64, 32, 4, 2, None),  # the default small-T config: BLOCK_N and BLOCK_K mask
        (19, 96, 48, 6, 3, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4,
                            "num_stages": 1}),  # K loop of 2 tiles with a ragged last one
    ],
)
def test_fused_moe_kernel_matches_reference(num_tokens, hidden, inter, num_experts, top_k,
                                            config, dtype):
    x, w13, w2, weights, ids = moe_case(num_tokens, hidden, inter, num_experts, top_k, dtype)
    got = moe.fused_experts_triton(x, w13, w2, weights, ids, config=config)
    want = moe.fused_experts_ref(x, w13, w2, weights, ids)
    assert got.shape == (num_tokens, hidden) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "num_tokens,hidden,inter,num_experts,top_k,block_k",
    [
        (1, 64, 32, 8, 2, None),  # decode: one token, the default tiles (masked N and K)
        (3, 96, 40, 16, 3, 32),  # K loops of 3 (96) and 2 ragged tiles (40); N tiles ragged
    ],
)
def test_moe_gemv_matches_reference(num_tokens, hidden, inter, num_experts, top_k, block_k,
                                    dtype):
    x, w13, w2, weights, ids = moe_case(num_tokens, hidden, inter, num_experts, top_k, dtype)
    ids[0, 1] = ids[0, 0] if num_tokens == 1 else ids[1, 0]  # an expert picked twice
    config = None if block_k is None else {"BLOCK_N": 16, "BLOCK_K": block_k, "num_warps": 4}
    got = moe_gemv.fused_experts_gemv(x, w13, w2, weights, ids, gate_up_config=config,
                                      down_config=config)
    want = moe.fused_experts_ref(x, w13, w2, weights, ids)
    assert got.shape == (num_tokens, hidden) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_use_gemv_for_few_pairs_only():
    assert moe_gemv.use_gemv(1, 8, 8)  # one token: always
    assert moe_gemv.use_gemv(8, 8, 128) and not moe_gemv.use_gemv(9, 8, 128)  # Qwen3-30B-A3B
    assert moe_gemv.use_gemv(2, 2, 8) and not moe_gemv.use_gemv(3, 2, 8)  # Mixtral


@pytest.mark.parametrize("num_tokens,path", [(2, "fused_experts_gemv"),
                                             (5, "fused_experts_triton")])
def test_fused_experts_dispatch_and_errors(monkeypatch, num_tokens, path):
    x, w13, w2, weights, ids = moe_case(num_tokens, 32, 16, 8, 2, torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []
    real = getattr(moe, path)
    monkeypatch.setattr(moe, path, lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.testing.assert_close(moe.fused_experts(x, w13, w2, weights, ids),
                               moe.fused_experts_ref(x, w13, w2, weights, ids),
                               atol=1e-4, rtol=1e-4)
    assert calls == [1]
    with pytest.raises(ValueError, match="w2"):
        moe.fused_experts(x, w13, w2[:, :, :8], weights, ids)
    assert moe.fused_experts(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 32)


def test_get_config_grows_tiles_with_tokens():
    sizes = [moe.get_config(t)["BLOCK_M"] for t in (1, 8, 64, 512, 4096)]
    assert sizes == sorted(sizes) and sizes[0] == 16 and sizes[-1] >= 64
    # float32 tiles keep the bytes of the 16-bit ones (test_kernels_compile checks they fit)
    for t in (1, 512, 4096):
        assert moe.get_config(t, 4)["BLOCK_K"] * 2 == moe.get_config(t, 2)["BLOCK_K"]
