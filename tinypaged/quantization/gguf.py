"""GGUF weights kept in their block formats: the linear method, the embedding and the LM head.

A GGUF file is loaded without a float copy (gguf.py reads it): every matrix reaches the model as
a `GGUFWeight`, the file's raw rows `[N, row_bytes]` and their GGML type, and stays that way on
the device, its bytes regrouped once into the kernels' planes (kernels/gguf_layout.py: same
size). The matmuls run `tinypaged.kernels.gguf.gguf_linear` (Triton on CUDA: the decode
GEMV reads the packed blocks once; prefill dequantizes and calls cuBLAS).

Unlike AWQ, a layer's storage is known only once its tensors arrive: a "_K_M" file mixes types
(Q4_K for most matrices, Q6_K for attn_v and some ffn_down), so the q, k and v parts of one fused
QKV layer may differ. Each layer therefore registers an empty placeholder `weight` (so the
model's load_weights finds it under the usual name) and keeps its data in `gguf_parts`: runs of
consecutive shards of one type, concatenated along the output features. All-same-type layers
(the common case) are one part and one kernel launch; mixed layers run one per part and
concatenate the outputs, as vLLM does. Matrices stored as F32/F16/BF16 become dense weights in
the model dtype.

On the CPU the quantized matrices are dequantized once at load into fp32 (`cpu_dequantize`):
dequantizing inside every matmul instead would keep the weights several times smaller but
redo the dequantize at every step, which makes decode several times slower, and a CPU has the
memory (benchmarks/gguf_cpu.py; figures in benchmarks/RESULTS.md). The embedding table stays
in blocks (a lookup decodes only its rows); a tied LM head gets its own fp32 copy at its first
call.

Embedding and LM head are module swaps (`prepare_model`), made before weights load: a row
lookup dequantizes only the looked-up rows, and a tied LM head reads the embedding's blocks.
Tensor parallelism is not supported for GGUF weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tinypaged.kernels.gguf import gguf_dequantize, gguf_linear, to_device_layout
from tinypaged.kernels.gguf_format import DENSE_TYPES, ggml_type, row_bytes
from tinypaged.quantization.base import QuantizationMethod

DENSE = -1  # part type of a weight held as a plain float matrix


@dataclass
class GGUFWeight:
    """One GGUF matrix as stored: rows `data` uint8 [N, row_bytes] (numpy or torch) of GGML
    type `type_id`, holding a [N, K] weight."""

    type_id: int
    data: np.ndarray | torch.Tensor
    shape: tuple[int, int]

    @property
    def bytes_read(self) -> int:  # the loader's read statistics
        return self.shape[0] * row_bytes(self.type_id, self.shape[1])


def _to_part(weight: GGUFWeight, device: torch.device, dtype: torch.dtype,
             cpu_dequantize: bool) -> tuple[int, torch.Tensor]:
    """(type id, uint8 rows in the kernels' device layout) on `device`, or (DENSE, float [N, K])
    for float types and the CPU."""
    rows = weight.data
    if isinstance(rows, np.ndarray):  # a read-only view of the file: copy it out
        rows = torch.from_numpy(np.array(rows))
    rows = to_device_layout(rows.to(device), weight.type_id, weight.shape[1])
    if weight.type_id in DENSE_TYPES or (cpu_dequantize and device.type == "cpu"):
        return DENSE, gguf_dequantize(rows, weight.type_id, weight.shape[1], dtype)
    return weight.type_id, rows


def _matmul(parts: list[tuple[int, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W^T over the row parts of W -> [M, N]."""
    ys = [F.linear(x, w) if t == DENSE else gguf_linear(x, w, t) for t, w in parts]
    return ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)


def _check(loaded, shape: tuple[int, int], what: str) -> GGUFWeight:
    if not isinstance(loaded, GGUFWeight):
        raise ValueError(f"{what}: expected a GGUF matrix, got {type(loaded).__name__}")
    if tuple(loaded.shape) != tuple(shape):
        raise ValueError(f"{what}: expected shape {tuple(shape)}, got {tuple(loaded.shape)}")
    ggml_type(loaded.type_id)  # a clear error for a type we cannot read
    return loaded


@dataclass(frozen=True)
class GGUFConfig(QuantizationMethod):
    """The quant_config of a model loaded from a GGUF file (config.json: quant_method gguf)."""

    name: ClassVar[str] = "gguf"
    cpu_dequantize: bool = True

    @classmethod
    def from_config(cls, quantization_config: dict) -> GGUFConfig:
        return cls()

    def create_weights(self, layer: nn.Module, input_size: int,
                       output_size_per_partition: int, params_dtype: torch.dtype) -> None:
        placeholder = nn.Parameter(torch.empty(0, dtype=params_dtype), requires_grad=False)
        placeholder.weight_loader = lambda param, loaded, shard_id=None: self._load(
            layer, loaded, shard_id)
        layer.register_parameter("weight", placeholder)
        layer.gguf_parts, layer.gguf_pending = [], {}
        layer.gguf_dtype = params_dtype

    def _load(self, layer: nn.Module, loaded, shard_id) -> None:
        """Keep one shard (q, k, v / gate, up, or the whole matrix); when the layer has all of
        them, merge runs of one type into parts."""
        sizes = getattr(layer, "output_sizes", [layer.output_size])
        shard_ids = layer.shard_ids() if hasattr(layer, "shard_ids") else (None,)
        rows = sizes[shard_ids.index(shard_id)] if shard_id is not None else layer.output_size
        what = f"GGUF shard {shard_id!r}" if shard_id is not None else "GGUF weight"
        weight = _check(loaded, (rows, layer.input_size), what)
        device = layer.weight.device
        part = _to_part(weight, device, layer.gguf_dtype, self.cpu_dequantize)
        if shard_id is None:  # the whole (possibly fused: phi3's attn_qkv) matrix at once
            layer.gguf_parts = [part]
            return
        layer.gguf_pending[shard_id] = part
        if set(layer.gguf_pending) == set(shard_ids):
            ordered = [layer.gguf_pending[s] for s in shard_ids if s in layer.gguf_pending]
            parts: list[tuple[int, list[torch.Tensor]]] = []
            for type_id, data in ordered:
                if parts and parts[-1][0] == type_id:
                    parts[-1][1].append(data)
                else:
                    parts.append((type_id, [data]))
            layer.gguf_parts = [(t, d[0] if len(d) == 1 else torch.cat(d)) for t, d in parts]
            layer.gguf_pending = {}

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """y [..., out] = x [..., in] @ W^T + bias."""
        if not layer.gguf_parts:
            raise RuntimeError("a GGUF linear layer ran before all of its weights were loaded")
        y = _matmul(layer.gguf_parts, x.reshape(-1, x.shape[-1]))
        if bias is not None:
            y += bias
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def prepare_model(self, model: nn.Module) -> None:
        """Swap the embedding and LM head for GGUF ones (tied: the head reads the embedding)."""
        from tinypaged.distributed.parallel_state import get_tp_size

        if get_tp_size() > 1:
            raise ValueError("GGUF checkpoints run on one GPU (tensor_parallel_size=1); for "
                             "tensor parallelism load the model's Hugging Face checkpoint")
        embed = model.model.embed_tokens
        device, dtype = embed.weight.device, embed.weight.dtype
        model.model.embed_tokens = GGUFEmbedding(embed.num_embeddings, embed.embedding_dim,
                                                 self, device, dtype)
        tied = model.model.embed_tokens if model.spec.tie_word_embeddings else None
        model.lm_head = GGUFLMHead(embed.num_embeddings, embed.embedding_dim, self, device,
                                   dtype, tied)


class GGUFEmbedding(nn.Module):
    """Token embedding whose table stays in GGUF blocks: only the looked-up rows are decoded."""

    def __init__(self, num_embeddings: int, embedding_dim: int, quant: GGUFConfig,
                 device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.quant, self.dtype = quant, dtype
        self.weight = nn.Parameter(torch.empty(0, dtype=dtype, device=device),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.gguf_parts: list[tuple[int, torch.Tensor]] = []

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        weight = _check(loaded, (self.num_embeddings, self.embedding_dim), "GGUF embedding")
        # the lookup decodes a few rows, so the table stays quantized even on the CPU, where
        # only the (tied) LM head needs it whole
        self.gguf_parts = [_to_part(weight, param.device, self.dtype, cpu_dequantize=False)]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        type_id, table = self.gguf_parts[0]
        rows = table[input_ids]  # [T, row_bytes] (or [T, hidden] for a float table)
        if type_id == DENSE:
            return rows
        return gguf_dequantize(rows, type_id, self.embedding_dim, self.dtype)  # [T, hidden]


class GGUFLMHead(nn.Module):
    """logits = hidden @ E^T in float32 with E in GGUF blocks (`tied`: the embedding's table)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, quant: GGUFConfig,
                 device: torch.device, dtype: torch.dtype,
                 tied: GGUFEmbedding | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.quant, self.dtype, self.tied = quant, dtype, tied
        if tied is not None:
            self.weight = tied.weight  # one parameter: load_weights sees the embedding only
        else:
            self.weight = nn.Parameter(torch.empty(0, dtype=dtype, device=device),
                                       requires_grad=False)
            self.weight.weight_loader = self.weight_loader
        self.gguf_parts: list[tuple[int, torch.Tensor]] = []

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        weight = _check(loaded, (self.num_embeddings, self.embedding_dim), "GGUF LM head")
        self.gguf_parts = [_to_part(weight, param.device, self.dtype, self.quant.cpu_dequantize)]

    def _parts(self) -> list[tuple[int, torch.Tensor]]:
        if self.tied is None:
            return self.gguf_parts
        if not self.gguf_parts:  # first call: the CPU's dense copy of the tied table, if any
            type_id, table = self.tied.gguf_parts[0]
            if type_id != DENSE and self.quant.cpu_dequantize and table.device.type == "cpu":
                table = gguf_dequantize(table, type_id, self.embedding_dim, self.dtype)
                type_id = DENSE
            self.gguf_parts = [(type_id, table)]
        return self.gguf_parts

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return _matmul(self._parts(), hidden).float()  # [N, vocab]
