"""Fused mixture-of-experts MLP with FP8 (e4m3) expert weights and activations (W8A8).

The math of moe.py, with w13 [E, 2I, H] and w2 [E, H, I] in float8_e4m3fn and their scales:

- per channel (`block=None`): w13_scale [E, 2I, 1], w2_scale [E, H, 1] (quantize-at-load,
  per-tensor and per-channel checkpoints); activations quantized per token, scale [rows, 1];
- block-wise (`block=(128, 128)`, Qwen3-*-FP8): w13_scale [E, 2I/128, H/128], w2_scale
  [E, H/128, I/128], one scale per [128, 128] block; activations per token and group of 128
  inputs, scale [rows, K/128].

    xq, xs   = quantize_fp8(x)                        # [T, H] fp8, per token (group)
    act      = silu(xq W1_e^T) * (xq W3_e^T)          # [T * k, I] in x's dtype, scales applied
    aq, as_  = quantize_fp8(act)
    out[t]   = sum_j topk_weights[t, j] * (aq W2_e^T)[t * k + j]

Two launches of one grouped-GEMM kernel over the token-expert pairs sorted by expert
(moe_align.moe_align_block_size, as moe.py), with fp8 tl.dot (wgmma on Hopper) and fp32
accumulators; per channel the scales are applied once in the epilogue, block-wise each K step
of 128 inputs is scaled by its pair of block scales as it is accumulated. The activation
quantization is kernels/fp8.py's (which rounds to e4m3 by hand, exact under the interpreter).
Tiles: FP8_MOE_CONFIGS, one entry per launch, T and scale kind (benchmarks/moe_fp8_gpu.py
--sweep prints it); not moe.py's table, which is sized for 16-bit operands.

`fused_experts_fp8` runs the kernels on CUDA (or under TRITON_INTERPRET=1), else the torch
reference of the same signature, `fused_experts_fp8_reference`. At decode (moe_gemv.use_gemv:
a few tokens) it runs moe_gemv.py's sort-free GEMVs instead, reading the FP8 experts with x in
its own dtype (W8A16: no quantization launches, no sort; TINYPAGED_DENSE_GEMV=0 keeps W8A8).
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import cdiv, jit, tl, use_triton
from tinypaged.kernels.dense_gemv import gemv_enabled
from tinypaged.kernels.fp8 import dequantize_fp8, quantize_fp8, quantize_fp8_reference
from tinypaged.kernels.moe import store_rows
from tinypaged.kernels.moe_align import moe_align_block_size
from tinypaged.kernels.moe_gemv import fused_experts_gemv, use_gemv


@jit(do_not_specialize=("num_valid_tokens",))
def _fused_moe_fp8_kernel(
    A, A_SCALE, B, B_SCALE, C,  # A [rows, K] fp8; B [E, N(*2 if GATED), K] fp8; C [T * k, N]
    SORTED_TOKEN_IDS, EXPERT_IDS, NUM_TOKENS_POST_PADDED, TOPK_WEIGHTS,
    num_valid_tokens, N, K,
    stride_am, stride_asm, stride_be, stride_bn, stride_bse, stride_bsn, stride_bsk, stride_cm,
    A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCKWISE: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = pid // num_n, pid % num_n
    if pid_m * BLOCK_M >= tl.load(NUM_TOKENS_POST_PADDED):
        return
    pair = tl.load(SORTED_TOKEN_IDS + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < num_valid_tokens
    expert = tl.load(EXPERT_IDS + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = (pair // A_ROW_DIV).to(tl.int64)
    a_ptrs = A + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = B + expert * stride_be + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]
    as_ptrs = A_SCALE + a_rows * stride_asm  # [BLOCK_M]
    # the weight scales of the tile's gate (or only) rows and of its up rows: per channel one
    # per row, block-wise one per GROUP_N rows (and per K group, below)
    bs_ptrs = B_SCALE + expert * stride_bse + (offs_n // GROUP_N) * stride_bsn
    bs_up_ptrs = B_SCALE + expert * stride_bse + ((offs_n + N) // GROUP_N) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if BLOCKWISE:  # BLOCK_K divides GROUP_K: one pair of scales per step
            kg = (k * BLOCK_K) // GROUP_K
            sa = tl.load(as_ptrs + kg, mask=row_ok, other=0.0)[:, None]
            sb = tl.load(bs_ptrs + kg * stride_bsk, mask=n_ok, other=0.0)[None, :]
            acc += tl.dot(a, b, out_dtype=tl.float32) * sa * sb
            if GATED:
                b_up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None] & n_ok[None, :],
                               other=0.0)
                sb_up = tl.load(bs_up_ptrs + kg * stride_bsk, mask=n_ok, other=0.0)[None, :]
                acc_up += tl.dot(a, b_up, out_dtype=tl.float32) * sa * sb_up
        else:
            acc = tl.dot(a, b, acc, out_dtype=tl.float32)
            if GATED:
                b_up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None] & n_ok[None, :],
                               other=0.0)
                acc_up = tl.dot(a, b_up, acc_up, out_dtype=tl.float32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if not BLOCKWISE:  # per token x per channel: the scales once
        sa = tl.load(as_ptrs, mask=row_ok, other=0.0)[:, None]
        acc = acc * sa * tl.load(bs_ptrs, mask=n_ok, other=0.0)[None, :]
        if GATED:
            acc_up = acc_up * sa * tl.load(bs_up_ptrs, mask=n_ok, other=0.0)[None, :]
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    store_rows(C, acc, pair, row_ok, offs_n, n_ok, TOPK_WEIGHTS, stride_cm, MUL_ROUTED_WEIGHT)


# Tiles of the two launches by token count and scale kind: key "{launch}_t{T}" (+ "_block" for
# [128, 128] weight blocks), T a power of two from 16 to 16384, a call's T rounded up to the next
# one (clamped to the range; at most 8 tokens the GEMVs run instead, moe_gemv.use_gemv). Both
# launches walk one sort by expert, so gate_up and down share BLOCK_M. FP8 operands are half the
# bytes of moe.py's 16-bit ones, so a stage holds twice the K (BLOCK_K 128: a block-wise
# weight's K group is one K step). From `benchmarks/moe_fp8_gpu.py --sweep` on an H200 (each
# launch timed alone, the best pair per T checked against the reference), which prints this.
FP8_MOE_CONFIGS = {
    "gate_up_t16": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3),
    "down_t16": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
    "gate_up_t16_block": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
    "down_t16_block": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
    "gate_up_t32": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3),
    "down_t32": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
    "gate_up_t32_block": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
    "down_t32_block": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
    "gate_up_t64": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3),
    "down_t64": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
    "gate_up_t64_block": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
    "down_t64_block": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
    "gate_up_t128": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3),
    "down_t128": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
    "gate_up_t128_block": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
    "down_t128_block": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
    "gate_up_t256": dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
    "down_t256": dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3),
    "gate_up_t256_block": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
    "down_t256_block": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
    "gate_up_t512": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
    "down_t512": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3),
    "gate_up_t512_block": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
    "down_t512_block": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=4),
    "gate_up_t1024": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
    "down_t1024": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3),
    "gate_up_t1024_block": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
    "down_t1024_block": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=4),
    "gate_up_t2048": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=4),
    "down_t2048": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=3),
    "gate_up_t2048_block": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
    "down_t2048_block": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=4),
    "gate_up_t4096": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=4),
    "down_t4096": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=3),
    "gate_up_t4096_block": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
    "down_t4096_block": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=4),
    "gate_up_t8192": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=5),
    "down_t8192": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=3),
    "gate_up_t8192_block": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
    "down_t8192_block": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=4),
    "gate_up_t16384": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3),
    "down_t16384": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=3),
    "gate_up_t16384_block": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
    "down_t16384_block": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=4),
}
FP8_MOE_TOKENS = tuple(16 << i for i in range(11))  # the table's T: 16, 32, ..., 16384


def fp8_moe_key(num_tokens: int, block: tuple[int, int] | None) -> str:
    """The table's T for a call of `num_tokens` tokens, as "t{T}" (+ "_block")."""
    t = min(max(FP8_MOE_TOKENS[0], 1 << max(0, num_tokens - 1).bit_length()),
            FP8_MOE_TOKENS[-1])
    return f"t{t}" + ("" if block is None else "_block")


def fp8_moe_config(num_tokens: int, block: tuple[int, int] | None
                   ) -> tuple[dict[str, int], dict[str, int]]:
    """(gate-up tiles, down tiles) for T = `num_tokens` (block: the weights' scale block)."""
    key = fp8_moe_key(num_tokens, block)
    return FP8_MOE_CONFIGS["gate_up_" + key], FP8_MOE_CONFIGS["down_" + key]


def _launch(a, a_scale, b, b_scale, c, align, weights, num_pairs, block, *, a_row_div, gated,
            mul_weight, config):
    sorted_token_ids, expert_ids, num_tokens_post_padded = align
    n = c.shape[1]
    group_n, group_k = (1, a.shape[1]) if block is None else block
    if block is not None and group_k % config["BLOCK_K"]:
        raise ValueError(f"fused_experts_fp8: BLOCK_K {config['BLOCK_K']} must divide the "
                         f"scale block's {group_k} inputs")
    grid = (expert_ids.shape[0] * cdiv(n, config["BLOCK_N"]),)
    _fused_moe_fp8_kernel[grid](
        a, a_scale, b, b_scale, c, sorted_token_ids, expert_ids, num_tokens_post_padded,
        weights, num_pairs, n, a.shape[1],
        a.stride(0), a_scale.stride(0), b.stride(0), b.stride(1),
        b_scale.stride(0), b_scale.stride(1), b_scale.stride(2), c.stride(0),
        A_ROW_DIV=a_row_div, GATED=gated, MUL_ROUTED_WEIGHT=mul_weight,
        BLOCKWISE=block is not None, GROUP_N=group_n, GROUP_K=group_k, **config,
    )


def _check(hidden_states, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, block):
    T, H = hidden_states.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    if block is None:
        scales = ((E, two_i, 1), (E, H, 1))
    else:
        bn, bk = block
        if inter % bn:
            raise ValueError(f"fused_experts_fp8: block-wise experts need whole blocks of {bn} "
                             f"rows in gate and up; the intermediate size is {inter}")
        scales = ((E, two_i // bn, cdiv(H, bk)), (E, cdiv(H, bn), cdiv(inter, bk)))
    if (w13.shape[2] != H or w2.shape != (E, H, inter) or topk_ids.shape != topk_weights.shape
            or topk_ids.shape[0] != T or tuple(w13_scale.shape) != scales[0]
            or tuple(w2_scale.shape) != scales[1]):
        raise ValueError(
            f"fused_experts_fp8 needs x [T, H], w13 [E, 2I, H], w2 [E, H, I], scales "
            f"{scales[0]} and {scales[1]}, topk [T, k]; got x {tuple(hidden_states.shape)}, "
            f"w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, scales {tuple(w13_scale.shape)} and "
            f"{tuple(w2_scale.shape)}, topk {tuple(topk_weights.shape)}, {tuple(topk_ids.shape)}")


def fused_experts_fp8_triton(hidden_states, w13, w2, w13_scale, w2_scale, topk_weights,
                             topk_ids, block=None, *, config=None,
                             down_config=None) -> torch.Tensor:
    """The Triton path; `config` overrides the tiles (BLOCK_M/N/K, num_warps, num_stages) of
    both launches, `down_config` those of the down launch (the same BLOCK_M)."""
    num_tokens, top_k = topk_ids.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    table = fp8_moe_config(num_tokens, block)
    config = config or table[0]
    down_config = down_config or (table[1] if config is table[0] else config)
    if down_config["BLOCK_M"] != config["BLOCK_M"]:
        raise ValueError("fused_experts_fp8: both launches walk one sort; BLOCK_M "
                         f"{config['BLOCK_M']} and {down_config['BLOCK_M']} differ")
    group = None if block is None else block[1]
    w13, w2 = w13.contiguous(), w2.contiguous()
    align = moe_align_block_size(topk_ids, config["BLOCK_M"], num_experts)
    num_pairs = num_tokens * top_k
    weights = topk_weights.reshape(-1).float()
    xq, xs = quantize_fp8(hidden_states, group=group)  # [T, H], [T, 1 | H/128]
    act = hidden_states.new_empty(num_pairs, inter)
    _launch(xq, xs, w13, w13_scale.float(), act, align, weights, num_pairs, block,
            a_row_div=top_k, gated=True, mul_weight=False, config=config)
    aq, as_ = quantize_fp8(act, group=group)
    y = hidden_states.new_empty(num_pairs, w2.shape[1])
    _launch(aq, as_, w2, w2_scale.float(), y, align, weights, num_pairs, block,
            a_row_div=1, gated=False, mul_weight=True, config=down_config)
    return y.view(num_tokens, top_k, -1).sum(dim=1)


def fused_experts_fp8_reference(hidden_states, w13, w2, w13_scale, w2_scale, topk_weights,
                                topk_ids, block=None) -> torch.Tensor:
    """The definition the kernels are tested against: per expert, its tokens' activations
    quantized (per token or token group) and dequantized, times the dequantized weights in
    fp32; the SiLU-and-mul output rounded to x's dtype before its own quantization."""
    group = None if block is None else block[1]
    a_block = None if block is None else (1, block[1])
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    inter = w2.shape[2]
    xq, xs = quantize_fp8_reference(hidden_states, group)
    x = dequantize_fp8(xq, xs, a_block)  # [T, H] fp32
    for expert in torch.unique(topk_ids).tolist():
        tokens, slots = torch.nonzero(topk_ids == expert, as_tuple=True)
        gate_up = x[tokens] @ dequantize_fp8(w13[expert], w13_scale[expert], block).t()
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        aq, as_ = quantize_fp8_reference(act.to(hidden_states.dtype), group)
        y = dequantize_fp8(aq, as_, a_block) @ dequantize_fp8(w2[expert], w2_scale[expert],
                                                             block).t()
        out.index_add_(0, tokens, y * topk_weights[tokens, slots, None].float())
    return out.to(hidden_states.dtype)


def fused_experts_fp8(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      block: tuple[int, int] | None = None) -> torch.Tensor:
    """hidden_states [T, H], fp8 w13 [E, 2I, H] / w2 [E, H, I] with the scales of the module
    docstring, topk_weights [T, k] float32, topk_ids [T, k] int -> [T, H] in x's dtype."""
    _check(hidden_states, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, block)
    if hidden_states.shape[0] == 0:
        return hidden_states.clone()
    if use_triton(hidden_states):
        if use_gemv(hidden_states.shape[0], topk_ids.shape[1], w13.shape[0]) and gemv_enabled():
            # decode: the sort-free GEMVs with the FP8 experts widened in registers (W8A16)
            return fused_experts_gemv(hidden_states, w13, w2, topk_weights, topk_ids,
                                      w13_scale=w13_scale, w2_scale=w2_scale, block=block)
        return fused_experts_fp8_triton(hidden_states, w13, w2, w13_scale, w2_scale,
                                        topk_weights, topk_ids, block)
    return fused_experts_fp8_reference(hidden_states, w13, w2, w13_scale, w2_scale,
                                       topk_weights, topk_ids, block)
