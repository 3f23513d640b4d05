"""Which adapters are where: `max_loras` GPU slots and a CPU cache of `max_cpu_loras` adapters,
both least-recently-used, as vLLM's.

    request names adapter 7 --> CPU cache (read from disk on a miss, LRU eviction)
                            --> a GPU slot for the steps that run it (LRU among the slots that
                                no token of the step needs)

The scheduler admits a sequence only while the running sequences use at most max_loras distinct
adapters (scheduler.py), so every step fits in the slots. Rank 0's runner plans each step
(`LoRARuntime.plan`: the slot of every token, and which slots must be (re)loaded first); the plan
travels in the StepInput, so every tensor-parallel rank loads the same adapter into the same slot
(each from its own CPU cache) before it runs the step (`LoRARuntime.prepare`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np
import torch

from tinypaged.lora.adapter import LoRAAdapter, load_adapter
from tinypaged.lora.layers import LoRABatch, attach_lora
from tinypaged.lora.request import LoRARequest


@dataclass
class LoRAStep:
    """One step's LoRA plan: token_slots [T] int32 (-1: no adapter) and the slots to load first."""

    token_slots: np.ndarray
    loads: list[tuple[int, LoRARequest]] = field(default_factory=list)


class CPUCache:
    """Adapters read from disk, at most `capacity`, least recently used evicted first."""

    def __init__(self, capacity: int, max_rank: int) -> None:
        self.capacity, self.max_rank = capacity, max_rank
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()

    def get(self, request: LoRARequest, check=None) -> LoRAAdapter:
        adapter = self.adapters.get(request.lora_int_id)
        if adapter is None or adapter.path != str(request.lora_path):  # new, or id reused
            adapter = load_adapter(request.lora_path, request.lora_name, request.lora_int_id,
                                   self.max_rank)
            if check is not None:
                check(adapter)
            while len(self.adapters) >= self.capacity:
                self.adapters.popitem(last=False)
            self.adapters[request.lora_int_id] = adapter
        self.adapters.move_to_end(request.lora_int_id)
        return adapter

    def remove(self, int_id: int) -> None:
        self.adapters.pop(int_id, None)


class LoRARuntime:
    """A rank's LoRA state: the layers' slots, the CPU cache, and (rank 0) the slot plan."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int, max_tokens: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.max_loras = max_loras
        self.batch = LoRABatch(max_loras, max_tokens, device)
        self.layers = attach_lora(model, self.batch, max_lora_rank, dtype, device)
        self.cpu = CPUCache(max_cpu_loras, max_lora_rank)
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self.loaded: list[int | None] = [None] * max_loras  # slot -> adapter id (every rank)

    # ---- rank 0: requests and plans ------------------------------------------------------
    def add(self, request: LoRARequest) -> LoRAAdapter:
        """Read (or find) a request's adapter now, so that a bad one fails that request alone."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        return self.cpu.get(request, self._check)

    def _check(self, adapter: LoRAAdapter) -> None:
        """Every module of the adapter must be one of this model's layers, in shape."""
        targets = {name for name, _ in adapter.weights}
        unknown = sorted(targets - set(self.layers))
        if unknown:
            raise ValueError(f"LoRA adapter {adapter.name!r} adapts {unknown[0]}, which this "
                             "model does not have (is it an adapter of another model?)")
        for name in targets:
            self.layers[name].shard_pieces(adapter.weights, name)  # raises on a shape mismatch

    def remove(self, int_id: int) -> None:
        """Forget an adapter (unload): its CPU copy now, its slot when next needed."""
        self.cpu.remove(int_id)
        slot = self.slot_of.pop(int_id, None)
        if slot is not None:
            self.loaded[slot] = None

    def plan(self, requests: Seq[LoRARequest | None], num_new_tokens: Seq[int]) -> LoRAStep | None:
        """The slot of each token of a step whose b-th sequence runs requests[b] (None: no
        adapter) for num_new_tokens[b] tokens; None when no sequence has an adapter."""
        if not any(r is not None for r in requests):
            return None
        wanted = {r.lora_int_id: r for r in requests if r is not None}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step needs {len(wanted)} adapters but there are "
                               f"{self.max_loras} slots (the scheduler should prevent it: bug)")
        loads = []
        for int_id, request in wanted.items():
            if int_id in self.slot_of:
                self.slot_of.move_to_end(int_id)
                continue
            free = [s for s in range(self.max_loras) if s not in self.slot_of.values()]
            if free:
                slot = free[0]
            else:  # the least recently used slot that this step does not need
                victim = next(i for i in self.slot_of if i not in wanted)
                slot = self.slot_of.pop(victim)
            self.slot_of[int_id] = slot
            loads.append((slot, request))
        seq_slots = np.array([-1 if r is None else self.slot_of[r.lora_int_id]
                              for r in requests], np.int32)
        return LoRAStep(np.repeat(seq_slots, np.asarray(num_new_tokens, np.int64)), loads)

    # ---- every rank: before the step runs ------------------------------------------------
    def prepare(self, step: LoRAStep | None) -> None:
        if step is not None:
            for slot, request in step.loads:
                adapter = self.cpu.get(request)
                for name, layer in self.layers.items():
                    layer.set_slot(slot, adapter, name)
                self.loaded[slot] = request.lora_int_id
        self.batch.prepare(None if step is None else step.token_slots)


def lora_runtime(config, model: torch.nn.Module, dtype: torch.dtype,
                 device: torch.device) -> LoRARuntime | None:
    """A runner's LoRA state from an EngineConfig (None unless enable_lora)."""
    if not config.enable_lora:
        return None
    max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
    return LoRARuntime(model, config.max_loras, config.max_lora_rank,
                       config.max_cpu_loras or config.max_loras, max_tokens, dtype, device)


def bind_lora(runtime: LoRARuntime | None, request: LoRARequest, seqs: Seq) -> None:
    """Make a new request's sequences run `request`'s adapter, reading it now (engine.py)."""
    if runtime is None:
        raise ValueError("a lora_request was given but LoRA is off; start the engine with "
                         "enable_lora=True (tinypaged serve --enable-lora)")
    runtime.add(request)
    for seq in seqs:
        seq.lora_int_id, seq.lora_request = request.lora_int_id, request
