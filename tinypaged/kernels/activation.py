"""The gated activations of the MLP: SiLU-and-mul (SwiGLU) and GELU-tanh-and-mul (GeGLU).

    silu_and_mul(x)[t, i]      = silu(x[t, i]) * x[t, I + i],       silu(a) = a * sigmoid(a)
    gelu_tanh_and_mul(x)[t, i] = gelu_tanh(x[t, i]) * x[t, I + i]
    gelu_tanh(a) = a / 2 * (1 + tanh(sqrt(2 / pi) * (a + 0.044715 a^3)))   (Gemma's GeGLU)

x is the output of the fused gate-up projection: [..., 2I], gate in the first half, up in the
second; the result is [..., I]. Math in fp32, one cast at the store. The grid is (rows, I / BLOCK):
each program reads BLOCK gate and BLOCK up values and writes BLOCK outputs, a pure streaming op.
One kernel serves both; the activation is a constexpr, so each compiles to its own code.
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import cdiv, jit, next_power_of_2, tl, use_triton


@jit
def tanh(x):
    """tanh(x) = 1 - 2 / (exp(2x) + 1), exact at both ends (exp2 overflows to inf -> 1, or
    underflows to 0 -> -1); libdevice's tanh is not available under the interpreter."""
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)  # 2 log2(e)


@jit
def _act_and_mul_kernel(
    X, OUT,  # [rows, 2I] and [rows, I], last dims contiguous
    stride_x, stride_out,  # row strides
    inter_size,  # I in the docstring
    GELU_TANH: tl.constexpr,  # False: SiLU
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter_size
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + inter_size + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU_TANH:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2 / pi)
        act = 0.5 * gate * (1.0 + tanh(inner))
    else:
        act = gate * tl.sigmoid(gate)
    tl.store(OUT + row * stride_out + cols, (act * up).to(OUT.dtype.element_ty), mask=mask)


def _act_and_mul_triton(x: torch.Tensor, gelu_tanh: bool, block: int | None) -> torch.Tensor:
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, inter)
    if x2.shape[0] > 0 and inter > 0:
        block = block or min(next_power_of_2(inter), 1024)
        grid = (x2.shape[0], cdiv(inter, block))
        _act_and_mul_kernel[grid](
            x2, out2, x2.stride(0), out2.stride(0), inter, GELU_TANH=gelu_tanh, BLOCK=block,
            num_warps=4 if block <= 1024 else 8,
        )
    return out


def silu_and_mul_triton(x: torch.Tensor, *, block: int | None = None) -> torch.Tensor:
    """The Triton launcher; `block` (power of two) overrides the columns per program."""
    return _act_and_mul_triton(x, False, block)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """The torch reference."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def gelu_tanh_and_mul_triton(x: torch.Tensor, *, block: int | None = None) -> torch.Tensor:
    """The Triton launcher; `block` (power of two) overrides the columns per program."""
    return _act_and_mul_triton(x, True, block)


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """The torch reference."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.gelu(gate, approximate="tanh") * up).to(x.dtype)


def _check(x: torch.Tensor) -> None:
    if x.dim() < 1 or x.shape[-1] % 2 != 0 or not x.is_floating_point():
        raise ValueError(
            f"x must be a float tensor [..., 2I] with an even last dim; "
            f"got {x.dtype} of shape {tuple(x.shape)}"
        )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :I]) * x[..., I:] for x [..., 2I] -> [..., I]."""
    _check(x)
    if use_triton(x):
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x[..., :I]) * x[..., I:] for x [..., 2I] -> [..., I]."""
    _check(x)
    if use_triton(x):
        return gelu_tanh_and_mul_triton(x)
    return gelu_tanh_and_mul_ref(x)
