"""Fused mixture-of-experts MLP: a grouped GEMM over the tokens sorted by expert.

For tokens x [T, H] routed to experts topk_ids [T, k] with weights topk_weights [T, k]:

    out[t] = sum_j topk_weights[t, j] * down_e(silu(x[t] W1_e^T) * (x[t] W3_e^T)),
             e = topk_ids[t, j]

w13 [E, 2I, H] holds each expert's gate (W1, rows :I) and up (W3, rows I:) projections, w2
[E, H, I] its down projection (transformers' and vLLM's layouts). Two launches of one kernel:

1. gate-up: rows of `sorted_token_ids` (moe_align.moe_align_block_size) in blocks of BLOCK_M,
   one expert per block. A program loads the block's token rows of x once per K tile and the
   expert's gate and up tiles, accumulates both in fp32, and stores silu(gate) * up:
   act [T * k, I], row i = t * k + j (SiLU-and-mul fused, no [T * k, 2I] round trip).
2. down: the same walk over act with w2, each row scaled by its routing weight: y [T * k, H].

then out = y.view(T, k, H).sum(1). Each program reads its expert's weight tiles once for the
whole block of BLOCK_M rows; decode batches (few rows per expert) are bound by reading the active
experts' weights, larger batches by the tensor cores. Tile sizes come from `get_config(T)`.

On CUDA (or under TRITON_INTERPRET=1) `fused_experts` runs the kernel, or for a few tokens
(decode) the sort-free GEMVs of moe_gemv.py; elsewhere the reference, a plain loop over the
experts.
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import cdiv, jit, tl, use_triton
from tinypaged.kernels.moe_align import moe_align_block_size
from tinypaged.kernels.moe_gemv import fused_experts_gemv, use_gemv


@jit(do_not_specialize=("num_valid_tokens",))  # T * k changes every step
def _fused_moe_kernel(
    A, B, C,  # A [rows of A, K]; B [E, N(*2 if GATED), K]; C [T * k, N]
    SORTED_TOKEN_IDS, EXPERT_IDS, NUM_TOKENS_POST_PADDED, TOPK_WEIGHTS,
    num_valid_tokens,  # T * k: pair ids >= this are padding
    N, K,
    stride_am, stride_be, stride_bn, stride_cm,
    A_ROW_DIV: tl.constexpr,  # A's row of pair i is i // A_ROW_DIV (k for x, 1 for act)
    GATED: tl.constexpr,  # B holds [gate; up]: output silu(x gate^T) * (x up^T)
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = pid // num_n, pid % num_n
    if pid_m * BLOCK_M >= tl.load(NUM_TOKENS_POST_PADDED):
        return  # past the rows the routing used: the grid is sized for the worst case
    pair = tl.load(SORTED_TOKEN_IDS + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    row_ok = pair < num_valid_tokens
    expert = tl.load(EXPERT_IDS + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = (pair // A_ROW_DIV).to(tl.int64)
    a_ptrs = A + a_rows[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    b_ptrs = B + expert * stride_be + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(a, b, acc)
        if GATED:
            b_up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc_up = tl.dot(a, b_up, acc_up)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    store_rows(C, acc, pair, row_ok, offs_n, n_ok, TOPK_WEIGHTS, stride_cm, MUL_ROUTED_WEIGHT)


@jit
def store_rows(C, acc, pair, row_ok, offs_n, n_ok, TOPK_WEIGHTS, stride_cm,
               MUL_ROUTED_WEIGHT: tl.constexpr):
    """The MoE kernels' epilogue: the tile's rows `pair` of C, times their routing weights
    (MUL_ROUTED_WEIGHT, the down projection)."""
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(TOPK_WEIGHTS + pair, mask=row_ok, other=0.0)
        acc = acc * weight[:, None]
    c_ptrs = C + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


# Tile configs by token count T, for the H100/H200 (sm_90) and the shapes of Qwen3-30B-A3B-like
# layers (E 64-128, H 2048-4096, I 768-1536). Small T: few rows per expert, so BLOCK_M 16 and
# the work is reading weights (deep K tiles, wide N); large T: big tiles for the tensor cores.
# Learned from vLLM's public tuned fused-MoE tables; GATED programs carry two accumulators.
_CONFIGS = (
    # (max T, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
    (32, 16, 64, 128, 4, 3),
    (128, 16, 128, 128, 4, 2),
    (256, 32, 128, 128, 4, 2),
    (1024, 64, 128, 64, 4, 3),
    (None, 128, 128, 64, 8, 3),
)


def get_config(num_tokens: int, element_size: int = 2) -> dict[str, int]:
    """The tile config for T = `num_tokens` tokens of `element_size`-byte operands. Each pipeline
    stage holds an A tile and two B tiles in shared memory; the table is sized for 16-bit
    operands, so 4-byte ones (float32) get half the BLOCK_K: the same bytes per stage (at full
    BLOCK_K the tiles for over 256 tokens need more shared memory than sm_90 gives a block)."""
    for max_t, bm, bn, bk, warps, stages in _CONFIGS:
        if max_t is None or num_tokens <= max_t:
            return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk * 2 // max(2, element_size),
                    "num_warps": warps, "num_stages": stages}
    raise AssertionError("the last config has no bound")


def _launch(a, b, c, align, topk_weights, num_pairs, *, a_row_div, gated, mul_weight, config):
    sorted_token_ids, expert_ids, num_tokens_post_padded = align
    n = c.shape[1]
    grid = (expert_ids.shape[0] * cdiv(n, config["BLOCK_N"]),)
    _fused_moe_kernel[grid](
        a, b, c, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights,
        num_pairs, n, a.shape[1],
        a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        A_ROW_DIV=a_row_div, GATED=gated, MUL_ROUTED_WEIGHT=mul_weight, **config,
    )


def fused_experts_triton(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                         topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                         config: dict[str, int] | None = None) -> torch.Tensor:
    """The Triton path; `config` overrides the tile sizes (BLOCK_M/N/K, num_warps, num_stages)."""
    num_tokens, top_k = topk_ids.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    config = config or get_config(num_tokens, hidden_states.element_size())
    hidden_states, w13, w2 = hidden_states.contiguous(), w13.contiguous(), w2.contiguous()
    align = moe_align_block_size(topk_ids, config["BLOCK_M"], num_experts)
    num_pairs = num_tokens * top_k
    weights = topk_weights.reshape(-1).float()  # [T * k]
    act = hidden_states.new_empty(num_pairs, inter)  # [T * k, I]
    _launch(hidden_states, w13, act, align, weights, num_pairs, a_row_div=top_k, gated=True,
            mul_weight=False, config=config)
    y = hidden_states.new_empty(num_pairs, w2.shape[1])  # [T * k, H]
    _launch(act, w2, y, align, weights, num_pairs, a_row_div=1, gated=False, mul_weight=True,
            config=config)
    return y.view(num_tokens, top_k, -1).sum(dim=1)  # [T, H]


def fused_experts_ref(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The torch reference: for each expert, its tokens through its SwiGLU MLP, weighted."""
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    inter = w2.shape[2]
    for expert in torch.unique(topk_ids).tolist():
        tokens, slots = torch.nonzero(topk_ids == expert, as_tuple=True)
        x = hidden_states[tokens].float()  # [n, H]
        gate_up = x @ w13[expert].float().t()  # [n, 2I]
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = act @ w2[expert].float().t()  # [n, H]
        out.index_add_(0, tokens, y * topk_weights[tokens, slots, None].float())
    return out.to(hidden_states.dtype)


def fused_experts(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """hidden_states [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k] (float32),
    topk_ids [T, k] (int) -> [T, H] in hidden_states' dtype."""
    num_tokens, hidden = hidden_states.shape
    num_experts, two_inter, w13_hidden = w13.shape
    if (w13_hidden != hidden or w2.shape != (num_experts, hidden, two_inter // 2)
            or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != num_tokens):
        raise ValueError(
            f"fused_experts needs x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk [T, k]; got x "
            f"{tuple(hidden_states.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, "
            f"topk_weights {tuple(topk_weights.shape)}, topk_ids {tuple(topk_ids.shape)}"
        )
    if num_tokens == 0:
        return hidden_states.clone()
    if use_triton(hidden_states):
        if use_gemv(num_tokens, topk_ids.shape[1], num_experts):
            return fused_experts_gemv(hidden_states, w13, w2, topk_weights, topk_ids)
        return fused_experts_triton(hidden_states, w13, w2, topk_weights, topk_ids)
    return fused_experts_ref(hidden_states, w13, w2, topk_weights, topk_ids)
