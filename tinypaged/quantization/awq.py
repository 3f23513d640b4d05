"""AWQ int4 linear layers: the quantization config that the model's linear layers call.

An AutoAWQ "GEMM" checkpoint announces itself in config.json:

    "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128,
                            "zero_point": true, "version": "gemm"}

and stores, instead of `weight [out, in]`, three tensors per linear of the decoder layers
(`tinypaged.kernels.awq` has the bit layout):

    qweight int32 [in, out/8]      qzeros int32 [in/G, out/8]      scales fp16 [in/G, out]

The output dimension is 1 for all three, packed 8 to an int32 in qweight and qzeros. The layers'
weight loaders read `output_dim`, `input_dim` and `packed_factor`, so fused QKV and gate-up
concatenate the packed tensors along dim 1 (and tensor parallelism slices them) exactly as they
do dense weights. The forward pass is `awq_gemm`: Triton on CUDA, the torch reference on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from tinypaged.kernels.awq import GEMV_MAX_M, SUPPORTED_GROUP_SIZES, awq_gemm, gemv_scales
from tinypaged.quantization.base import QuantizationMethod

PACK_FACTOR = 8  # int4 values per int32


@dataclass(frozen=True)
class AWQConfig(QuantizationMethod):
    name: ClassVar[str] = "awq"
    group_size: int

    @classmethod
    def from_config(cls, quantization_config: dict) -> AWQConfig:
        """From config.json's `quantization_config`; unsupported variants raise ValueError."""
        q = cls.own_config(quantization_config)
        # AutoAWQ writes "bits"; some exporters "w_bit" / "q_group_size"
        bits = q.get("bits", q.get("w_bit", 4))
        group_size = q.get("group_size", q.get("q_group_size"))
        version = str(q.get("version", "gemm")).lower()
        if bits != 4:
            raise ValueError(f"AWQ checkpoint with bits={bits}: tinypaged runs 4-bit AWQ only")
        if not q.get("zero_point", True):
            raise ValueError("AWQ checkpoint with zero_point=false (symmetric): tinypaged runs "
                             "the zero-point (asymmetric) AutoAWQ format only")
        if version != "gemm":
            raise ValueError(f"AWQ checkpoint version {version!r}: tinypaged reads the 'gemm' "
                             "packing only; re-export it with version='gemm' (or run "
                             "`tinypaged quantize` on the unquantized model)")
        if group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(f"AWQ checkpoint with group_size={group_size}: supported group "
                             f"sizes are {SUPPORTED_GROUP_SIZES}")
        if q.get("modules_to_not_convert"):
            raise ValueError(f"AWQ checkpoint with modules_to_not_convert="
                             f"{q['modules_to_not_convert']}: mixing dense and int4 linears is "
                             "not supported")
        return cls(group_size=group_size)

    from_hf_config = from_config

    def create_weights(self, layer: nn.Module, input_size: int,
                       output_size_per_partition: int, params_dtype: torch.dtype) -> None:
        """Register qweight, qzeros and scales on `layer` (this rank's sizes)."""
        if input_size % self.group_size:
            raise ValueError(f"AWQ: a linear layer with {input_size} input features (per "
                             f"tensor-parallel rank) is not a whole number of groups of "
                             f"group_size={self.group_size}; use a smaller tensor_parallel_size")
        if output_size_per_partition % PACK_FACTOR:
            raise ValueError(f"AWQ: a linear layer with {output_size_per_partition} output "
                             f"features (per rank) cannot be packed {PACK_FACTOR} to an int32")
        groups, packed = input_size // self.group_size, output_size_per_partition // PACK_FACTOR
        # scales stay fp16 whatever the model dtype: bf16 would drop 3 bits of each scale
        tensors = {
            "qweight": torch.empty(input_size, packed, dtype=torch.int32),
            "qzeros": torch.empty(groups, packed, dtype=torch.int32),
            "scales": torch.empty(groups, output_size_per_partition, dtype=torch.float16),
        }
        for name, t in tensors.items():
            param = nn.Parameter(t, requires_grad=False)
            param.input_dim, param.output_dim = 0, 1
            if name != "scales":
                param.packed_factor = PACK_FACTOR
            layer.register_parameter(name, param)

    @staticmethod
    def _gemv_scales(layer: nn.Module) -> torch.Tensor | None:
        """The decode GEMVs' copy of the scales (gemv_scales), built on the first decode-sized
        call on the GPU (the runner's warm-up, before CUDA graphs are captured): 3% more
        memory than the packed weights at group size 128."""
        scales = layer.scales
        cached = getattr(layer, "scales_t", None)
        if cached is not None and cached.device == scales.device:
            return cached
        if scales.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return None
        layer.scales_t = gemv_scales(scales)
        return layer.scales_t

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """y [..., out] = x [..., in] @ dequant(qweight) + bias."""
        x2 = x.reshape(-1, x.shape[-1])
        y = awq_gemm(x2, layer.qweight, layer.qzeros, layer.scales, self.group_size,
                     scales_t=self._gemv_scales(layer) if x2.shape[0] <= GEMV_MAX_M else None)
        if bias is not None:
            y += bias
        return y.reshape(*x.shape[:-1], y.shape[-1])
