"""SiLU-and-mul fused with the dynamic FP8 quantization of its output (the down projection's
input on the W8A8 path):

    silu_and_mul_quant_fp8(x, group=None) -> (q, s)
        x [M, 2I] (gate | up) -> act = silu(gate) * up, rounded to x's dtype (as the separate
        silu_and_mul stores it), then quantize_fp8(act, group): q float8_e4m3fn [M, I] and
        fp32 scales s [M, 1] (per token) or [M, I / group] (per token group, block-wise).

Separately that is two launches and a round trip of act [M, I] through memory (written, read
twice by the two-pass quantizer or once from registers); fused, one program per row (or group)
reads gate and up once, keeps act in registers for its max, and writes one byte a value. Rows (or
groups) up to 16K wide (fp8.MAX_ONE_PASS) fuse; wider ones take the two separate kernels.
The rounding to e4m3 is fp8.py's (`_round_e4m3` under the interpreter).

`silu_and_mul_quant_fp8` runs the kernel on CUDA (or under TRITON_INTERPRET=1), else the torch
reference of the same signature.
"""

from __future__ import annotations

import torch

from tinypaged.kernels import fp8
from tinypaged.kernels._triton import jit, next_power_of_2, tl, use_triton
from tinypaged.kernels.activation import silu_and_mul, silu_and_mul_ref
from tinypaged.kernels.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, _round_e4m3
from tinypaged.kernels.pdl import launch_kwargs, pdl_enabled, pdl_trigger, pdl_wait


@jit
def _silu_and_mul_quant_kernel(X, Q, S, inter, stride_x, stride_q, stride_s,
                               GROUP: tl.constexpr, BLOCK: tl.constexpr,
                               FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                               ROUND_IN_FP32: tl.constexpr,  # fp8.py: the interpreter's rounding
                               USE_PDL: tl.constexpr):  # chained to its neighbours (pdl.py)
    pdl_trigger(USE_PDL)
    pdl_wait(USE_PDL)
    m = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < GROUP) & (cols < inter)
    gate = tl.load(X + m * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + m * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate * tl.sigmoid(gate) * up).to(X.dtype.element_ty).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(act), 0) / FP8_MAX, MIN_SCALE)
    tl.store(S + m * stride_s + g, scale)
    y = tl.minimum(tl.maximum(act * (1.0 / scale), -FP8_MAX), FP8_MAX)
    if ROUND_IN_FP32:
        y = _round_e4m3(y)
    tl.store(Q + m * stride_q + cols, y.to(Q.dtype.element_ty), mask=mask)


def silu_and_mul_quant_fp8_reference(x: torch.Tensor, group: int | None = None
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition: the separate ops' references one after the other."""
    return fp8.quantize_fp8_reference(silu_and_mul_ref(x), group)


def silu_and_mul_quant_fp8(x: torch.Tensor, group: int | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_and_mul_quant_fp8 needs x [M, 2I]; got {tuple(x.shape)}")
    if not use_triton(x):
        return silu_and_mul_quant_fp8_reference(x, group)
    M, inter = x.shape[0], x.shape[1] // 2
    G = inter if group is None else group
    if inter % G:
        raise ValueError(f"silu_and_mul_quant_fp8: {inter} outputs are not a whole number of "
                         f"groups of {G}")
    block = next_power_of_2(G)
    if block > fp8.MAX_ONE_PASS:  # too wide for registers: the two kernels
        return fp8.quantize_fp8(silu_and_mul(x), group)
    x = x if x.stride(-1) == 1 else x.contiguous()
    q = torch.empty(M, inter, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(M, inter // G, dtype=torch.float32, device=x.device)
    if M:
        pdl = pdl_enabled(x)
        _silu_and_mul_quant_kernel[(M, inter // G)](
            x, q, s, inter, x.stride(0), q.stride(0), s.stride(0), GROUP=G, BLOCK=block,
            FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, ROUND_IN_FP32=not x.is_cuda, USE_PDL=pdl,
            num_warps=max(1, min(32, block // 512)), **launch_kwargs(pdl))
    return q, s
