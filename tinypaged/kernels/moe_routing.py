"""Mixture-of-experts routing: which k of E experts each token goes to, and with what weight;
then the tokens sorted by expert in blocks, the layout the grouped GEMM (moe.py) walks.

Routing, for router logits g [T, E] (x W_gate^T):

    softmax (Qwen2-MoE, Qwen3-MoE, Mixtral):
        p = softmax(g);  ids = top-k of p;  w = p[ids]            (renormalize: w /= sum(w))
    sigmoid with a correction bias and groups (GLM-4.5, DeepSeek-V3):
        s = sigmoid(g);  c = s + bias                             (bias only steers the choice)
        the E experts form G groups of E / G; a group scores the sum of its two best c;
        keep the topk_group best groups, mask out the rest, ids = top-k of c among the kept
        w = s[ids]                                                (renormalize: w /= sum(w))
    both:  w *= routed_scaling_factor

-> topk_weights [T, k] float32, topk_ids [T, k] int32. All in torch: these are a handful of small
ops on [T, E], with no host synchronization, so they run inside a captured CUDA graph.

Sorting by expert (`moe_align_block_size`): the T * k (token, slot) pairs are numbered
i = t * k + j. Each expert's pairs are laid out contiguously, in expert order, each expert's run
padded up to a multiple of BLOCK_M with the invalid id T * k; so every block of BLOCK_M rows
belongs to one expert and the GEMM reads that expert's weights once per block:

    sorted_token_ids   [max_padded] int32  pair ids, expert by expert, padding = T * k
    expert_ids         [max_padded / BLOCK_M] int32  the expert of each block
    num_tokens_post_padded  [1] int32  rows actually used (blocks past it are skipped)

`max_padded` = T * k + min(E, T * k) * (BLOCK_M - 1), in whole blocks, bounds the padded length
whatever the routing (at most min(E, T * k) experts are hit, each wasting < BLOCK_M rows), so
every shape depends on T only and the GEMM's grid needs no device-to-host copy.
"""

from __future__ import annotations

import torch


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
    logits = router_logits.float()
    if scoring_func == "softmax":
        scores = torch.softmax(logits, dim=-1)  # [T, E]
        topk_weights, topk_ids = torch.topk(scores, top_k, dim=-1)
    elif scoring_func == "sigmoid":
        scores = logits.sigmoid()  # [T, E]
        choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias
        if num_expert_group > 1:
            choice = _mask_groups(choice, num_expert_group, topk_group)
        topk_ids = torch.topk(choice, top_k, dim=-1)[1]
        topk_weights = scores.gather(1, topk_ids)
    else:
        raise ValueError(f"scoring_func must be 'softmax' or 'sigmoid'; got {scoring_func!r}")
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


def max_padded_tokens(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of num_tokens_post_padded for num_pairs = T * k (see module docstring),
    rounded up to whole blocks."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-bound // block_m) * block_m


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int):
    """topk_ids [T, k] -> (sorted_token_ids, expert_ids, num_tokens_post_padded), the layout of
    the module docstring. Pair order within an expert follows the pair ids (a stable sort)."""
    flat = topk_ids.flatten().long()  # [N], N = T * k
    num_pairs, device = flat.numel(), flat.device
    max_padded = max_padded_tokens(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.index_add_(0, flat, torch.ones_like(flat))  # [E]; bincount would sync the host
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)  # [E] end row of each expert's run
    starts = ends - padded
    order = torch.sort(flat, stable=True)[1]  # pair ids grouped by expert
    experts_in_order = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts  # [E] index in `order` of its first pair
    rank = torch.arange(num_pairs, device=device) - first_of_expert[experts_in_order]
    sorted_token_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_token_ids[starts[experts_in_order] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    expert_ids = torch.searchsorted(ends, block_starts, right=True)  # E past the used rows
    expert_ids = expert_ids.clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_token_ids, expert_ids, ends[-1:].to(torch.int32)
