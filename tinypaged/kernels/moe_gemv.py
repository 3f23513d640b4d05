"""Fused mixture-of-experts MLP for a few tokens (decode): GEMVs over each token's own experts.

The same math as moe.py, for x [T, H], topk_ids / topk_weights [T, k], w13 [E, 2I, H], w2
[E, H, I]:

    act[t * k + j] = silu(x[t] W1_e^T) * (x[t] W3_e^T),            e = topk_ids[t, j]
    out[t]         = sum_j topk_weights[t, j] * act[t * k + j] W2_e^T

At a handful of tokens the grouped GEMM's machinery costs more than the work: sorting the T * k
(token, expert) pairs by expert takes some twenty small torch ops, every block of BLOCK_M rows
holds one or two real rows, and the per-pair results need one more pass to be summed. Here
nothing is sorted:

1. gate-up: program (pair, n-tile) reads x[t] and its expert's gate and up rows of the tile,
   accumulates both dot products in fp32 and stores silu(gate) * up: act [T * k, I].
2. down: program (t, n-tile) loops over the token's k experts, each a GEMV of act's row with
   the expert's down tile, weighted by its routing weight and summed in fp32: out [T, H] in one
   store (no [T * k, H] buffer, no separate sum).

Every weight tile of a hit expert is read once per token that picked it, so the bytes are
(pairs / distinct experts hit) times the floor; `use_gemv` keeps that ratio near 1 (it expects
about 1 + T k / 2E). H and I are compile-time constants (one build per model) so that the
loops over K and over the k experts unroll and every weight load can be in flight at once: a
program's work is a few hundred KB, too little to hide the memory latency one load at a time.
Two launches, no host synchronization: CUDA graphs capture it.

FP8 experts (moe_fp8.py's layouts: e4m3 w13 / w2 with w13_scale / w2_scale) run the same
kernels as W8A16: x and act stay in x's dtype, each weight tile is widened in registers
(W_SCALE 1: per-row scales [E, rows, 1], applied to the row sums at the end; 2: per
[SCALE_BN, SCALE_BK] block, [E, rows / BN, cols / BK]: a program's BLOCK_N rows lie in one block
row (BLOCK_N divides BN), so the scales of a K tile are a [BLOCK_K] vector that multiplies x).
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import cdiv, jit, tl


@jit
def _scaled_x(x, ws_row, cols, k_ok, stride_sk, SCALE_BK: tl.constexpr):
    """x [BLOCK_K] (inputs `cols`) times their block scales from scale row ws_row."""
    return x * tl.load(ws_row + (cols // SCALE_BK) * stride_sk, mask=k_ok, other=0.0)


@jit
def _moe_gemv_gate_up_kernel(
    X, W13, ACT, TOPK_IDS, WS,  # WS: W13's scales (W_SCALE 1 or 2, module docstring)
    stride_x, stride_we, stride_wn, stride_act, stride_se, stride_sn, stride_sk,
    N: tl.constexpr, K: tl.constexpr,  # N = I (gate and up are N rows apart), K = H
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    W_SCALE: tl.constexpr = 0, SCALE_BN: tl.constexpr = 1, SCALE_BK: tl.constexpr = 1,
):
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(TOPK_IDS + pair).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = X + (pair // TOP_K) * stride_x + offs_k  # [BLOCK_K]
    w_ptrs = W13 + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    ws = WS + expert * stride_se
    n0 = tl.program_id(1) * BLOCK_N
    gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
    up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in tl.static_range(0, (K + BLOCK_K - 1) // BLOCK_K):  # unrolled: every load issued early
        k_ok = offs_k < K - k * BLOCK_K
        x = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
        mask = n_ok[:, None] & k_ok[None, :]  # [BLOCK_N, BLOCK_K]
        w_gate = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
        w_up = tl.load(w_ptrs + N * stride_wn, mask=mask, other=0.0).to(tl.float32)
        if W_SCALE == 2:
            cols = k * BLOCK_K + offs_k
            gate += tl.sum(w_gate * _scaled_x(x, ws + (n0 // SCALE_BN) * stride_sn, cols, k_ok,
                                              stride_sk, SCALE_BK)[None, :], axis=1)
            up += tl.sum(w_up * _scaled_x(x, ws + ((n0 + N) // SCALE_BN) * stride_sn, cols,
                                          k_ok, stride_sk, SCALE_BK)[None, :], axis=1)
        else:
            gate += tl.sum(w_gate * x[None, :], axis=1)
            up += tl.sum(w_up * x[None, :], axis=1)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if W_SCALE == 1:
        gate *= tl.load(ws + offs_n * stride_sn, mask=n_ok, other=0.0)
        up *= tl.load(ws + (offs_n + N) * stride_sn, mask=n_ok, other=0.0)
    act = gate * tl.sigmoid(gate) * up
    tl.store(ACT + pair * stride_act + offs_n, act.to(ACT.dtype.element_ty), mask=n_ok)


@jit
def _moe_gemv_down_kernel(
    ACT, W2, OUT, TOPK_IDS, TOPK_WEIGHTS, WS,  # WS: W2's scales (W_SCALE 1 or 2)
    stride_act, stride_we, stride_wn, stride_out, stride_se, stride_sn, stride_sk,
    N: tl.constexpr, K: tl.constexpr,  # N = H, K = I
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    W_SCALE: tl.constexpr = 0, SCALE_BN: tl.constexpr = 1, SCALE_BK: tl.constexpr = 1,
):
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    out = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = t * TOP_K + j
        expert = tl.load(TOPK_IDS + pair).to(tl.int64)
        a_ptrs = ACT + pair * stride_act + offs_k
        w_ptrs = W2 + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
        w_ptrs += offs_k[None, :]
        ws = WS + expert * stride_se
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k in tl.static_range(0, (K + BLOCK_K - 1) // BLOCK_K):
            k_ok = offs_k < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            if W_SCALE == 2:
                a = _scaled_x(a, ws + (tl.program_id(1) * BLOCK_N // SCALE_BN) * stride_sn,
                              k * BLOCK_K + offs_k, k_ok, stride_sk, SCALE_BK)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(w * a[None, :], axis=1)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if W_SCALE == 1:
            acc *= tl.load(ws + offs_n * stride_sn, mask=n_ok, other=0.0)
        out += tl.load(TOPK_WEIGHTS + pair).to(tl.float32) * acc
    tl.store(OUT + t * stride_out + offs_n, out.to(OUT.dtype.element_ty), mask=n_ok)


def use_gemv(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """The GEMV path while the pairs are at most half the experts (or a single token): then
    experts read more than once cost under ~25% extra bytes, and the sort is skipped."""
    return num_tokens == 1 or num_tokens * top_k <= num_experts // 2


# (BLOCK_N, BLOCK_K, num_warps) of the gate-up and of the down launch: few rows and long K
# tiles, so that even one token spreads its experts' rows over every SM (T=1: 384 gate-up and
# 512 down programs for Qwen3-30B-A3B) with every load in flight. The fastest of
# `benchmarks/moe.py --sweep-gemv` (each launch's tiles changed alone) at T=1 and T=8.
GATE_UP_CONFIG = {"BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4}
DOWN_CONFIG = {"BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4}


def fused_experts_gemv(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                       w13_scale: torch.Tensor | None = None,
                       w2_scale: torch.Tensor | None = None,
                       block: tuple[int, int] | None = None,
                       gate_up_config: dict[str, int] | None = None,
                       down_config: dict[str, int] | None = None) -> torch.Tensor:
    """The Triton path for small T; arguments as `moe.fused_experts` checks them, or, with
    w13_scale / w2_scale (and block), as `moe_fp8.fused_experts_fp8` does (the configs override
    the tile sizes, for benchmarks)."""
    num_tokens, top_k = topk_ids.shape
    inter, hidden = w2.shape[2], w2.shape[1]
    gate_up_config = gate_up_config or GATE_UP_CONFIG
    down_config = down_config or DOWN_CONFIG
    hidden_states, w13, w2 = hidden_states.contiguous(), w13.contiguous(), w2.contiguous()
    topk_ids, topk_weights = topk_ids.contiguous(), topk_weights.float().contiguous()
    scales13 = _scale_args(w13_scale, block, gate_up_config["BLOCK_N"], hidden_states)
    scales2 = _scale_args(w2_scale, block, down_config["BLOCK_N"], hidden_states)
    act = hidden_states.new_empty(num_tokens * top_k, inter)  # [T * k, I]
    _moe_gemv_gate_up_kernel[(num_tokens * top_k, cdiv(inter, gate_up_config["BLOCK_N"]))](
        hidden_states, w13, act, topk_ids, scales13[0],
        hidden_states.stride(0), w13.stride(0), w13.stride(1), act.stride(0), *scales13[1],
        inter, hidden, TOP_K=top_k, **scales13[2], **gate_up_config,
    )
    out = torch.empty_like(hidden_states)  # [T, H]
    _moe_gemv_down_kernel[(num_tokens, cdiv(hidden, down_config["BLOCK_N"]))](
        act, w2, out, topk_ids, topk_weights, scales2[0],
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0), *scales2[1],
        hidden, inter, TOP_K=top_k, **scales2[2], **down_config,
    )
    return out


def _scale_args(scale: torch.Tensor | None, block: tuple[int, int] | None, block_n: int,
                any_tensor: torch.Tensor):
    """(pointer, (expert, row, column) strides, constexprs) of one expert stack's scales."""
    if scale is None:
        return any_tensor, (0, 0, 0), {}
    scale = scale.float()
    if block is None:  # [E, rows, 1]
        return scale, (scale.stride(0), scale.stride(1), 0), dict(W_SCALE=1)
    if block[0] % block_n:
        raise ValueError(f"fused_experts_gemv: BLOCK_N {block_n} must divide the scale block's "
                         f"{block[0]} rows")
    return scale, tuple(scale.stride()), dict(W_SCALE=2, SCALE_BN=block[0], SCALE_BK=block[1])
