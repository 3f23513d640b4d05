"""GPU kernels, one op per file: a Triton kernel, its launcher and a torch reference.

Each public op runs its Triton kernel when the input is on CUDA (or TRITON_INTERPRET=1 is set),
else the torch reference, so the package imports and runs on machines without triton or a GPU.
"""

from __future__ import annotations

from tinypaged.kernels._triton import HAS_TRITON
from tinypaged.kernels.activation import gelu_tanh_and_mul, silu_and_mul
from tinypaged.kernels.attention import paged_attention
from tinypaged.kernels.kv_cache import store_kv
from tinypaged.kernels.logits import apply_logit_bias_, apply_token_bitmask_
from tinypaged.kernels.moe import fused_experts
from tinypaged.kernels.moe_routing import select_experts
from tinypaged.kernels.norm import rms_norm
from tinypaged.kernels.rotary import build_cos_sin_cache, rotary_embedding
from tinypaged.kernels.rotary_kv_cache import rotary_store_kv

__all__ = [
    "HAS_TRITON",
    "apply_logit_bias_",
    "apply_token_bitmask_",
    "awq_gemm",
    "build_cos_sin_cache",
    "fused_experts",
    "gelu_tanh_and_mul",
    "paged_attention",
    "rms_norm",
    "rotary_embedding",
    "rotary_store_kv",
    "select_experts",
    "silu_and_mul",
    "store_kv",
]


def __getattr__(name: str):
    # awq.py is imported on first use: it is optional and owned by the quantization code
    if name == "awq_gemm":
        from tinypaged.kernels.awq import awq_gemm

        return awq_gemm
    raise AttributeError(f"module 'tinypaged.kernels' has no attribute {name!r}")
