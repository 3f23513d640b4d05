"""Rotary position embedding (RoPE), applied in place to q and k.

Each pair (x1, x2) of a head's first `rotary_dim` dims is rotated by the angle pos * f_i:

    x1' = x1 * cos(pos f_i) - x2 * sin(pos f_i)
    x2' = x2 * cos(pos f_i) + x1 * sin(pos f_i)        f_i = base^(-2i / rotary_dim)

Pairs: neox / Llama style (interleaved=False) pairs dim i with dim i + rotary_dim/2 ("rotate
halves"); GLM style (interleaved=True) pairs adjacent dims 2i and 2i+1. Dims past `rotary_dim`
(partial rotary, GLM) are left untouched.

Shapes: positions [T], q [T, Hq, D], k [T, Hk, D] (views into the fused QKV output are fine: only
the last dim must be contiguous), cos_sin_cache [max_position, rotary_dim] float32 with
cos(pos f_i) in column i and sin(pos f_i) in column rotary_dim/2 + i. Math in fp32. One program
rotates every q and k head of one token.

`build_cos_sin_cache` builds that table, with Llama-3 ("llama3") or linear rope scaling.
"""

from __future__ import annotations

import math

import torch

from tinypaged.kernels._triton import jit, next_power_of_2, tl, use_triton


@jit
def _rotate_heads(
    X, stride_h, num_heads,  # X: first element of this token's heads
    off1, off2, cos, sin, pair_mask,  # [BLOCK_HALF]: offsets of x1 / x2 in a head, angles
    BLOCK_H: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)
    mask = (heads[:, None] < num_heads) & pair_mask[None, :]
    p1 = X + heads[:, None] * stride_h + off1[None, :]  # [BLOCK_H, BLOCK_HALF]
    p2 = X + heads[:, None] * stride_h + off2[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos[None, :] - x2 * sin[None, :]).to(X.dtype.element_ty), mask=mask)
    tl.store(p2, (x2 * cos[None, :] + x1 * sin[None, :]).to(X.dtype.element_ty), mask=mask)


@jit
def _rotary_kernel(
    POS, Q, K, COS_SIN,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    num_q_heads, num_k_heads,
    HALF: tl.constexpr,  # rotary_dim // 2
    INTERLEAVED: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    pair_mask = i < HALF
    cos = tl.load(COS_SIN + pos * stride_cache + i, mask=pair_mask, other=0.0).to(tl.float32)
    sin = tl.load(COS_SIN + pos * stride_cache + HALF + i, mask=pair_mask, other=0.0).to(tl.float32)
    if INTERLEAVED:
        off1 = 2 * i
        off2 = 2 * i + 1
    else:
        off1 = i
        off2 = i + HALF
    _rotate_heads(Q + t * stride_qt, stride_qh, num_q_heads, off1, off2, cos, sin, pair_mask,
                  BLOCK_HQ)
    _rotate_heads(K + t * stride_kt, stride_kh, num_k_heads, off1, off2, cos, sin, pair_mask,
                  BLOCK_HK)


def rotary_embedding_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton launcher; arguments as checked by `rotary_embedding`."""
    if q.shape[0] > 0:
        half = rotary_dim // 2
        block_half = next_power_of_2(half)
        block_hq = next_power_of_2(q.shape[1])
        _rotary_kernel[(q.shape[0],)](
            positions, q, k, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
            q.shape[1], k.shape[1],
            HALF=half, INTERLEAVED=interleaved,
            BLOCK_HALF=block_half, BLOCK_HQ=block_hq, BLOCK_HK=next_power_of_2(k.shape[1]),
            num_warps=4 if block_hq * block_half <= 2048 else 8,
        )
    return q, k


def rotary_embedding_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference (in place, like the kernel)."""
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)  # [T, rotary_dim/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    for x in (q, k):
        rot = x[..., :rotary_dim].float()  # [T, H, rotary_dim]
        if interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        else:
            x1, x2 = rot.chunk(2, dim=-1)
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        if interleaved:
            rotated = torch.stack((o1, o2), dim=-1).flatten(-2)
        else:
            rotated = torch.cat((o1, o2), dim=-1)
        x[..., :rotary_dim] = rotated.to(x.dtype)
    return q, k


def _check_args(positions, q, k, cos_sin_cache, rotary_dim) -> None:
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(
            f"q and k must be [T, num_heads, head_dim]; got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2] or k.dtype != q.dtype:
        raise ValueError(
            f"k must match q in tokens, head_dim and dtype: q {tuple(q.shape)} {q.dtype}, "
            f"k {tuple(k.shape)} {k.dtype}"
        )
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k must have a contiguous last dim (they are rotated in place)")
    if positions.shape != (q.shape[0],) or positions.is_floating_point():
        raise ValueError(
            f"positions must be an integer tensor [T] = [{q.shape[0]}]; "
            f"got {positions.dtype} of shape {tuple(positions.shape)}"
        )
    if rotary_dim % 2 != 0 or not 0 < rotary_dim <= q.shape[2]:
        raise ValueError(
            f"rotary_dim must be even and in 1..head_dim={q.shape[2]}; got {rotary_dim}"
        )
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != rotary_dim:
        raise ValueError(
            f"cos_sin_cache must be [max_position, rotary_dim={rotary_dim}]; "
            f"got {tuple(cos_sin_cache.shape)}"
        )
    if not (positions.device == q.device == k.device == cos_sin_cache.device):
        raise ValueError("positions, q, k and cos_sin_cache must be on one device")


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first `rotary_dim` dims of every q and k head in place; returns (q, k)."""
    _check_args(positions, q, k, cos_sin_cache, rotary_dim)
    if use_triton(q):
        return rotary_embedding_triton(positions, q, k, cos_sin_cache, rotary_dim, interleaved)
    return rotary_embedding_ref(positions, q, k, cos_sin_cache, rotary_dim, interleaved)


def _scaled_inv_freq(inv_freq: torch.Tensor, rope_scaling: dict | None) -> torch.Tensor:
    """Apply a config's `rope_scaling` (HF names) to the per-pair frequencies f_i."""
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rope_type in (None, "default"):
        return inv_freq
    if rope_type == "linear":  # positions divided by `factor`
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        # Llama 3.1: wavelengths longer than the original context / low_freq_factor are
        # stretched by `factor`, shorter than context / high_freq_factor kept, and the band in
        # between interpolated linearly in context / wavelength.
        factor = rope_scaling["factor"]
        low, high = rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
        old_context = rope_scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_context / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        return (1 - smooth) * inv_freq / factor + smooth * inv_freq
    raise ValueError(
        f"rope_scaling type {rope_type!r} is not supported; "
        "use None, 'default', 'linear' or 'llama3'"
    )


def build_cos_sin_cache(
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The [max_position, rotary_dim] table of cos (first half) and sin (second half).

    Computed in float32 the way transformers does (so angles match it bit for bit); keep the
    default float32: the kernels read it as fp32 and low-precision angles drift at long positions.
    """
    if rotary_dim % 2 != 0 or rotary_dim <= 0:
        raise ValueError(f"rotary_dim must be a positive even number; got {rotary_dim}")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float()
    inv_freq = 1.0 / (base ** (exponents / rotary_dim))  # [rotary_dim / 2]
    inv_freq = _scaled_inv_freq(inv_freq, rope_scaling)
    t = torch.arange(max_position, dtype=torch.int64, device=device).float()
    freqs = torch.outer(t, inv_freq)  # [max_position, rotary_dim / 2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)
