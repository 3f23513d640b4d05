"""RMSNorm, optionally fused with the residual add in front of it.

    rms_norm(x)[t, :] = x[t, :] / sqrt(mean_j(x[t, j]^2) + eps) * weight

With `residual` the skip connection of the transformer block is folded into the same pass:

    r = x + residual
    returns (rms_norm(r), r)

The sum `r` is returned in x's dtype (it is the residual stream the next block adds to), while the
normalization reads the fp32 sum before that rounding. All math is fp32; the output is cast once.

Shapes: x [..., H] (every leading dim is a row, e.g. [T, H] or [T, num_heads, head_dim] for
per-head q/k norms), weight [H], residual like x. One program normalizes one row.

`rms_norm_quant_fp8` is the same pass for an FP8 W8A8 linear after the norm (the qkv and
gate-up projections, through quantization/fp8.py's fp8_norm_linear): the normalized row,
rounded to x's dtype as rms_norm stores it, is quantized to e4m3 while it is still in
registers (kernels/fp8.py's quantize_fp8, dynamic):

    q [T, H] float8_e4m3fn, s [T, 1] (per token) or [T, H / group] (per token group)

so the row is written once, one byte a value, instead of written in x's dtype and read back by
a second launch.
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import jit, next_power_of_2, tl, use_triton
from tinypaged.kernels.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    _round_e4m3,
    quantize_fp8_reference,
)
from tinypaged.kernels.pdl import launch_kwargs, pdl_enabled, pdl_trigger, pdl_wait


@jit
def _rms_norm_kernel(
    X, RES, W, OUT, RES_OUT,  # row-major [rows, H] views (last dim contiguous)
    SCALE,  # QUANT: fp32 [rows, BLOCK_H / GROUP] scales (row stride stride_s), OUT float8
    stride_x, stride_res, stride_out, stride_res_out, stride_s,  # row strides
    H, eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next power of two >= H
    QUANT: tl.constexpr = False, GROUP: tl.constexpr = 1,  # GROUP: inputs per scale (QUANT)
    FP8_MAX: tl.constexpr = 448.0, MIN_SCALE: tl.constexpr = 1.0,
    ROUND_IN_FP32: tl.constexpr = False,  # QUANT: the interpreter's rounding (kernels/fp8.py)
    USE_PDL: tl.constexpr = False,  # chained to the kernels around it (kernels/pdl.py)
):
    pdl_trigger(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: no kernel writes it
    pdl_wait(USE_PDL)
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H]
    if HAS_RESIDUAL:
        x += tl.load(RES + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(RES_OUT + row * stride_res_out + cols, x.to(RES_OUT.dtype.element_ty), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    y = x * rstd * w
    if not QUANT:
        tl.store(OUT + row * stride_out + cols, y.to(OUT.dtype.element_ty), mask=mask)
    else:
        # the value rms_norm would have stored; padding columns are 0 and do not move a max
        y = y.to(X.dtype.element_ty).to(tl.float32)
        groups = tl.reshape(y, (BLOCK_H // GROUP, GROUP))  # [groups, GROUP]
        scale = tl.maximum(tl.max(tl.abs(groups), 1) / FP8_MAX, MIN_SCALE)  # [groups]
        g = tl.arange(0, BLOCK_H // GROUP)
        tl.store(SCALE + row * stride_s + g, scale, mask=g * GROUP < H)
        q = tl.minimum(tl.maximum(groups * (1.0 / scale)[:, None], -FP8_MAX), FP8_MAX)
        if ROUND_IN_FP32:
            q = _round_e4m3(q)
        q = tl.reshape(q, (BLOCK_H,))
        tl.store(OUT + row * stride_out + cols, q.to(OUT.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., H] -> [rows, H] with a contiguous last dim (a view when the layout allows)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The Triton launcher; arguments as checked by `rms_norm`."""
    hidden = x.shape[-1]
    x2 = _rows(x)  # [rows, H]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, hidden)
    if residual is not None:
        res2 = _rows(residual)
        res_out = torch.empty_like(out)
        res_out2 = res_out.view(-1, hidden)
    else:  # unused pointers: any tensor will do
        res2, res_out, res_out2 = x2, None, out2
    if x2.shape[0] > 0:
        block_h = next_power_of_2(hidden)
        pdl = pdl_enabled(x2)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, out2, res_out2, out2,
            x2.stride(0), res2.stride(0), out2.stride(0), res_out2.stride(0), 0,
            hidden, eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK_H=block_h, USE_PDL=pdl, **launch_kwargs(pdl),
            num_warps=4 if block_h <= 1024 else (8 if block_h <= 4096 else 16),
        )
    return out if residual is None else (out, res_out)


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The torch reference: same arguments, same results, same rounding points."""
    r = x.float()
    if residual is not None:
        r = r + residual.float()
    out = r * torch.rsqrt(r.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()
    out = out.to(x.dtype)
    return out if residual is None else (out, r.to(x.dtype))


def rms_norm_quant_fp8_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    group: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """The Triton launcher; arguments as checked by `rms_norm_quant_fp8`."""
    hidden = x.shape[-1]
    x2 = _rows(x)  # [rows, H]
    rows = x2.shape[0]
    block_h = next_power_of_2(hidden)
    G = block_h if group is None else group
    q = torch.empty(rows, hidden, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(rows, hidden // G if group else 1, dtype=torch.float32, device=x.device)
    if residual is not None:
        res2 = _rows(residual)
        res_out2 = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    else:
        res2, res_out2 = x2, q
    if rows > 0:
        pdl = pdl_enabled(x2)
        _rms_norm_kernel[(rows,)](
            x2, res2, weight, q, res_out2, s,
            x2.stride(0), res2.stride(0), q.stride(0), res_out2.stride(0), s.stride(0),
            hidden, eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK_H=block_h, QUANT=True, GROUP=G, FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE,
            ROUND_IN_FP32=not x.is_cuda, USE_PDL=pdl, **launch_kwargs(pdl),
            num_warps=4 if block_h <= 1024 else (8 if block_h <= 4096 else 16),
        )
    return (q, s) if residual is None else (q, s, res_out2.view(x.shape))


def rms_norm_quant_fp8_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    group: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """The definition: rms_norm_ref, then quantize_fp8_reference of its [rows, H] output."""
    out = rms_norm_ref(x, weight, eps, residual)
    normed = out if residual is None else out[0]
    q, s = quantize_fp8_reference(normed.reshape(-1, x.shape[-1]), group)
    return (q, s) if residual is None else (q, s, out[1])


def _check_args(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() < 1 or not x.is_floating_point():
        raise ValueError(
            f"x must be a float tensor [..., H]; got {x.dtype} of shape {tuple(x.shape)}"
        )
    if weight.shape != (x.shape[-1],):
        raise ValueError(
            f"weight must have shape [H] = [{x.shape[-1]}] (x's last dim); "
            f"got {tuple(weight.shape)}"
        )
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual must match x ({tuple(x.shape)}, {x.dtype}); "
            f"got {tuple(residual.shape)}, {residual.dtype}"
        )
    if weight.device != x.device or (residual is not None and residual.device != x.device):
        raise ValueError(f"weight and residual must be on x's device {x.device}")


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over x's last dim; with `residual`: `(rms_norm(x + residual), x + residual)`."""
    _check_args(x, weight, residual)
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)


def rms_norm_quant_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    group: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """RMSNorm over x [..., H]'s last dim, dynamically quantized to e4m3 (module docstring):
    (q [rows, H], s [rows, 1 | H / group]), and with `residual` also x + residual like x."""
    _check_args(x, weight, residual)
    if group is not None and x.shape[-1] % group:
        raise ValueError(f"rms_norm_quant_fp8: {x.shape[-1]} inputs are not a whole number of "
                         f"groups of {group}")
    if group is not None and group & (group - 1):
        raise ValueError(f"rms_norm_quant_fp8: the group ({group}) must be a power of two")
    if use_triton(x):
        return rms_norm_quant_fp8_triton(x, weight, eps, residual, group)
    return rms_norm_quant_fp8_ref(x, weight, eps, residual, group)
