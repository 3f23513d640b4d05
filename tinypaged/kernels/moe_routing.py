"""Mixture-of-experts routing: which k of E experts each token goes to, and with what weight
(moe_align.py then sorts the tokens by expert for the grouped GEMM of moe.py).

Routing, for router logits g [T, E] (x W_gate^T):

    softmax (Qwen2-MoE, Qwen3-MoE, Mixtral):
        p = softmax(g);  ids = top-k of p;  w = p[ids]            (renormalize: w /= sum(w))
    sigmoid with a correction bias and groups (GLM-4.5, DeepSeek-V3):
        s = sigmoid(g);  c = s + bias                             (bias only steers the choice)
        the E experts form G groups of E / G; a group scores the sum of its two best c;
        keep the topk_group best groups, mask out the rest, ids = top-k of c among the kept
        w = s[ids]                                                (renormalize: w /= sum(w))
    both:  w *= routed_scaling_factor

-> topk_weights [T, k] float32, topk_ids [T, k] int32. `select_experts_ref` does it in torch, a
handful of small ops on [T, E]; on the GPU (and under the interpreter) one Triton program per
token does it all in one launch (`_topk_routing_kernel`: scores, then k rounds of "take the
best, mask it out", then the renormalization), except for grouped routing (G > 1), which stays
in torch. Neither synchronizes the host, so both run inside a captured CUDA graph; at decode the
launches matter, the routing being a few microseconds of work per MoE layer.
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import jit, next_power_of_2, tl, use_triton


@jit
def _topk_routing_kernel(
    LOGITS, BIAS, TOPK_WEIGHTS, TOPK_IDS,
    stride_logits, num_experts, routed_scaling_factor,
    TOP_K: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    logits = tl.load(LOGITS + t * stride_logits + experts, mask=valid, other=0.0).to(tl.float32)
    if SIGMOID:
        scores = tl.sigmoid(logits)
    else:
        exp = tl.where(valid, tl.exp(logits - tl.max(tl.where(valid, logits, -float("inf")), 0)),
                       0.0)
        scores = exp / tl.sum(exp, 0)
    choice = scores
    if HAS_BIAS:
        choice += tl.load(BIAS + experts, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, -float("inf"))
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):  # take the best expert left, then mask it out
        best = tl.max(choice, 0)
        pick = tl.min(tl.where(choice == best, experts, BLOCK_E), 0)  # lowest index on ties
        pick = tl.minimum(pick, num_experts - 1)  # NaN scores match nothing: stay in range
        weights = tl.where(slots == j, tl.sum(tl.where(experts == pick, scores, 0.0), 0), weights)
        ids = tl.where(slots == j, pick, ids)
        choice = tl.where(experts == pick, -float("inf"), choice)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, 0) + 1e-20)
    weights = weights * routed_scaling_factor
    tl.store(TOPK_WEIGHTS + t * TOP_K + slots, weights, mask=slots < TOP_K)
    tl.store(TOPK_IDS + t * TOP_K + slots, ids, mask=slots < TOP_K)


def select_experts_triton(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool,
    scoring_func: str = "softmax",
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton launcher (no expert groups); arguments as checked by `select_experts`."""
    num_tokens, num_experts = router_logits.shape
    topk_weights = torch.empty(num_tokens, top_k, dtype=torch.float32,
                               device=router_logits.device)
    topk_ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens > 0:
        logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
        bias = e_score_correction_bias
        block_e = next_power_of_2(num_experts)
        _topk_routing_kernel[(num_tokens,)](
            logits, logits if bias is None else bias, topk_weights, topk_ids,
            logits.stride(0), num_experts, routed_scaling_factor,
            TOP_K=top_k, SIGMOID=scoring_func == "sigmoid",
            HAS_BIAS=bias is not None and scoring_func == "sigmoid",  # as the reference
            RENORMALIZE=renormalize, BLOCK_E=block_e, BLOCK_K=next_power_of_2(top_k),
            num_warps=1 if block_e <= 128 else 4,
        )
    return topk_weights, topk_ids


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool,
    scoring_func: str = "softmax",
    e_score_correction_bias: torch.Tensor | None = None,
    num_expert_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int32)."""
    num_experts = router_logits.shape[-1]
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}] (the experts); got {top_k}")
    if scoring_func not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring_func must be 'softmax' or 'sigmoid'; got {scoring_func!r}")
    if num_expert_group == 1 and use_triton(router_logits):
        return select_experts_triton(
            router_logits, top_k, renormalize=renormalize, scoring_func=scoring_func,
            e_score_correction_bias=e_score_correction_bias,
            routed_scaling_factor=routed_scaling_factor)
    return select_experts_ref(
        router_logits, top_k, renormalize=renormalize, scoring_func=scoring_func,
        e_score_correction_bias=e_score_correction_bias, num_expert_group=num_expert_group,
        topk_group=topk_group, routed_scaling_factor=routed_scaling_factor)


def select_experts_ref(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool,
    scoring_func: str = "softmax",
    e_score_correction_bias: torch.Tensor | None = None,
    num_expert_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference (every routing, expert groups included)."""
    logits = router_logits.float()
    if scoring_func == "softmax":
        scores = torch.softmax(logits, dim=-1)  # [T, E]
        topk_weights, topk_ids = torch.topk(scores, top_k, dim=-1)
    else:  # sigmoid
        scores = logits.sigmoid()  # [T, E]
        choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias
        if num_expert_group > 1:
            choice = _mask_groups(choice, num_expert_group, topk_group)
        topk_ids = torch.topk(choice, top_k, dim=-1)[1]
        topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, topk_ids.to(torch.int32)


def _mask_groups(choice: torch.Tensor, num_groups: int, topk_group: int) -> torch.Tensor:
    """choice [T, E] with the experts outside each token's topk_group best groups at -inf."""
    num_tokens, num_experts = choice.shape
    if num_experts % num_groups or not 0 < topk_group <= num_groups:
        raise ValueError(
            f"n_group ({num_groups}) must divide the {num_experts} experts and topk_group "
            f"({topk_group}) be in [1, n_group]"
        )
    grouped = choice.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)  # [T, G]
    keep_groups = torch.topk(group_scores, topk_group, dim=-1)[1]  # [T, topk_group]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep_groups, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view(num_tokens, num_experts)

