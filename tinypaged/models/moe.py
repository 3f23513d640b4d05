"""The sparse mixture-of-experts block, the MLP of a MoE layer, tensor-parallel aware.

    logits = x W_gate^T                                         # [T, E] router, replicated
    topk_weights, topk_ids = select_experts(logits, ...)        # kernels/moe_routing.py
    y = sum over the token's k experts of w * SwiGLU_e(x)       # kernels/moe.py, fused_experts
    (Qwen2-MoE)  y += sigmoid(x w_shared_gate) * SwiGLU_shared(x)
    (GLM-4.5)    y += SwiGLU_shared(x)            (n_shared_experts of them, stored as one MLP)

Experts live stacked: `experts.w13_weight` [E, 2I, H] (each expert's gate rows, then its up
rows) and `experts.w2_weight` [E, H, I]. Tensor parallelism splits every expert's intermediate
dim I like the dense MLP's (rank r keeps gate and up rows r*I/N.., down columns likewise), so
each rank computes a partial y over its slice for all experts; the shared expert is split the
same way, its down projection left unreduced, and the block ends in ONE all-reduce.

Checkpoints store experts one tensor per expert and projection
(`mlp.experts.{e}.gate_proj.weight` [I, H], `up_proj`, `down_proj` [H, I]); `expert_shard`
maps such a name to the stacked parameter and a shard id (e, 0 | 1) / e, and the weight loader
copies this rank's slice into its place.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tinypaged import kernels
from tinypaged.distributed.parallel_state import all_reduce, get_tp_rank, get_tp_size
from tinypaged.models.layers import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    _check_shape,
    default_weight_loader,
    divide,
)
from tinypaged.models.moe_fp8 import Fp8FusedMoE
from tinypaged.quantization.fp8 import Fp8Config


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # of each routed expert (moe_intermediate_size)
    sparse_layers: tuple[int, ...]  # indices of the layers whose MLP is this block
    renormalize: bool  # norm_topk_prob
    scoring_func: str = "softmax"  # or "sigmoid" (GLM-4.5)
    correction_bias: bool = False  # e_score_correction_bias (GLM-4.5)
    num_expert_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    router_fp32: bool = False  # GLM-4.5 keeps the router weight and its matmul in float32
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: the shared expert's output gated by sigmoid


class Router(nn.Module):
    """logits = x W^T [T, E]; `e_score_correction_bias` [E] when the routing uses one."""

    def __init__(self, hidden_size: int, spec: MoESpec) -> None:
        super().__init__()
        dtype = torch.float32 if spec.router_fp32 else None
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden_size, dtype=dtype),
                                   requires_grad=False)
        if spec.correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(spec.num_experts, dtype=torch.float32), requires_grad=False)
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight)


class FusedMoE(nn.Module):
    """Every routed expert of one layer, this rank's slice of each (see module docstring)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        inter = divide(intermediate_size, self.tp_size, "moe_intermediate_size")
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, inter),
                                      requires_grad=False)
        self.w13_weight.shard_ids = tuple((e, j) for e in range(num_experts) for j in (0, 1))
        self.w2_weight.shard_ids = tuple(range(num_experts))
        self.w13_weight.weight_loader = self.w2_weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        """One expert's full checkpoint tensor -> this rank's slice of it, in place."""
        inter = self.w2_weight.shape[2]
        if param is self.w13_weight:  # gate (j = 0) or up (j = 1): [I, H], rows are split
            expert, j = shard_id
            _check_shape(loaded, (inter * self.tp_size, param.shape[2]))
            target = param.data[expert, j * inter:(j + 1) * inter]
            part = loaded.narrow(0, self.tp_rank * inter, inter)
        else:  # down: [H, I], columns are split
            expert = shard_id
            _check_shape(loaded, (param.shape[1], inter * self.tp_size))
            target, part = param.data[expert], loaded.narrow(1, self.tp_rank * inter, inter)
        target.copy_(part)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        # [T, H], this rank's partial sum over its slice of every expert's intermediate dim
        return kernels.fused_experts(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)


class SharedExpert(nn.Module):
    """A SwiGLU MLP whose down projection is left unreduced (the block reduces once)."""

    def __init__(self, hidden_size: int, intermediate_size: int, quant_config=None) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2,
                                                       quant_config=quant_config)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size,
                                           quant_config=quant_config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = kernels.silu_and_mul(self.gate_up_proj(x))
        return self.down_proj.matmul(act, None)  # [T, H], this rank's partial sum


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, spec: MoESpec, quant_config=None) -> None:
        super().__init__()
        if quant_config is not None and not isinstance(quant_config, Fp8Config):
            raise ValueError(
                "quantized mixture-of-experts checkpoints are not supported yet "
                f"(quantization {getattr(quant_config, 'name', '?')!r}); use the bf16 / fp16 "
                "checkpoint of this model without --quantization"
            )
        self.spec = spec
        self.gate = Router(hidden_size, spec)
        if quant_config is None:
            self.experts = FusedMoE(spec.num_experts, hidden_size, spec.intermediate_size)
        else:  # FP8 (models/moe_fp8.py)
            self.experts = Fp8FusedMoE(spec.num_experts, hidden_size, spec.intermediate_size,
                                       quant_config)
        self.shared_expert = None
        self.shared_expert_gate = None
        if spec.shared_intermediate_size:
            self.shared_expert = SharedExpert(hidden_size, spec.shared_intermediate_size,
                                              quant_config)
        if spec.shared_expert_gate:
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
            self.shared_expert_gate.weight.requires_grad_(False)
            self.shared_expert_gate.weight.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        topk_weights, topk_ids = kernels.select_experts(
            self.gate(x), spec.top_k, renormalize=spec.renormalize,
            scoring_func=spec.scoring_func,
            e_score_correction_bias=self.gate.e_score_correction_bias,
            num_expert_group=spec.num_expert_group, topk_group=spec.topk_group,
            routed_scaling_factor=spec.routed_scaling_factor,
        )  # [T, k] float32, [T, k] int32
        out = self.experts(x, topk_weights, topk_ids)  # [T, H] partial
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:  # a per-token scalar: commutes with the sum
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return all_reduce(out)


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\."
                     r"(weight|weight_scale|weight_scale_inv)$")  # FP8 scales: moe_fp8.py
_STACKED = re.compile(r"^(.*\.experts)\.(w13|w2)_(weight|weight_scale|weight_scale_inv)$")
_PROJ_SHARD = {"gate_proj": 0, "up_proj": 1}


def expert_shard(name: str) -> tuple[str, object] | None:
    """`...experts.{e}.{gate,up,down}_proj.weight` -> (stacked parameter name, shard id);
    an FP8 checkpoint's `weight_scale` / `weight_scale_inv` -> `w13_weight_scale...` alike."""
    match = _EXPERT.match(name)
    if match is None:
        return None
    prefix, expert, proj, what = match.group(1), int(match.group(2)), match.group(3), \
        match.group(4)
    what = "weight_scale" if what == "weight_scale_inv" else what  # stacked: one name
    if proj == "down_proj":
        return f"{prefix}.w2_{what}", expert
    return f"{prefix}.w13_{what}", (expert, _PROJ_SHARD[proj])


def expert_checkpoint_name(name: str, shard_id) -> str | None:
    """Inverse of `expert_shard` (None for parameters that are not stacked experts)."""
    match = _STACKED.match(name)
    if match is None:
        return None
    prefix, stacked, what = match.groups()
    if stacked == "w13":
        expert, j = shard_id
        proj = "gate_proj" if j == 0 else "up_proj"
        return f"{prefix}.{expert}.{proj}.{what}"
    return f"{prefix}.{shard_id}.down_proj.{what}"
