"""SiLU-and-mul, the gate of a SwiGLU MLP.

    silu_and_mul(x)[t, i] = silu(x[t, i]) * x[t, I + i],   silu(a) = a * sigmoid(a)

x is the output of the fused gate-up projection: [..., 2I], gate in the first half, up in the
second; the result is [..., I]. Math in fp32, one cast at the store. The grid is (rows, I / BLOCK):
each program reads BLOCK gate and BLOCK up values and writes BLOCK outputs, a pure streaming op.
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import cdiv, jit, next_power_of_2, tl, use_triton


@jit
def _silu_and_mul_kernel(
    X, OUT,  # [rows, 2I] and [rows, I], last dims contiguous
    stride_x, stride_out,  # row strides
    inter_size,  # I in the docstring
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter_size
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + inter_size + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(OUT + row * stride_out + cols, out.to(OUT.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor, *, block: int | None = None) -> torch.Tensor:
    """The Triton launcher; `block` (power of two) overrides the columns per program."""
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, inter)
    if x2.shape[0] > 0 and inter > 0:
        block = block or min(next_power_of_2(inter), 1024)
        grid = (x2.shape[0], cdiv(inter, block))
        _silu_and_mul_kernel[grid](
            x2, out2, x2.stride(0), out2.stride(0), inter, BLOCK=block,
            num_warps=4 if block <= 1024 else 8,
        )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """The torch reference."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :I]) * x[..., I:] for x [..., 2I] -> [..., I]."""
    if x.dim() < 1 or x.shape[-1] % 2 != 0 or not x.is_floating_point():
        raise ValueError(
            f"x must be a float tensor [..., 2I] with an even last dim; "
            f"got {x.dtype} of shape {tuple(x.shape)}"
        )
    if use_triton(x):
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
