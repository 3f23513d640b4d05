"""The routed experts of a MoE layer in FP8 (e4m3): FP8 checkpoints and quantize-at-load.

The FP8 counterpart of moe.FusedMoE, built when the linears' quantization is quantization/fp8.py's
`Fp8Config` (or its compressed-tensors form). Experts stay stacked, `w13_weight` [E, 2I, H] and
`w2_weight` [E, H, I] in float8_e4m3fn (this rank's slice of I), with their scales:

- block-wise checkpoints (`weight_block_size: [128, 128]`, Qwen3-*-FP8): each expert's
  `gate_proj.weight_scale_inv` [I/128, H/128] (compressed-tensors: `weight_scale`) fills its
  rows of `w13_weight_scale` [E, 2I/128, H/128], `down_proj`'s its `w2_weight_scale`
  [E, H/128, I/128]; this rank's I must be whole blocks of 128;
- per-tensor (`quant_method: "fp8"`) and per-channel (compressed-tensors) checkpoints: each
  projection's scale, one per tensor or [rows, 1], fills its rows of the per-channel
  `w13_weight_scale` [E, 2I, 1] / `w2_weight_scale` [E, H, 1] (a per-tensor scale widened, as
  the dense linears do, so gate and up keep their own scales with no requantization);
- `quantization="fp8"` on a bf16 / fp16 checkpoint: the dense experts load as in FusedMoE and
  are quantized once loaded (`process_weights_after_loading`), one scale per output channel of
  each expert, as vLLM's online FP8.

Static activation scales (`input_scale` per expert) are refused: the experts quantize their
inputs dynamically, per token (per channel) or per token group of 128 (block-wise).

forward(): on CUDA (or under TRITON_INTERPRET=1) W8A8 through kernels/moe_fp8.py; elsewhere the
experts are dequantized and run in the activations' dtype through the dense path (weight-only
FP8, as the dense FP8 linears on the CPU), so the fp32 CPU path is the checkpoint's dequantized
model.
"""

from __future__ import annotations

import torch
from torch import nn

from tinypaged import kernels
from tinypaged.distributed.parallel_state import get_tp_rank, get_tp_size
from tinypaged.kernels._triton import cdiv, use_triton
from tinypaged.kernels.fp8 import FP8_DTYPE, FP8_MAX
from tinypaged.kernels.moe_fp8 import fused_experts_fp8
from tinypaged.models.layers import _check_shape, divide

SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv")  # the checkpoint names of weight scales


def _param(*shape, dtype=None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Fp8FusedMoE(nn.Module):
    """Every routed expert of one layer in FP8, this rank's slice of each (module docstring)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 quant_config) -> None:
        super().__init__()
        if quant_config.static_input:
            raise ValueError("FP8 mixture-of-experts checkpoints with static activation scales "
                             "(input_scale) are not supported; use a dynamic-activation one")
        self.quant_config = quant_config
        self.block = quant_config.block
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.inter = inter = divide(intermediate_size, self.tp_size, "moe_intermediate_size")
        E, H = num_experts, hidden_size
        dtype = None if quant_config.from_dense else FP8_DTYPE
        self.w13_weight = _param(E, 2 * inter, H, dtype=dtype)
        self.w2_weight = _param(E, H, inter, dtype=dtype)
        w13_shards = tuple((e, j) for e in range(E) for j in (0, 1))
        params = [self.w13_weight, self.w2_weight]
        if not quant_config.from_dense:
            if self.block is not None:
                bn, bk = self.block
                if inter % bn or (self.tp_size > 1 and inter % bk):
                    raise ValueError(
                        f"block-wise FP8 experts: this rank's moe_intermediate_size {inter} is "
                        f"not whole blocks of {bn}; use a smaller tensor_parallel_size")
                self.w13_weight_scale = _param(E, 2 * inter // bn, cdiv(H, bk),
                                               dtype=torch.float32)
                self.w2_weight_scale = _param(E, cdiv(H, bn), cdiv(inter, bk),
                                              dtype=torch.float32)
            else:
                self.w13_weight_scale = _param(E, 2 * inter, 1, dtype=torch.float32)
                self.w2_weight_scale = _param(E, H, 1, dtype=torch.float32)
            params += [self.w13_weight_scale, self.w2_weight_scale]
        for i, param in enumerate(params):  # w13 tensors even, w2 odd
            param.shard_ids = w13_shards if i % 2 == 0 else tuple(range(E))
            param.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        """One expert's checkpoint tensor (weight or scale) -> this rank's slice of it."""
        inter, tp, rank = self.inter, self.tp_size, self.tp_rank
        is_w13 = param is self.w13_weight or param is getattr(self, "w13_weight_scale", None)
        expert, j = shard_id if is_w13 else (shard_id, 0)
        if param is self.w13_weight or param is self.w2_weight:
            if is_w13:  # gate (j = 0) / up (j = 1) [I, H]: rows split
                _check_shape(loaded, (inter * tp, param.shape[2]))
                target = param.data[expert, j * inter:(j + 1) * inter]
                part = loaded.narrow(0, rank * inter, inter)
            else:  # down [H, I]: columns split
                _check_shape(loaded, (param.shape[1], inter * tp))
                target, part = param.data[expert], loaded.narrow(1, rank * inter, inter)
            target.copy_(part)
            return
        if self.block is not None:  # [rows / bn, cols / bk], whole blocks per rank
            bn, bk = self.block
            if is_w13:
                rows = inter // bn
                _check_shape(loaded, (rows * tp, param.shape[2]))
                target = param.data[expert, j * rows:(j + 1) * rows]
                part = loaded.narrow(0, rank * rows, rows)
            else:
                cols = param.shape[2]
                _check_shape(loaded, (param.shape[1], cdiv(inter * tp, bk)))
                target, part = param.data[expert], loaded.narrow(1, rank * cols, cols)
            target.copy_(part.float())
            return
        # per channel [E, rows, 1]: a per-tensor scale fills the shard's rows
        rows = inter if is_w13 else param.shape[1]
        target = param.data[expert, j * rows:(j + 1) * rows] if is_w13 else param.data[expert]
        if loaded.numel() == 1:
            target.fill_(loaded.reshape(()).float().item())
        elif is_w13:
            _check_shape(loaded, (inter * tp, 1))
            target.copy_(loaded.narrow(0, rank * inter, inter).float())
        else:
            _check_shape(loaded, (rows, 1))
            target.copy_(loaded.float())

    def process_weights_after_loading(self) -> None:
        """quantization="fp8" on dense experts: one scale per output channel of each expert."""
        if not self.quant_config.from_dense:
            return
        for name in ("w13", "w2"):
            w = getattr(self, f"{name}_weight").data
            scale = (w.float().abs().amax(2, keepdim=True) / FP8_MAX).clamp_min(1e-12)
            q = (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            del w
            setattr(self, f"{name}_weight", nn.Parameter(q, requires_grad=False))
            setattr(self, f"{name}_weight_scale", nn.Parameter(scale, requires_grad=False))

    def dequantized(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The stacked weight `name` ("w13" | "w2") the layer computes with, in `dtype`."""
        q, s = getattr(self, f"{name}_weight"), getattr(self, f"{name}_weight_scale").float()
        if self.block is not None:
            bn, bk = self.block
            s = s.repeat_interleave(bn, 1)[:, :q.shape[1]]
            s = s.repeat_interleave(bk, 2)[..., :q.shape[2]]
        return (q.float() * s).to(dtype)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        if use_triton(x):
            return fused_experts_fp8(x, self.w13_weight, self.w2_weight, self.w13_weight_scale,
                                     self.w2_weight_scale, topk_weights, topk_ids, self.block)
        return kernels.fused_experts(x, self.dequantized("w13", x.dtype),
                                     self.dequantized("w2", x.dtype), topk_weights, topk_ids)
