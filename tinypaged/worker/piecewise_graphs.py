"""Piecewise CUDA graphs for steps that carry prompt tokens (vLLM's PIECEWISE cudagraph mode).

An eager step of a few hundred tokens spends more time launching kernels from Python than the
GPU spends running them (benchmarks/RESULTS-log.md, "host time of an eager mixed step"). Its
attention cannot be captured once and replayed: its grid and tiles follow the batch (how many
sequences, how long each query, prefill or decode kernel). Everything else is token-wise, so
the forward is cut at every attention into L + 1 pieces (DecoderModel.piece):

    piece 0:  embed, layer 0's input norm, QKV, rotary + KV store         -> q_0, h
    attention of layer 0, eager, into the static buffer attn_out
    piece i:  layer i-1's o_proj, norm, MLP; layer i's norm, QKV, store    -> q_i, h
    ...
    piece L:  layer L-1's o_proj, norm, MLP; final norm                   -> hidden

Each piece is captured once per token-count bucket (16..256 step 16, then 288..512 step 32),
largest first, all in one memory pool. A step of T tokens runs in the smallest bucket bs >= T:
its token-wise inputs are copied to the front of static buffers and rows T..bs-1 padded
(input_ids 0, position 0, slot -1 so nothing is stored); attention runs on the first T rows
only, with the step's own metadata, and writes attn_out[:T]. Padding rows never mix with real
ones (every captured op is token-wise), so the first T rows of the result are the eager ones.

Memory: every piece of every bucket is captured into one pool, and a piece's outputs (q, h)
are kept only as weak views (`weak_view`, vLLM's weak_ref_tensor): once the next piece is
captured their memory goes back to the pool, and later captures may reuse it. That is safe
because replays run in capture order: q_i and h_i are dead once piece i+1 has run, and a
bucket's outputs are dead once its step has read them. Held strongly, they would cost
L * ([bs, (heads + 2 kv_heads) * head_dim] + [bs, hidden]) per bucket, ~3.5 GB for the
Llama-3-8B shape. Under tensor parallelism the all-reduces inside o_proj and down_proj would be
captured like the decode graphs' ones; until that is checked on two GPUs, TP stays eager here.

With enable_lora every piece is captured twice, with the LoRA kernels and without, and a step in
which no sequence has an adapter replays the pieces without them (lora/idle.py); the weak views
make the second set cost no memory for its outputs.

Without `capture` (the CPU, tests) `run` is the same loop with each piece run eagerly.
"""

from __future__ import annotations

import bisect
import itertools
import logging

import torch

from tinypaged import envs
from tinypaged.distributed import parallel_state as distributed
from tinypaged.lora.idle import capturing, graph_variants, replay_variant
from tinypaged.lora.layers import LoRABatch
from tinypaged.models.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)


def token_buckets(max_num_tokens: int) -> list[int]:
    """16..256 step 16, then 288..512 step 32, those <= max_num_tokens."""
    sizes = list(range(16, 257, 16)) + list(range(288, 513, 32))
    return [s for s in sizes if s <= max_num_tokens]


def weak_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor over t's memory that does not keep that memory allocated (torch's own CUDA
    graph trees rebuild their outputs the same way)."""
    storage = t.untyped_storage()
    weak = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device,
                                                         storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        weak, t.storage_offset(), t.shape, t.stride())


def piecewise_unsupported(model: torch.nn.Module) -> str | None:
    """Why `model`'s prompt steps must stay eager, or None. Dense and MoE decoders, in float or
    quantized weights, were checked under capture on a GPU (benchmarks/piecewise_check.py:
    the MoE ones route, sort and run their experts on the device). Under tensor parallelism the
    pieces' all-reduces (up to 512 rows) have not yet been captured on two GPUs;
    TINYPAGED_PIECEWISE_UNCHECKED=1 captures them anyway, for the GPU check that would lift
    that (benchmarks/tp_gpu_check.sh)."""
    if getattr(model, "spec", None) is None or not hasattr(model, "model"):
        return "not a DecoderForCausalLM"
    if getattr(model, "aux_layers", ()):  # the pieces do not keep them
        return "speculative decoding's EAGLE / MTP heads read hidden states of its layers"
    if distributed.get_tp_size() > 1 and not envs.TINYPAGED_PIECEWISE_UNCHECKED:
        return "tensor parallelism"
    return None


class PiecewiseGraphs:
    """The captured pieces of one model per token-count bucket and the loop that replays them
    around eager attention (`run`); `capture=False` runs the pieces eagerly instead.
    `lora_batch`: the LoRA slots' step state with enable_lora (each piece is then captured per
    run_lora)."""

    def __init__(self, model: torch.nn.Module, buckets: list[int], device: torch.device,
                 dtype: torch.dtype, capture: bool = True,
                 lora_batch: LoRABatch | None = None) -> None:
        if not buckets:
            raise ValueError("piecewise CUDA graphs need at least one token-count bucket")
        self.decoder = model.model
        self.attns = [layer.self_attn.attn for layer in self.decoder.layers]
        self.buckets = sorted(buckets)
        max_t, first = self.buckets[-1], self.attns[0]
        self.input_ids = torch.zeros(max_t, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_t, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_t,), -1, dtype=torch.int64, device=device)
        # [max_t, num_heads, head_dim]: every layer's attention writes here, the next piece reads
        self.attn_out = torch.zeros(max_t, first.num_heads, first.head_dim, dtype=dtype,
                                    device=device)
        self.lora_batch = lora_batch
        # (bs, piece, run_lora) -> the piece's graph and the outputs it writes
        self.graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int, bool], tuple] = {}
        if capture:
            self._capture()

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.buckets[-1]

    def _piece(self, bs: int, i: int, x: torch.Tensor, residual: torch.Tensor | None):
        key = bs, i, replay_variant(self.lora_batch)
        graph = self.graphs.get(key)
        if graph is None:
            return self.decoder.piece(i, x, residual, self.positions[:bs], self.slot_mapping[:bs])
        graph.replay()
        return self.outputs[key]  # the tensors the capture wrote: x, residual were its inputs

    def _forward(self, bs: int, n: int, attn_metadata: AttentionMetadata | None) -> torch.Tensor:
        """Pieces and attentions of bucket bs, the step's n real tokens at the front;
        attn_metadata None: skip attention (capture records only the pieces)."""
        x, residual, out = self.input_ids[:bs], None, self.attn_out[:bs]
        for i, attn in enumerate(self.attns):
            q, residual = self._piece(bs, i, x, residual)
            if attn_metadata is not None:
                attn.attend(q[:n], attn_metadata, out=out[:n])
            x = out
        return self._piece(bs, len(self.attns), x, residual)[0]  # [bs, hidden]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            attn_metadata: AttentionMetadata) -> torch.Tensor:
        """hidden [T, hidden] of a step of T <= max bucket tokens (device tensors, as the eager
        forward takes them)."""
        n = input_ids.shape[0]
        bs = self.buckets[bisect.bisect_left(self.buckets, n)]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(attn_metadata.slot_mapping)
        self.input_ids[n:bs] = 0
        self.positions[n:bs] = 0
        self.slot_mapping[n:bs] = -1
        return self._forward(bs, n, attn_metadata)[:n]

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        # largest bucket first, so smaller ones reuse its memory; with LoRA each bucket twice
        variants = graph_variants(self.lora_batch)
        for bs, lora in itertools.product(reversed(self.buckets), variants):
            with capturing(self.lora_batch, lora):
                for _ in range(2):  # warm up: compile kernels, settle the allocator
                    self._forward(bs, bs, None)
                torch.cuda.synchronize()
                x, residual = self.input_ids[:bs], None
                for i in range(len(self.attns) + 1):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        # `residual` (piece i-1's output) is held until this capture is done
                        outs = self.decoder.piece(i, x, residual, self.positions[:bs],
                                                  self.slot_mapping[:bs])
                    pool = graph.pool()
                    self.graphs[bs, i, lora] = graph
                    self.outputs[bs, i, lora] = tuple(None if t is None else weak_view(t)
                                                      for t in outs)
                    x, residual = self.attn_out[:bs], outs[1]
            del outs, residual
        torch.cuda.synchronize()
        logger.info("captured piecewise CUDA graphs (%d pieces) for token counts %s",
                    len(self.attns) + 1, self.buckets)
