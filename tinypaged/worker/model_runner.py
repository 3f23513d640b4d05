"""ModelRunner: runs one step's flat batch through the model and returns the logits.

`build_step(scheduled)` turns the scheduler's choice into a StepInput (input_batch.py: the flat
arrays, no padding) and `execute(step)` runs it: one pinned, non-blocking host-to-device copy of
the arrays, then the model. Pure-decode batches replay a CUDA graph captured for the nearest
batch-size bucket (see `cuda_graphs.py`); with cudagraph_mode FULL_AND_PIECEWISE a batch of up
to 512 tokens with prompt tokens replays graphs of the pieces between its attentions, which run
eagerly (`piecewise_graphs.py`); every other batch runs eagerly. `config.kernels`
decides, for the duration of each forward, who runs the ops (kernels/_triton.py).

Under tensor parallelism every rank has its own ModelRunner (its shard, the KV cache of its heads,
its graphs); rank 0 builds each step's arrays once and every rank executes them, so all ranks see
the same block tables (executor.py).

After the engine samples, `keep_sampled(sampled)` keeps the step's sampled ids on the device, in
`sampled_ids [max_num_seqs]`, where the next step's placeholders read their input ids (async
scheduling; under tensor parallelism rank 0 broadcasts the buffer to every rank in stream order,
so no worker ever waits on the host), and starts their copy to the host: a non-blocking copy into
a pinned buffer and a CUDA event, which `SampledTokens.tolist()` waits for. A verification's
emitted tokens are kept the same way (`keep_verified`; under tensor parallelism broadcast from
rank 0 after the steps whose StepInput says so): a step built before they are known moves its
rows to them on the device (input_batch.py, kernels/spec_shift.py).

The KV cache is allocated once: on the GPU from `gpu_memory_utilization` after a profiling forward
pass at the largest batch (gpu_memory.py), on the CPU from `cpu_kv_cache_space` GiB, or
`num_kv_blocks` if given.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

from tinypaged.config import EngineConfig
from tinypaged.distributed import parallel_state as distributed
from tinypaged.kernels._triton import kernel_choice
from tinypaged.kernels.kv_cache import kv_cache_torch_dtype
from tinypaged.kernels.spec_shift import shift_to_verified
from tinypaged.lora.slots import LoRAStep, lora_runtime
from tinypaged.models.attention_metadata import AttentionMetadata
from tinypaged.models.layers import Attention
from tinypaged.scheduler import ScheduledSequence, Sequence
from tinypaged.worker import gpu_memory
from tinypaged.worker.input_batch import (
    HostBlockTables,
    StepInput,
    build_step,
    gather_input_ids,
    sample_rows,
)

logger = logging.getLogger(__name__)


@dataclass
class KVCacheInfo:
    num_blocks: int
    block_size: int
    bytes: int
    dtype: torch.dtype
    device: torch.device

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def as_dict(self) -> dict:
        return {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "num_tokens": self.num_tokens,
            "bytes": self.bytes,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
        }


# The largest batch of verification steps (k + 1 tokens a sequence) captured as full graphs.
SPEC_GRAPH_MAX_SEQS = 32


def no_graphs_reason(config: EngineConfig) -> str | None:
    """Why a GPU engine runs every step eagerly, or None when it captures CUDA graphs."""
    if config.enforce_eager:
        return "enforce_eager"
    if config.kernels == "torch":
        # e.g. store_kv_ref selects the slots to write with a boolean mask: a host sync
        return "kernels='torch' runs the torch references, which read values on the host"
    return None


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model: torch.nn.Module, device: torch.device,
        dtype: torch.dtype, free_at_start: int | None = None,  # free GPU bytes before the weights
    ):
        self.config = config
        self.free_at_start = free_at_start
        self.model = model
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, dtype)  # FP8: half the bytes
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.pin = device.type == "cuda"
        self.kernels = kernel_choice(config.kernels)
        # One inference-mode context, entered by every execute: the decorator form builds a new
        # one per call, host time that under speculation the GPU waits for.
        self.inference_mode = torch.inference_mode()
        if config.kernels == "triton" and device.type != "cuda" and dtype == torch.bfloat16:
            raise ValueError(
                "kernels='triton' on the CPU runs the Triton interpreter, which computes bfloat16 "
                "wrongly (it holds bf16 as raw integer bits); use dtype float32 or float16"
            )
        self.block_tables = HostBlockTables(config.max_num_seqs, self.max_blocks_per_seq)
        self.async_scheduling = bool(config.async_scheduling)
        self.prev_sample_rows: dict[int, int] | None = None  # seq_id -> row of sampled_ids
        self.sampled_ids = torch.zeros(config.max_num_seqs, dtype=torch.int64, device=device)
        self.broadcast_sampled = self.async_scheduling and distributed.get_tp_size() > 1
        # Two pinned landing buffers: step N's ids arrive in one while N+1's are on the way.
        self.host_ids = [torch.zeros(config.max_num_seqs, dtype=torch.int64, pin_memory=self.pin)
                         for _ in range(2 if self.pin else 0)]
        self.num_kept = 0
        # Overlapped verification (spec_decode/decoder.py turns it on: `start_overlap`): the
        # last verification's emitted tokens [S, K + 1] (device; under tensor parallelism a
        # buffer [max_num_seqs, k + 1] that rank 0 broadcasts) and, for the step after it, each
        # sampled sequence's count of tokens assumed emitted.
        self.overlap = False
        self.verified: torch.Tensor | None = None
        self.verified_width = 0  # k + 1 under tensor parallelism, else 0
        self.prev_assumed: dict[int, int] | None = None
        self.lora = lora_runtime(config, model, dtype, device)  # None without enable_lora
        self.graphs = None  # eager while profiling; captured after the cache exists
        self.piecewise = None  # piecewise graphs of steps with prompt tokens (optional)
        self.spec_graphs = None  # full graphs of k+1-token verification steps (optional)
        self.kv_cache_info = self._allocate_kv_cache()
        if device.type == "cuda":
            self._warm_up()
        if device.type == "cuda" and (reason := no_graphs_reason(config)):
            logger.info("CUDA graphs off: %s", reason)
        elif device.type == "cuda":
            from tinypaged.worker.cuda_graphs import DecodeGraphs

            with self.kernels:
                self.graphs = DecodeGraphs(self)
                self.piecewise = self._piecewise_graphs()
                self.spec_graphs = self._spec_graphs(DecodeGraphs)

    def _spec_graphs(self, graphs_class):
        """Full graphs of speculative verification steps (k + 1 tokens for every sequence), for
        batches up to SPEC_GRAPH_MAX_SEQS; None without speculation, or when the capture fails
        (such steps then replay the piecewise graphs, or run eagerly)."""
        spec = self.config.speculative_config
        if not spec or not isinstance(spec.get("num_speculative_tokens"), int):
            return None
        try:
            return graphs_class(self, spec["num_speculative_tokens"] + 1,
                                max_batch_size=SPEC_GRAPH_MAX_SEQS)
        except Exception:
            logger.exception("speculative decoding: capturing k+1-token CUDA graphs failed")
            return None

    def _piecewise_graphs(self):
        from tinypaged.worker.piecewise_graphs import (
            PiecewiseGraphs,
            piecewise_unsupported,
            token_buckets,
        )

        buckets = token_buckets(self.config.max_num_batched_tokens)
        if self.config.cudagraph_mode != "FULL_AND_PIECEWISE" or not buckets:
            return None
        if reason := piecewise_unsupported(self.model):
            logger.info("piecewise CUDA graphs: not for %s (%s); its prompt steps run eagerly",
                        type(self.model).__name__, reason)
            return None
        return PiecewiseGraphs(self.model, buckets, self.device, self.dtype,
                               lora_batch=None if self.lora is None else self.lora.batch)

    def release_graphs(self) -> None:
        """Drop the captured graphs (decode and piecewise) and their memory pools; later steps
        run eagerly. Under tensor parallelism every rank must do this before leaving the
        process group: NCCL can neither destroy nor abort a communicator that a live CUDA
        graph holds (a captured all-reduce), and waits forever (seen on 2 x H200, torch 2.11)."""
        if self.graphs is None:
            return
        self.graphs = self.piecewise = self.spec_graphs = None
        gc.unfreeze()  # a serving process froze its heap, the graphs with it (gc_freeze.py)
        gc.collect()  # DecodeGraphs and the runner reference each other
        torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ KV cache

    def _block_bytes(self) -> int:
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        per_token = 2 * len(self.attn_layers) * self.model.num_kv_heads * self.model.head_dim * elem
        return per_token * self.block_size

    def _num_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type != "cuda":
            return max(1, int(self.config.cpu_kv_cache_space * 2**30) // self._block_bytes())
        # Profile the largest prefill the scheduler may send, then give the KV cache what is left.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_forward()
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        peak_extra = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(
            self.device
        )
        memory = (total, free, self.free_at_start, self.config.gpu_memory_utilization, peak_extra)
        num_blocks = int(gpu_memory.kv_cache_budget(*memory)) // self._block_bytes()
        if num_blocks < 1:
            raise RuntimeError(gpu_memory.no_kv_memory_message(*memory))
        return num_blocks

    def _profile_forward(self) -> None:
        """Run one forward over max_num_batched_tokens dummy tokens with a tiny scratch cache."""
        num_tokens = min(self.config.max_num_batched_tokens, self.max_model_len * 4)
        seq_len = min(num_tokens, self.max_model_len)
        num_seqs = -(-num_tokens // seq_len)
        blocks_per_seq = -(-seq_len // self.block_size)
        self._set_caches(num_seqs * blocks_per_seq)
        blocks = range(num_seqs * blocks_per_seq)
        batch = [_dummy_prefill(seq_len, blocks[i * blocks_per_seq : (i + 1) * blocks_per_seq])
                 for i in range(num_seqs)]
        self.execute(self._dummy_step(batch))
        self._set_caches(0)

    def _warm_up(self) -> None:
        """Compile every attention variant a live batch can pick (the query tile shrinks for
        short queries) now, so that no request waits 1-2 s for Triton in the middle of serving.
        Runs before any sequence owns a block, so the cache rows it writes are free."""
        layer = self.attn_layers[0]
        group = layer.num_heads // layer.num_kv_heads
        for q_len in sorted({1, 2, max(2, 64 // group), 128}):
            q_len = min(q_len, self.max_model_len)
            blocks = range(-(-q_len // self.block_size))
            if len(blocks) <= self.kv_cache_info.num_blocks:
                self.execute(self._dummy_step([_dummy_prefill(q_len, blocks)]))
        if self.lora is not None:  # no token on a slot again: the graphs' captures run over that
            self.lora.prepare(None)
        if (self.config.speculative_config is not None and self.async_scheduling
                and distributed.get_tp_rank() > 0):  # verifications may overlap (start_overlap)
            self._compile_shift()
        torch.cuda.synchronize(self.device)

    def _dummy_step(self, batch: list[ScheduledSequence]) -> StepInput:
        """The step of the profiling forward or a warm-up; with enable_lora every token runs
        slot 0 (zeros: no adapter is loaded yet), so that the LoRA kernels are compiled and
        their memory profiled too (a step with no adapter runs none: lora/idle.py)."""
        step = self.build_step(batch)
        if self.lora is not None:
            step.lora = LoRAStep(np.zeros(len(step.input_ids), np.int32))
        return step

    def _set_caches(self, num_blocks: int) -> int:
        shape = (num_blocks, self.block_size, self.model.num_kv_heads, self.model.head_dim)
        for layer in self.attn_layers:
            layer.k_cache = torch.empty(shape, dtype=self.kv_dtype, device=self.device)
            layer.v_cache = torch.empty(shape, dtype=self.kv_dtype, device=self.device)
        return num_blocks * self._block_bytes()

    def _allocate_kv_cache(self) -> KVCacheInfo:
        # Tensor-parallel ranks share the block tables: every rank takes the smallest cache.
        num_blocks = distributed.min_over_ranks(self._num_blocks())
        nbytes = self._set_caches(num_blocks)
        return KVCacheInfo(num_blocks, self.block_size, nbytes, self.kv_dtype, self.device)

    # ------------------------------------------------------------------ batch building

    def build_step(
        self, scheduled: Seq[ScheduledSequence], prompt_logits: Seq[bool] | None = None
    ) -> StepInput:
        """The flat batch of one scheduled step as host arrays (input_batch.build_step)."""
        step = build_step(scheduled, self.block_size, self.block_tables, prompt_logits,
                          self.prev_sample_rows, self.prev_assumed)
        if self.lora is not None:
            step.lora = self.lora.plan([it.seq.lora_request for it in scheduled],
                                       [it.num_new_tokens for it in scheduled])
        if self.async_scheduling:  # where the next step finds each sequence's sampled id
            self.prev_sample_rows = sample_rows(scheduled)
            if self.overlap:  # a verification: a sequence may emit up to 1 + its drafts
                self.prev_assumed = {it.seq.seq_id: 1 + len(it.spec_token_ids)
                                     for it in scheduled if it.sample}
                if self.prev_assumed:  # the decoder keeps its tokens (keep_verified)
                    step.broadcast_verified = self.verified_width
        return step

    def start_overlap(self, k: int) -> None:
        """Build each later step behind a verification in flight (of up to k drafts a
        sequence) as the speculative decoder assumes (all its drafts accepted) and move its rows
        on the device once that one's tokens are known (`shift`). The move runs outside the
        graphs; its kernel is compiled here (workers: in the warm-up), not mid-serving."""
        self.overlap = True
        if distributed.get_tp_size() > 1:  # the tokens go to the workers in a fixed buffer
            self.verified_width = k + 1
        self._compile_shift()

    def _compile_shift(self) -> None:
        if self.device.type == "cuda":
            none = torch.full((1,), -1, dtype=torch.int64, device=self.device)  # moves nothing
            ids32 = torch.zeros(2, dtype=torch.int32, device=self.device)
            shift_to_verified(none[None], none, none, ids32, ids32[None], self.block_size,
                              none.clone(), none.clone(), none.clone(), ids32.clone())
            torch.cuda.synchronize(self.device)

    def keep_verified(self, emitted: torch.Tensor | None, width: int = 0) -> None:
        """Keep a verification's emitted tokens [S, K + 1] (device, -1 padded) for the step
        built before they are known (`shift`). Under tensor parallelism every rank calls it
        after such a step (its StepInput's broadcast_verified is the width), the workers with
        None: rank 0 broadcasts them in a buffer [max_num_seqs, width], -1 past its own."""
        width = width or self.verified_width
        if not width:
            self.verified = emitted
            return
        if self.verified is None or self.verified.shape[1] != width:
            self.verified = torch.empty(self.config.max_num_seqs, width, dtype=torch.int64,
                                        device=self.device)
        if emitted is not None:
            self.verified.fill_(-1)
            self.verified[: emitted.shape[0], : emitted.shape[1]].copy_(emitted)
        distributed.broadcast_from_rank0(self.verified)

    def shift(self, step: StepInput, input_ids: torch.Tensor, positions: torch.Tensor,
              md: AttentionMetadata) -> None:
        """Move the rows of the sequences behind a verification in flight (device tensors of
        the step, in place; kernels/spec_shift.py)."""
        to = self._to_device
        shift_to_verified(self.verified, to(step.verify_rows), to(step.verify_assumed),
                          md.query_start_loc, md.block_tables, self.block_size, input_ids,
                          positions, md.slot_mapping, md.seq_lens)

    def keep_sampled(self, sampled: torch.Tensor | None) -> SampledTokens | None:
        """Keep a step's sampled ids [S] on the device for the next step's placeholders and
        start their copy to the host (None when the step sampled nothing). Under tensor
        parallelism with async scheduling every rank calls it after every step, the workers
        with None: rank 0 broadcasts the ids."""
        if sampled is not None:
            self.sampled_ids[: len(sampled)].copy_(sampled, non_blocking=True)
        if self.broadcast_sampled:
            distributed.broadcast_from_rank0(self.sampled_ids)
        if sampled is None:
            return None
        num = len(sampled)
        if not self.pin:  # CPU: the ids are on the host already
            return SampledTokens(self.sampled_ids[:num].clone(), None)
        host = self.host_ids[self.num_kept % 2][:num]
        self.num_kept += 1
        host.copy_(self.sampled_ids[:num], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return SampledTokens(host, event)

    def _device_inputs(
        self, step: StepInput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        to = self._to_device
        md = AttentionMetadata(
            slot_mapping=to(step.slot_mapping),
            query_start_loc=to(step.query_start_loc),
            seq_lens=to(step.seq_lens),
            block_tables=to(step.block_tables),
            max_query_len=step.max_query_len,
            max_seq_len=step.max_seq_len,
        )
        input_ids, positions = to(step.input_ids), to(step.positions)
        if step.prev_sample_indices is not None:
            input_ids = gather_input_ids(input_ids, to(step.prev_sample_indices), self.sampled_ids)
        if step.verify_rows is not None:
            self.shift(step, input_ids, positions, md)
        return input_ids, positions, md, to(step.logits_indices)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(array)
        if self.pin:
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ execution

    def execute(self, step: StepInput) -> torch.Tensor:
        """Run one step; returns logits [S, vocab] (the model's dtype) of the rows in
        `step.logits_indices` (on every tensor-parallel rank the same arrays, so the
        collectives line up)."""
        with self.inference_mode, self.kernels:
            if self.lora is not None:
                self.lora.prepare(step.lora)
            num_seqs = len(step.seq_lens)
            if self.graphs is not None and step.max_query_len == 1 and self.graphs.fits(num_seqs):
                logits = self.graphs.run(step)  # [B, vocab]: all B rows ran
                if len(step.logits_indices) == num_seqs:  # every row, in order: a decode
                    return logits
                # Never index with the numpy array itself: torch would copy it to the device
                # from pageable memory and wait for the GPU to finish the step.
                return logits[self._to_device(step.logits_indices)]
            spec = self.spec_graphs
            if (spec is not None and step.max_query_len == spec.q and spec.fits(num_seqs)
                    and len(step.input_ids) == len(step.logits_indices) == num_seqs * spec.q):
                return spec.run(step)  # every sequence verifies k drafts: all its rows' logits
            input_ids, positions, md, logits_indices = self._device_inputs(step)
            if self.piecewise is not None and self.piecewise.fits(len(step.input_ids)):
                hidden = self.piecewise.run(input_ids, positions, md)  # [T, hidden]
            else:
                hidden = self.model(input_ids, positions, md)  # [T, hidden]
            return self.model.compute_logits(hidden[logits_indices])


class SampledTokens:
    """One step's sampled ids on their way to the host: `tolist()` waits for them."""

    def __init__(self, host: torch.Tensor, event: torch.cuda.Event | None) -> None:
        self.host, self.event = host, event  # host: [S] int64, pinned on CUDA

    def tolist(self) -> list[int]:
        # query() keeps the GIL; synchronize() drops and takes it again, which costs a thread
        # switch when another thread (the grammar worker) waits for it
        if self.event is not None and not self.event.query():
            self.event.synchronize()
        return self.host.tolist()


def _dummy_prefill(num_tokens: int, blocks: Seq[int]) -> ScheduledSequence:
    """A whole-prompt step of `num_tokens` zeros in `blocks` (profiling and warm-up)."""
    seq = Sequence("profile", [0] * num_tokens)
    seq.block_table = list(blocks)
    return ScheduledSequence(seq, num_tokens, 0, sample=True)
