"""Store the new tokens' keys and values into their slots of the paged KV cache.

    k_cache.view(-1, Hk, D)[slot_mapping[t]] = k[t]      (same for v), for every t with slot >= 0

The cache of one layer is [num_blocks, block_size, Hk, D]; a slot is
`block_table[p // block_size] * block_size + p % block_size` for a token at position p, so slot s
lives in block s // block_size, row s % block_size. A slot of -1 skips the token (padding rows of a
CUDA-graph batch, or tokens whose K/V are already cached).

Shapes: k, v [T, Hk, D] (views into the fused QKV output are fine: only the last dim must be
contiguous), slot_mapping [T] int32/int64. Values are cast to the cache dtype. One program copies
one token's Hk * D keys and values.
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import jit, next_power_of_2, tl, use_triton


@jit
def _store_kv_kernel(
    K, V, K_CACHE, V_CACHE, SLOTS,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,  # cache strides of block, row in block, head (k = v)
    num_kv_heads, block_size,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < HEAD_DIM)  # [BLOCK_H, BLOCK_D]
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
    dst += heads * stride_ch + dims
    k = tl.load(K + t * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(V + t * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(K_CACHE + dst, k.to(K_CACHE.dtype.element_ty), mask=mask)
    tl.store(V_CACHE + dst, v.to(V_CACHE.dtype.element_ty), mask=mask)


def store_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The Triton launcher; arguments as checked by `store_kv`."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    if k.shape[0] == 0:
        return
    block_h, block_d = next_power_of_2(num_kv_heads), next_power_of_2(head_dim)
    _store_kv_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_kv_heads, k_cache.shape[1],
        HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4 if block_h * block_d <= 2048 else 8,
    )


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The torch reference."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    k_cache[slots // block_size, slots % block_size] = k[keep].to(k_cache.dtype)
    v_cache[slots // block_size, slots % block_size] = v[keep].to(v_cache.dtype)


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """K and V caches of one layer: same shape, dtype and strides, last dim contiguous (the
    kernels index both with one set of strides)."""
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"v_cache must match k_cache ({tuple(k_cache.shape)}, {k_cache.dtype}); "
            f"got {v_cache.dtype} of shape {tuple(v_cache.shape)}"
        )
    if k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must have the same strides, last dim contiguous")


def _check_args(k, v, k_cache, v_cache, slot_mapping) -> None:
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(
            f"k and v must both be [T, num_kv_heads, head_dim]; "
            f"got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v must have a contiguous last dim")
    expected = ("*", "*", k.shape[1], k.shape[2])
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4 or tuple(cache.shape[2:]) != tuple(k.shape[1:]):
            raise ValueError(
                f"{name} must be [num_blocks, block_size, num_kv_heads, head_dim] = {expected} "
                f"to match k; got {tuple(cache.shape)}"
            )
    check_cache_pair(k_cache, v_cache)
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.is_floating_point():
        raise ValueError(
            f"slot_mapping must be an integer tensor [T] = [{k.shape[0]}]; "
            f"got {slot_mapping.dtype} of shape {tuple(slot_mapping.shape)}"
        )
    if not (k.device == v.device == k_cache.device == v_cache.device == slot_mapping.device):
        raise ValueError("k, v, k_cache, v_cache and slot_mapping must be on one device")


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k[t], v[t] into cache slot slot_mapping[t] (skipping -1), in place."""
    _check_args(k, v, k_cache, v_cache, slot_mapping)
    if use_triton(k):
        store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        store_kv_ref(k, v, k_cache, v_cache, slot_mapping)
