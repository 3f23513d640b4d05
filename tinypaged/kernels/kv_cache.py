"""Store the new tokens' keys and values into their slots of the paged KV cache.

    k_cache.view(-1, Hk, D)[slot_mapping[t]] = k[t]      (same for v), for every t with slot >= 0

The cache of one layer is [num_blocks, block_size, Hk, D]; a slot is
`block_table[p // block_size] * block_size + p % block_size` for a token at position p, so slot s
lives in block s // block_size, row s % block_size. A slot of -1 skips the token (padding rows of a
CUDA-graph batch, or tokens whose K/V are already cached).

Shapes: k, v [T, Hk, D] (views into the fused QKV output are fine: only the last dim must be
contiguous), slot_mapping [T] int32/int64. Values are cast to the cache dtype. One program copies
one token's Hk * D keys and values.

An FP8 cache (`kv_cache_dtype="fp8"`, float8_e4m3fn) stores each value saturated to +-448 and
rounded to nearest e4m3 (`to_cache` / `to_cache_ref`), with a per-tensor scale of 1.0: vLLM's
default when a checkpoint brings no k_scale / v_scale. The attention kernels widen what they
load to q's dtype.
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import jit, next_power_of_2, tl, use_triton
from tinypaged.kernels.fp8 import FP8_DTYPE, FP8_MAX, _round_e4m3

# EngineConfig's kv_cache_dtype (vLLM's names) -> the cache's torch dtype; "auto": the model's
KV_CACHE_DTYPES = {"auto": None, "fp8": FP8_DTYPE, "fp8_e4m3": FP8_DTYPE}


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV cache is allocated in."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got "
                         f"{kv_cache_dtype!r}")
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


@jit
def to_cache(x, CACHE):
    """x as the cache `CACHE` (a pointer) stores it: cast, saturated and rounded for FP8."""
    if CACHE.dtype.element_ty == tl.float8e4nv:
        x = _round_e4m3(tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0))  # FP8_MAX
    return x.to(CACHE.dtype.element_ty)


def to_cache_ref(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The reference of `to_cache` (torch's cast to e4m3 gives NaN past 448: saturate first)."""
    if dtype == FP8_DTYPE:
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


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
    tl.store(K_CACHE + dst, to_cache(k, K_CACHE), mask=mask)
    tl.store(V_CACHE + dst, to_cache(v, V_CACHE), mask=mask)


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
    k_cache[slots // block_size, slots % block_size] = to_cache_ref(k[keep], k_cache.dtype)
    v_cache[slots // block_size, slots % block_size] = to_cache_ref(v[keep], v_cache.dtype)


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
