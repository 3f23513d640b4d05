"""GPTQ int4 / int8 linear layers: the quantization config that the model's linear layers call.

An AutoGPTQ / GPTQModel checkpoint announces itself in config.json:

    "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128,
                            "desc_act": false, "sym": true, "checkpoint_format": "gptq"}

and stores qweight, qzeros, scales and g_idx per linear (`tinypaged.kernels.gptq_format` has the
bit layout). The layers' weight loaders slice them as they do dense weights: `output_dim` is 1 for
all but g_idx, `packed_factor` marks qzeros' packing along the outputs, and qweight's packing
along the inputs needs no mark (a rank's rows are whole words when its inputs are whole groups).

After loading, `process_weights_after_loading` rewrites each layer once:
- 4 bits: into the AWQ layout, so the AWQ linear method (decode GEMVs, tiled GEMM, dequantize +
  cuBLAS) runs it unchanged;
- 8 bits: into q uint8 [K, N], z uint8 [K/G, N], s [K/G, N] for the int8 kernels
  (kernels/gptq_int8.py);
- act-order: with the input rows permuted once (W[perm], groups contiguous); the int8 kernels
  read x[:, perm] through perm, the int4 path gathers x[:, perm] before the AWQ kernels (x [M, K]
  is small next to W).
Under tensor parallelism a row-parallel layer's ranks hold whole groups; act-order there would
need every rank to see all groups, so it is refused for tensor_parallel_size > 1 (vLLM's exllama
GPTQ path has the same restriction).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from tinypaged.kernels.awq import SUPPORTED_GROUP_SIZES
from tinypaged.kernels.gptq_format import (
    act_order_perm,
    gptq_to_awq,
    true_zeros,
    unpack_cols,
    unpack_rows,
)
from tinypaged.kernels.gptq_int8 import gptq_int8_gemm, int8_gemv_scales
from tinypaged.quantization.awq import AWQConfig
from tinypaged.quantization.base import QuantizationMethod


@dataclass(frozen=True)
class GPTQConfig(QuantizationMethod):
    name: ClassVar[str] = "gptq"
    bits: int
    group_size: int  # -1: one group spanning all inputs
    desc_act: bool
    version: int  # 1: "gptq" (qzeros hold z - 1), 2: "gptq_v2" (qzeros hold z)

    @classmethod
    def from_config(cls, quantization_config: dict) -> GPTQConfig:
        """From config.json's `quantization_config`; unsupported variants raise ValueError."""
        q = cls.own_config(quantization_config)
        bits, group_size = q.get("bits", 4), q.get("group_size", 128)
        fmt = str(q.get("checkpoint_format", "gptq")).lower()
        if bits not in (4, 8):
            raise ValueError(f"GPTQ checkpoint with bits={bits}: tinypaged runs bits 4 and 8")
        if group_size != -1 and (group_size <= 0 or group_size % 32):
            raise ValueError(f"GPTQ checkpoint with group_size={group_size}: supported group "
                             "sizes are multiples of 32 (32, 64, 128, ...) and -1 (per channel)")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r}: tinypaged reads 'gptq' and "
                             "'gptq_v2'")
        if q.get("modules_to_not_convert") or q.get("dynamic"):
            raise ValueError("GPTQ checkpoint with modules_to_not_convert / dynamic per-module "
                             "settings: mixing dense and quantized linears is not supported")
        return cls(bits=bits, group_size=group_size, desc_act=bool(q.get("desc_act", False)),
                   version=2 if fmt == "gptq_v2" else 1)

    from_hf_config = from_config

    @property
    def pack_factor(self) -> int:
        return 32 // self.bits

    def create_weights(self, layer: nn.Module, input_size: int,
                       output_size_per_partition: int, params_dtype: torch.dtype) -> None:
        """Register qweight, qzeros, scales and g_idx on `layer` (this rank's sizes)."""
        from tinypaged.models.layers import RowParallelLinear

        row_split = isinstance(layer, RowParallelLinear) and layer.tp_size > 1
        if self.desc_act and row_split:
            raise ValueError("GPTQ act-order (desc_act=true) checkpoints cannot run a row-parallel "
                             f"layer over tensor_parallel_size={layer.tp_size}: each rank would "
                             "need every group; use tensor_parallel_size=1 or a checkpoint "
                             "quantized with desc_act=false")
        group = input_size if self.group_size == -1 else self.group_size
        if input_size % group:
            raise ValueError(f"GPTQ: a linear layer with {input_size} input features (per "
                             f"tensor-parallel rank) is not a whole number of groups of "
                             f"group_size={group}; use a smaller tensor_parallel_size")
        P, N = self.pack_factor, output_size_per_partition
        if N % P:
            raise ValueError(f"GPTQ: a linear layer with {N} output features (per rank) cannot be "
                             f"packed {P} to an int32")
        groups = input_size // group
        tensors = {
            "qweight": torch.empty(input_size // P, N, dtype=torch.int32),
            "qzeros": torch.empty(groups, N // P, dtype=torch.int32),
            "scales": torch.empty(groups, N, dtype=torch.float16),
            "g_idx": torch.empty(input_size, dtype=torch.int32),
        }
        for name, t in tensors.items():
            param = nn.Parameter(t, requires_grad=False)
            # per channel: one group for all inputs, the same on every rank (replicated)
            if name == "qweight" or name == "g_idx" or self.group_size != -1:
                param.input_dim = 0
            if name != "g_idx":
                param.output_dim = 1
            if name == "qzeros":
                param.packed_factor = P
            if name == "g_idx" and self.desc_act:
                param.weight_loader = _shared_g_idx_loader(layer)
            layer.register_parameter(name, param)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Rewrite the loaded GPTQ tensors into what apply() reads (once, on their device)."""
        K = layer.g_idx.numel()
        group = K if self.group_size == -1 else self.group_size
        perm = act_order_perm(layer.g_idx.data, group) if self.desc_act else None
        q, z, s = layer.qweight.data, layer.qzeros.data, layer.scales.data
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            delattr(layer, name)
        layer.register_buffer("perm", None if perm is None else perm.to(torch.int32),
                              persistent=False)
        if self.bits == 4:
            awq_group = max(g for g in SUPPORTED_GROUP_SIZES if group % g == 0)
            tensors = gptq_to_awq(q, z, s, perm, group, self.version, awq_group)
            layer.awq_method = AWQConfig(group_size=awq_group)
        else:
            w = unpack_rows(q, 8)  # [K, N]
            tensors = (w if perm is None else w[perm]).to(torch.uint8), \
                true_zeros(unpack_cols(z, 8), 8, self.version).to(torch.uint8), s
            layer.register_buffer("scales_t", int8_gemv_scales(s), persistent=False)
        for name, t in zip(("qweight", "qzeros", "scales"), tensors):
            layer.register_parameter(name, nn.Parameter(t.contiguous(), requires_grad=False))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """y [..., out] = x [..., in] @ W + bias (x's inputs permuted first under act-order)."""
        if self.bits == 4:
            if layer.perm is not None:
                x = x.index_select(-1, layer.perm)
            return layer.awq_method.apply(layer, x, bias)
        y = gptq_int8_gemm(x.reshape(-1, x.shape[-1]), layer.qweight, layer.qzeros, layer.scales,
                           layer.perm, layer.scales_t).reshape(*x.shape[:-1], -1)
        return y if bias is None else y + bias


def _shared_g_idx_loader(layer: nn.Module):
    """A fused layer (q/k/v, gate/up) has one input row order: its shards' g_idx must agree
    (they do when the quantizer saw one input: GPTQ orders rows by the input's Hessian)."""
    from tinypaged.models.layers import default_weight_loader

    seen: set = set()

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if seen and not torch.equal(param.data, loaded.to(param.device, param.dtype)):
            raise ValueError(f"GPTQ act-order: g_idx of shard {shard_id!r} differs from the "
                             f"other shards of the fused layer {type(layer).__name__}; its "
                             "shards must share one input row order")
        if not seen:  # act-order layers hold all input rows (checked in create_weights)
            default_weight_loader(param, loaded)
        seen.add(shard_id)

    return load
