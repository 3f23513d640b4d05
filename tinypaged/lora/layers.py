"""The LoRA side of the linear layers: each adapted linear holds its slots' stacked A and B
matrices, and all of them read one per-step token -> slot index.

    LoRABatch   sorted_token_ids [max_tokens], seg_start [L], seg_len [L]: the step's tokens
                grouped by slot (kernels/lora_shrink.py `lora_segments`). Static device buffers:
                a CUDA graph (decode or piecewise) captured once reads each replay's segments.
    LoRALinear  lora_a [L, S * R, in] and lora_b [L, out, R] for this rank's slice of one linear
                with S shards (qkv: 3, gate-up: 2, o / down: 1); `apply(x, y)` adds every token's
                adapter delta into the base output y = x W^T (dense or quantized: the delta is
                added after the base matmul, so AWQ/GPTQ/GGUF models take bf16 adapters).
                On CUDA (TINYPAGED_LORA_OVERLAP, on by default) the layer calls
                `shrink_beside(x)` before its base matmul and `expand(y, shrunk)` after: the
                shrink reads only x, so it runs on a side stream beside the base matmul
                (side_stream.py). At decode (up to SPLIT_MAX_TOKENS rows) the expand's product
                runs there too, into an fp32 delta, and `expand` only adds the delta into y
                (kernels/lora_expand.py `lora_add`): the one LoRA kernel left on the critical
                path is a single round trip to memory.
                In a step where no token has an adapter (`LoRABatch.run_lora` False) the layer
                runs none of it, eager or in a graph captured for such steps (lora/idle.py).

Tensor parallelism slices A and B as the base weight is sliced. Column-parallel (qkv, gate-up):
rank r computes y[:, its columns], so it holds all of A and its rows of B (each shard cut as the
base layer cuts it, `shard_layout`). Row-parallel (o, down): rank r gets x's r-th slice of the
input features and adds its partial y before the all-reduce, so it holds A's r-th slice of
columns and all of B: sum_r (x_r A_r^T) B^T = (x A^T) B^T, no extra communication.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from tinypaged import envs
from tinypaged.kernels.lora_expand import lora_add, lora_expand
from tinypaged.kernels.lora_shrink import lora_segments, lora_shrink, shrink_splits
from tinypaged.lora.adapter import LoRAAdapter
from tinypaged.lora.side_stream import SideStream, overlap_stream
from tinypaged.models.layers import MergedColumnParallelLinear, RowParallelLinear

ADAPTED = ("qkv_proj", "gate_up_proj", "o_proj", "down_proj")
# the most rows for which a side-stream shrink takes its expand's product along (decode): there
# the expand is a chain of dependent loads, a long wait on the critical path for a few FLOPs
SPLIT_MAX_TOKENS = 16


@functools.cache
def planes_numel(max_tokens: int, in_features: int, width: int) -> int:
    """The largest SPLIT_K * T * width over batches of 1..max_tokens rows."""
    return max(shrink_splits(t, in_features) * t for t in range(1, max_tokens + 1)) * width


class Shrunk(NamedTuple):
    """A queued shrink: its input rows x [T, in] (held until the expand: the side stream may
    still read them), its partial sums h [SPLIT_K, T, S * R], the side stream it runs on
    (None: the current stream) and, when the expand's product was queued there as well, the
    delta [T, out] fp32 it makes (None: the expand does all of it)."""

    x: torch.Tensor
    h: torch.Tensor
    side: SideStream | None
    delta: torch.Tensor | None = None


class LoRABatch:
    """The step's token -> slot index in static buffers (see the module docstring)."""

    def __init__(self, num_slots: int, max_tokens: int, device: torch.device) -> None:
        self.num_slots, self.device = num_slots, device
        self.sorted_token_ids = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.seg_start = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.seg_len = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.has_adapter = torch.zeros(max_tokens, dtype=torch.int32, device=device)  # [T] 0/1
        self.any_adapter = False
        # whether this step's forward runs the LoRA kernels (lora/idle.py): when a token has an
        # adapter, and in every step on CUDA with TINYPAGED_LORA_SKIP_IDLE=0 (read once: the
        # graphs are captured for it; the CPU has no graphs to keep the kernels for)
        self.always_run = not envs.TINYPAGED_LORA_SKIP_IDLE and device.type == "cuda"
        self.run_lora = self.always_run
        self.max_tokens = max_tokens
        # the shrink's partial-sum planes, shared by every layer (each layer's expand has read
        # them before the next layer's shrink writes; a shrink on the side stream forks after
        # the expand before it is queued): no allocation per call, and one address that every
        # captured graph reads
        self.planes = torch.empty(0, dtype=torch.float32, device=device)
        # the split expand's deltas [T <= SPLIT_MAX_TOKENS, out] fp32, shared the same way
        self.deltas = torch.empty(0, dtype=torch.float32, device=device)

    def reserve_planes(self, in_features: int, width: int) -> None:
        """Grow `planes` to the most any batch of up to max_tokens rows needs for a linear of
        in_features inputs and a shrink output `width` (S * R) wide."""
        need = planes_numel(self.max_tokens, in_features, width)
        if need > self.planes.numel():
            self.planes = torch.empty(need, dtype=torch.float32, device=self.device)

    def reserve_delta(self, out_features: int) -> None:
        """Grow `deltas` to hold a split expand's delta for a linear of out_features outputs."""
        need = min(SPLIT_MAX_TOKENS, self.max_tokens) * out_features
        if need > self.deltas.numel():
            self.deltas = torch.empty(need, dtype=torch.float32, device=self.device)

    def delta_for(self, num_tokens: int, out_features: int) -> torch.Tensor:
        """delta [T, out_features] fp32 for one split expand, a view of `deltas`."""
        return self.deltas[: num_tokens * out_features].view(num_tokens, out_features)

    def planes_for(self, num_tokens: int, in_features: int, width: int) -> torch.Tensor:
        """h [SPLIT_K, T, width] fp32 for one shrink, a view of `planes` (allocated only for a
        batch wider than max_tokens: the profiling pass)."""
        shape = (shrink_splits(num_tokens, in_features), num_tokens, width)
        if shape[0] * num_tokens * width > self.planes.numel():
            return torch.empty(shape, dtype=torch.float32, device=self.device)
        return self.planes[: shape[0] * num_tokens * width].view(shape)

    def prepare(self, token_slots: np.ndarray | None) -> None:
        """Fill the buffers for a step whose token t runs the adapter in slot token_slots[t]
        (-1: none; None: no token has one)."""
        any_adapter = token_slots is not None and bool((token_slots >= 0).any())
        self.run_lora = any_adapter or self.always_run
        if not any_adapter:
            if self.any_adapter:  # zeros for the kernels that may still run (always_run), once
                self.seg_len.zero_()
                self.has_adapter.zero_()
            self.any_adapter = False
            return
        self.any_adapter = True
        if len(token_slots) > len(self.sorted_token_ids):  # only the profiling pass is this wide
            self.sorted_token_ids = torch.zeros(len(token_slots), dtype=torch.int32,
                                                device=self.device)
            self.has_adapter = torch.zeros_like(self.sorted_token_ids)
        slots = torch.from_numpy(token_slots)
        meta = torch.cat((*lora_segments(slots, self.num_slots), (slots >= 0).to(torch.int32)))
        if self.device.type == "cuda":  # a pageable source would make the host wait for the GPU
            meta = meta.pin_memory()
        meta = meta.to(self.device, non_blocking=True)  # one copy: [T] | [L] | [L] | [T]
        num_tokens, num_slots = len(token_slots), self.num_slots
        self.sorted_token_ids[:num_tokens].copy_(meta[:num_tokens])
        self.seg_start.copy_(meta[num_tokens : num_tokens + num_slots])
        self.seg_len.copy_(meta[num_tokens + num_slots : num_tokens + 2 * num_slots])
        self.has_adapter[:num_tokens].copy_(meta[num_tokens + 2 * num_slots :])


class LoRALinear:
    """One adapted linear's slots (see the module docstring); `layer.lora` points here."""

    def __init__(self, layer: nn.Module, batch: LoRABatch, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.layer, self.batch, self.max_rank = layer, batch, max_rank
        self.row_parallel = isinstance(layer, RowParallelLinear)
        if isinstance(layer, MergedColumnParallelLinear):
            self.shards = list(layer.shard_ids())
            starts = [layer.shard_layout(s)[0] for s in self.shards]
        else:
            self.shards, starts = [None], [0]
        self.offsets = (*starts, layer.output_size)  # each shard's columns of this rank's y
        num_slots = batch.num_slots
        self.lora_a = torch.zeros(num_slots, len(self.shards) * max_rank, layer.input_size,
                                  dtype=dtype, device=device)  # [L, S * R, in]
        self.lora_b = torch.zeros(num_slots, layer.output_size, max_rank, dtype=dtype,
                                  device=device)  # [L, out, R]
        batch.reserve_planes(layer.input_size, self.lora_a.shape[1])
        batch.reserve_delta(layer.output_size)

    def shard_pieces(self, weights: dict, name: str) -> list[tuple[int, torch.Tensor,
                                                                  torch.Tensor]]:
        """(shard index, A, B) of this rank for each shard the adapter adapts, full-size tensors
        from the checkpoint cut to this rank's slice."""
        layer, pieces = self.layer, []
        fused = weights.get((name, None))
        if fused is not None and len(self.shards) > 1:  # one A for the fused layer: split B
            a, b = fused
            sizes = list(layer.output_sizes)
            if b.shape[0] != sum(sizes):
                raise ValueError(f"LoRA {name}: lora_B has {b.shape[0]} rows, the layer "
                                 f"{sum(sizes)}")
            by_shard = dict(zip(self.shards, b.split(sizes)))
            weights = {**weights, **{(name, s): (a, by_shard[s]) for s in self.shards}}
        for i, shard in enumerate(self.shards):
            if (name, shard) not in weights:
                continue
            a, b = weights[(name, shard)]  # [r, in_full], [out_full, r]
            if self.row_parallel and layer.tp_size > 1:
                a = a.narrow(1, layer.tp_rank * layer.input_size, layer.input_size)
            elif shard is not None:
                _, size, full, index = layer.shard_layout(shard)
                if b.shape[0] != full:
                    raise ValueError(f"LoRA {name} shard {shard}: lora_B has {b.shape[0]} rows, "
                                     f"the layer {full}")
                b = b.narrow(0, index * size, size)
            elif layer.tp_size > 1 and not self.row_parallel:
                b = b.narrow(0, layer.tp_rank * layer.output_size, layer.output_size)
            if a.shape[1] != layer.input_size:
                raise ValueError(f"LoRA {name}: lora_A has {a.shape[1]} input features, the "
                                 f"layer {layer.input_size} on this rank")
            pieces.append((i, a, b))
        return pieces

    def set_slot(self, slot: int, adapter: LoRAAdapter | None, name: str) -> None:
        """Put `adapter`'s matrices for this layer into `slot` (zeros where it adapts nothing)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if adapter is None:
            return
        rank = self.max_rank
        for i, a, b in self.shard_pieces(adapter.weights, name):
            r = a.shape[0]
            self.lora_a[slot, i * rank : i * rank + r].copy_(a)
            lo, hi = self.offsets[i], self.offsets[i + 1]
            self.lora_b[slot, lo:hi, :r].copy_(b)

    @property
    def active(self) -> bool:
        """Whether this step's forward adds the adapters' deltas (lora/idle.py): False, and the
        layer is its base linear alone, when no token of the step has an adapter."""
        return self.batch.run_lora

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y += each token's adapter delta, in place; x [T, in], y [T, out] (this rank's): the
        shrink then the expand, queued after the base matmul that made y."""
        shrunk = self.shrink(x)
        return y if shrunk is None else self.expand(y, shrunk)

    def shrink_beside(self, x: torch.Tensor) -> Shrunk | None:
        """On CUDA with TINYPAGED_LORA_OVERLAP, launch the shrink of x on the side stream
        (lora/side_stream.py), and at decode the expand's product with it, to be called before
        the base matmul; `expand` joins it. None: no side stream here, the caller runs `apply`
        after the base matmul."""
        side = overlap_stream(x)
        return None if side is None else self.shrink(x, side)

    def shrink(self, x: torch.Tensor, side: SideStream | None = None) -> Shrunk | None:
        """Queue h = x A^T as the shrink's partial sums (on `side` when given); None when there
        is nothing to add (no token with an adapter: `active`)."""
        batch = self.batch
        if not batch.run_lora:
            return None
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        num_tokens = x2.shape[0]
        h = batch.planes_for(num_tokens, x2.shape[1], self.lora_a.shape[1])  # no zeroing needed
        args = (x2, self.lora_a, batch.sorted_token_ids[:num_tokens], batch.seg_start,
                batch.seg_len, h)
        if side is None:
            lora_shrink(*args)
            return Shrunk(x2, h, None)
        delta = None
        with side.fork():
            lora_shrink(*args)
            if num_tokens <= min(SPLIT_MAX_TOKENS, batch.max_tokens):  # only the add waits for y
                delta = batch.delta_for(num_tokens, self.layer.output_size)
                self.expand_into(delta, h, num_tokens, accumulate=False)
        return Shrunk(x2, h, side, delta)

    def expand(self, y: torch.Tensor, shrunk: Shrunk) -> torch.Tensor:
        """y += h B^T in place (y [T, out], h from `shrink`), after joining the side stream;
        a delta made there is only added."""
        if shrunk.side is not None:
            shrunk.side.join()
        num_tokens = shrunk.x.shape[0]
        if shrunk.delta is not None:
            lora_add(y.view(num_tokens, -1), shrunk.delta, self.batch.has_adapter)
        else:
            self.expand_into(y.view(num_tokens, -1), shrunk.h, num_tokens)
        return y

    def expand_into(self, out: torch.Tensor, h: torch.Tensor, num_tokens: int,
                    accumulate: bool = True) -> None:
        """out [T, out] += h B^T (accumulate=False: out = h B^T, fp32) for the step's tokens."""
        batch = self.batch
        lora_expand(out, h, self.lora_b, batch.sorted_token_ids[:num_tokens], batch.seg_start,
                    batch.seg_len, self.offsets, accumulate)


def attach_lora(model: nn.Module, batch: LoRABatch, max_rank: int, dtype: torch.dtype,
                device: torch.device) -> dict[str, LoRALinear]:
    """Give every adaptable linear of `model` its LoRALinear (`layer.lora`); returns them by
    module name."""
    layers = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ADAPTED and hasattr(module, "input_size"):
            module.lora = layers[name] = LoRALinear(module, batch, max_rank, dtype, device)
    if not layers:
        raise ValueError(f"enable_lora: {type(model).__name__} has no {'/'.join(ADAPTED)} "
                         "layers to adapt; LoRA serves the decoder models (models/decoder.py)")
    return layers
