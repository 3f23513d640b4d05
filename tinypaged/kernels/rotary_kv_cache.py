"""Rotary embedding fused with the KV-cache store (and the per-head q/k RMSNorm of Qwen3 and
Gemma 3): the whole step from the QKV projection's output to the cache in one launch.

For each token t at position p = positions[t], slot s = slot_mapping[t]:

    q[t, h] = rope(norm_q(q[t, h]), p)                     written back in place
    k_cache[s // block_size, s % block_size, h] = rope(norm_k(k[t, h]), p)
    v_cache[s // block_size, s % block_size, h] = v[t, h]  (nothing stored when s = -1)

norm_x(x) = x / sqrt(mean(x^2) + eps) * w_x over the head's D dims, rounded to x's dtype (as the
separate `rms_norm` stores it), or the identity without weights; rope is `rotary.py`'s rotation
of the first `rotary_dim` dims (neox halves or interleaved pairs, any cos/sin table, so every
rope scaling of models/rope.py). The rotated k is never written back to `k`: attention reads keys
from the cache only. Separately these are up to five launches (two norms, rotary, store) and
three round trips of q and k through memory; fused, q, k and v are read once and written once.

How a program rotates without a register shuffle: it loads every dim d of a head and, a second
time, d's partner p(d) (d + rotary_dim/2 or d - rotary_dim/2; for interleaved pairs d ^ 1), then

    out[d] = x[d] cos_i - x[p(d)] sin_i    for the first of a pair
    out[d] = x[d] cos_i + x[p(d)] sin_i    for the second             (i = the pair's index)

the second load hits the cache lines the first just brought in. The norm scales both loads by
the head's 1/rms (and by w[d], w[p(d)]) before the rotation.

Shapes: positions [T], q [T, Hq, D], k and v [T, Hk, D] (views into the fused QKV output: only the
last dim must be contiguous), k_cache / v_cache [num_blocks, block_size, Hk, D], slot_mapping [T],
cos_sin_cache [max_position, rotary_dim] float32 (cos | sin), q_norm_weight / k_norm_weight [D].
Grid (T, 2): program (t, 0) handles q's heads, (t, 1) k's and v's.
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import jit, next_power_of_2, tl, use_triton
from tinypaged.kernels.kv_cache import _check_args as _check_store_args
from tinypaged.kernels.kv_cache import store_kv_ref, to_cache
from tinypaged.kernels.norm import rms_norm_ref
from tinypaged.kernels.pdl import launch_kwargs, pdl_enabled, pdl_trigger, pdl_wait
from tinypaged.kernels.rotary import _check_args as _check_rotary_args
from tinypaged.kernels.rotary import rotary_embedding_ref


@jit
def _norm_rotate_heads(
    X, stride_h, num_heads, COS_SIN, pos, stride_cache, W, eps,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_NORM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The [BLOCK_H, BLOCK_D] fp32 tile of this token's heads, normalized and rotated."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)
    rotated = d < 2 * HALF
    if INTERLEAVED:
        first = d % 2 == 0
        partner = d ^ 1
        pair = d // 2
    else:
        first = d < HALF
        partner = tl.where(first, d + HALF, d - HALF)
        pair = tl.where(first, d, d - HALF)
    partner = tl.where(rotated, partner, d)
    mask = (heads < num_heads) & (d < HEAD_DIM)[None, :]  # [BLOCK_H, BLOCK_D]
    x = tl.load(X + heads * stride_h + d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(X + heads * stride_h + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)  # [BLOCK_H]
        w = tl.load(W + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
        wp = tl.load(W + partner, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
        # rounded to the input dtype where the separate rms_norm would store it
        x = (x * rstd[:, None] * w[None, :]).to(X.dtype.element_ty).to(tl.float32)
        xp = (xp * rstd[:, None] * wp[None, :]).to(X.dtype.element_ty).to(tl.float32)
    cos = tl.load(COS_SIN + pos * stride_cache + pair, mask=rotated, other=1.0)
    sin = tl.load(COS_SIN + pos * stride_cache + HALF + pair, mask=rotated, other=0.0)
    sin = tl.where(first, -sin, sin)
    return x * cos[None, :] + xp * sin[None, :]


@jit
def _rotary_store_kv_kernel(
    POS, Q, K, V, K_CACHE, V_CACHE, SLOTS, COS_SIN, Q_NORM, K_NORM,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cache,
    stride_cb, stride_cs, stride_ch,  # cache strides of block, row in block, head (k = v)
    num_q_heads, num_kv_heads, block_size, eps, k_inv_scale, v_inv_scale,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
    HAS_NORM: tl.constexpr, HAS_SCALE: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,  # chained to the kernels around it (kernels/pdl.py)
):
    pdl_trigger(USE_PDL)
    pdl_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)[None, :]
    if tl.program_id(1) == 0:
        out = _norm_rotate_heads(Q + t * stride_qt, stride_qh, num_q_heads, COS_SIN, pos,
                                 stride_cache, Q_NORM, eps, HEAD_DIM, HALF, INTERLEAVED,
                                 HAS_NORM, BLOCK_HQ, BLOCK_D)
        heads = tl.arange(0, BLOCK_HQ)[:, None]
        mask = (heads < num_q_heads) & (d < HEAD_DIM)
        tl.store(Q + t * stride_qt + heads * stride_qh + d, out.to(Q.dtype.element_ty), mask=mask)
    else:
        slot = tl.load(SLOTS + t).to(tl.int64)
        if slot >= 0:
            out = _norm_rotate_heads(K + t * stride_kt, stride_kh, num_kv_heads, COS_SIN, pos,
                                     stride_cache, K_NORM, eps, HEAD_DIM, HALF, INTERLEAVED,
                                     HAS_NORM, BLOCK_HK, BLOCK_D)
            heads = tl.arange(0, BLOCK_HK)[:, None]
            mask = (heads < num_kv_heads) & (d < HEAD_DIM)
            dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
            dst += heads * stride_ch + d
            # rounded to k's dtype first, as the reference's rotated k (exact for FP8 caches)
            k = out.to(K.dtype.element_ty)
            v = tl.load(V + t * stride_vt + heads * stride_vh + d, mask=mask)
            if HAS_SCALE:  # an FP8 cache with the checkpoint's k_scale / v_scale: divide
                k = k.to(tl.float32) * k_inv_scale
                v = v.to(tl.float32) * v_inv_scale
            tl.store(K_CACHE + dst, to_cache(k, K_CACHE), mask=mask)
            tl.store(V_CACHE + dst, to_cache(v, V_CACHE), mask=mask)


def rotary_store_kv_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int,
    interleaved: bool = False,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """The Triton launcher; arguments as checked by `rotary_store_kv`."""
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return q
    has_norm = q_norm_weight is not None
    block_hq, block_d = next_power_of_2(num_q_heads), next_power_of_2(head_dim)
    pdl = pdl_enabled(q)
    _rotary_store_kv_kernel[(num_tokens, 2)](
        positions, q, k, v, k_cache, v_cache, slot_mapping, cos_sin_cache,
        q_norm_weight if has_norm else q, k_norm_weight if has_norm else k,  # unused if no norm
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_q_heads, k.shape[1], k_cache.shape[1], eps, 1.0 / k_scale, 1.0 / v_scale,
        HEAD_DIM=head_dim, HALF=rotary_dim // 2, INTERLEAVED=interleaved, HAS_NORM=has_norm,
        HAS_SCALE=k_scale != 1.0 or v_scale != 1.0,
        BLOCK_HQ=block_hq, BLOCK_HK=next_power_of_2(k.shape[1]), BLOCK_D=block_d,
        USE_PDL=pdl, num_warps=4 if block_hq * block_d <= 2048 else 8, **launch_kwargs(pdl),
    )
    return q


def rotary_store_kv_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int,
    interleaved: bool = False,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """The torch reference: the separate ops one after the other (q in place, k left alone)."""
    k = k.clone()
    if q_norm_weight is not None:
        q.copy_(rms_norm_ref(q, q_norm_weight, eps))
        k = rms_norm_ref(k, k_norm_weight, eps)
    rotary_embedding_ref(positions, q, k, cos_sin_cache, rotary_dim, interleaved)
    if k_scale != 1.0 or v_scale != 1.0:  # stored as value / scale (fp32 product, as the kernel)
        k = k.float() * torch.tensor(1.0 / k_scale, dtype=torch.float32)
        v = v.float() * torch.tensor(1.0 / v_scale, dtype=torch.float32)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    return q


def _check_norm_weights(q, q_norm_weight, k_norm_weight) -> None:
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("give both q_norm_weight and k_norm_weight, or neither")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is not None and (w.shape != (q.shape[2],) or w.device != q.device):
            raise ValueError(
                f"{name} must be [head_dim] = [{q.shape[2]}] on {q.device}; got "
                f"{tuple(w.shape)} on {w.device}"
            )


def rotary_store_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int,
    interleaved: bool = False,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Normalize (with weights) and rotate q in place and k into the cache, store v; returns q.
    `k_scale` / `v_scale`: an FP8 cache's per-tensor scales, the stored values are k / k_scale
    and v / v_scale (attention multiplies them back)."""
    _check_rotary_args(positions, q, k, cos_sin_cache, rotary_dim)
    _check_store_args(k, v, k_cache, v_cache, slot_mapping)
    _check_norm_weights(q, q_norm_weight, k_norm_weight)
    args = (positions, q, k, v, k_cache, v_cache, slot_mapping, cos_sin_cache, rotary_dim,
            interleaved, q_norm_weight, k_norm_weight, eps, float(k_scale), float(v_scale))
    if use_triton(q):
        return rotary_store_kv_triton(*args)
    return rotary_store_kv_ref(*args)
