"""QuantizationMethod: what a quantization format implements so the model's linears run it.

The life of one quantized linear, y = x W^T + b with W [out, in] stored in the format's tensors:

1. `from_config(quantization_config)`: config.json's `quantization_config` (a converted GGUF
   file's is {"quant_method": "gguf"}) -> one method object, shared by every linear of the model.
   Variants the kernels cannot run are refused here, before anything is built.
2. `create_weights(layer, input_size, output_size_per_partition, params_dtype)`: each linear
   (models/layers.py) registers the checkpoint's tensors on itself in this tensor-parallel rank's
   sizes: a column-parallel layer holds out / tp outputs, a row-parallel one in / tp inputs. Each
   parameter names its axes (`output_dim`, `input_dim`, and `packed_factor` when several values
   share one stored element along the outputs), so the layer's weight loaders cut a rank's slice
   and place a fused layer's shards (q, k, v / gate, up) as they do for a dense weight; a
   parameter that carries its own `weight_loader` keeps it.
3. Load: `model.load_weights` streams the checkpoint's tensors through those loaders.
4. `process_weights_after_loading(layer)`: once, on the device, rewrite what was loaded into
   what the kernels read (GPTQ repacks into the AWQ layout and permutes act-order rows).
5. `apply(layer, x, bias)`: y [..., out] = x [..., in] @ W^T + bias, computed from the packed
   tensors by the format's kernels (tinypaged/kernels/: Triton on CUDA, the torch reference on
   the CPU).

`prepare_model(model)` runs between building the model and loading it, for a format that also
stores other modules its own way (GGUF: the embedding and the LM head).

vLLM splits this into a QuantizationConfig (steps 1 and the per-layer choice of method) and a
LinearMethodBase (steps 2-5); with one method per format here, one class holds both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import nn


class QuantizationMethod(ABC):
    """Base of every format's linear method; `name` is its key in the registry and the
    `quant_method` its checkpoints declare."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def from_config(cls, quantization_config: dict) -> QuantizationMethod:
        """From config.json's `quantization_config`; unsupported variants raise ValueError."""

    @classmethod
    def own_config(cls, quantization_config: dict) -> dict:
        """A copy of `quantization_config`, refused (ValueError) when it declares another
        format's `quant_method`; from_config reads its fields from the copy."""
        q = dict(quantization_config)
        if q.get("quant_method", cls.name) != cls.name:
            raise ValueError(f"quantization_config.quant_method is {q['quant_method']!r}, not "
                             f"{cls.name!r}")
        return q

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size: int,
                       output_size_per_partition: int, params_dtype: torch.dtype) -> None:
        """Register this format's parameters on `layer` (this rank's sizes)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack `layer`'s loaded tensors for apply(); the default keeps them as loaded."""
        return

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """y [..., out] = x [..., in] @ W^T + bias from `layer`'s packed tensors."""

    def prepare_model(self, model: nn.Module) -> None:
        """Swap modules other than the linears before the weights load; the default swaps none."""
        return
