"""ModelRunner: turns a scheduled batch into flat tensors, runs the model, returns logits.

One step's batch is B sequences with `q_len[b]` new tokens each (T = sum q_len). The runner
builds, on the CPU and without per-token Python loops:

    input_ids[T], positions[T], slot_mapping[T]      one row per new token
    query_start_loc[B+1] = [0, cumsum(q_len)]        where each sequence's rows start
    seq_lens[B] = num_computed[b] + q_len[b]         whole context after this step
    block_tables[B, max_blocks]                       int32, padded with 0
    logits_indices[S]                                 rows whose logits are returned: the last
                                                      row of each sampled sequence, or every
                                                      row of one that asks for prompt logits

and copies them to the device in one pinned, non-blocking transfer. Pure-decode batches replay a
CUDA graph captured for the nearest batch-size bucket (see `cuda_graphs.py`).

Under tensor parallelism every rank has its own ModelRunner (its shard, the KV cache of its heads,
its graphs); rank 0 builds each step's arrays once (`build_step` -> StepInput) and every rank
runs them (`execute_step`), so all ranks see the same block tables (executor.py).

The KV cache is allocated once: on the GPU from `gpu_memory_utilization` after a profiling forward
pass at the largest batch, on the CPU from `cpu_kv_cache_space` GiB, or `num_kv_blocks` if given.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

from tinypaged import distributed
from tinypaged.config import EngineConfig
from tinypaged.models.batch import AttentionMetadata
from tinypaged.models.layers import Attention

logger = logging.getLogger(__name__)


@dataclass
class ScheduledSeq:
    """What the runner needs of one scheduled sequence (the scheduler's Sequence fits)."""

    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]


@dataclass
class StepInput:
    """One step's flat batch as host arrays (B sequences, T new tokens, S sampled rows)."""

    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]
    query_start_loc: np.ndarray  # int32 [B + 1]
    seq_lens: np.ndarray  # int32 [B]
    block_tables: np.ndarray  # int32 [B, max_blocks]
    logits_indices: np.ndarray  # int64 [S]
    max_query_len: int
    max_seq_len: int


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


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model: torch.nn.Module, device: torch.device, dtype: torch.dtype
    ):
        self.config = config
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.pin = device.type == "cuda"
        self.graphs = None  # eager while profiling; captured after the cache exists
        self.kv_cache_info = self._allocate_kv_cache()
        if device.type == "cuda":
            self._warm_up()
        if device.type == "cuda" and not config.enforce_eager:
            from tinypaged.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self)

    def release_graphs(self) -> None:
        """Drop the captured decode graphs and their memory pool; later steps run eagerly.
        Under tensor parallelism every rank must do this before leaving the process group: NCCL
        can neither destroy nor abort a communicator that a live CUDA graph holds (a captured
        all-reduce), and waits forever (seen on 2 x H200, torch 2.11)."""
        if self.graphs is None:
            return
        self.graphs = None
        gc.collect()  # DecodeGraphs and the runner reference each other
        torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ KV cache

    def _block_bytes(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
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
        budget = total * self.config.gpu_memory_utilization - (total - free) - peak_extra
        num_blocks = int(budget) // self._block_bytes()
        if num_blocks < 1:
            raise RuntimeError(
                f"no GPU memory left for the KV cache (budget {budget / 2**30:.2f} GiB); raise "
                "gpu_memory_utilization or lower max_num_batched_tokens"
            )
        return num_blocks

    def _profile_forward(self) -> None:
        """Run one forward over max_num_batched_tokens dummy tokens with a tiny scratch cache."""
        num_tokens = min(self.config.max_num_batched_tokens, self.max_model_len * 4)
        seq_len = min(num_tokens, self.max_model_len)
        num_seqs = -(-num_tokens // seq_len)
        blocks_per_seq = -(-seq_len // self.block_size)
        self._set_caches(num_seqs * blocks_per_seq)
        seqs = [
            ScheduledSeq(
                [0] * seq_len, 0, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
            )
            for i in range(num_seqs)
        ]
        with torch.inference_mode():
            self.execute(seqs, [seq_len] * num_seqs, [True] * num_seqs)
        self._set_caches(0)

    def _warm_up(self) -> None:
        """Compile every attention variant a live batch can pick (the query tile shrinks for
        short queries) now, so that no request waits 1-2 s for Triton in the middle of serving.
        Runs before any sequence owns a block, so the cache rows it writes are free."""
        layer = self.attn_layers[0]
        group = layer.num_heads // layer.num_kv_heads
        for q_len in sorted({1, 2, max(2, 64 // group), 128}):
            q_len = min(q_len, self.max_model_len)
            blocks = list(range(-(-q_len // self.block_size)))
            if len(blocks) <= self.kv_cache_info.num_blocks:
                self.execute([ScheduledSeq([0] * q_len, 0, blocks)], [q_len], [True])
        torch.cuda.synchronize(self.device)

    def _set_caches(self, num_blocks: int) -> int:
        shape = (num_blocks, self.block_size, self.model.num_kv_heads, self.model.head_dim)
        self.kv_caches = []
        for layer in self.attn_layers:
            layer.k_cache = torch.empty(shape, dtype=self.dtype, device=self.device)
            layer.v_cache = torch.empty(shape, dtype=self.dtype, device=self.device)
            self.kv_caches.append((layer.k_cache, layer.v_cache))
        return num_blocks * self._block_bytes()

    def _allocate_kv_cache(self) -> KVCacheInfo:
        # Tensor-parallel ranks share the block tables: every rank takes the smallest cache.
        num_blocks = distributed.min_over_ranks(self._num_blocks())
        nbytes = self._set_caches(num_blocks)
        return KVCacheInfo(num_blocks, self.block_size, nbytes, self.dtype, self.device)

    # ------------------------------------------------------------------ batch building

    def prepare(
        self,
        seqs: Seq[ScheduledSeq],
        num_new_tokens: Seq[int],
        do_sample: Seq[bool],
        prompt_logits: Seq[bool] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flatten the batch; returns (input_ids, positions, attn_metadata, logits_indices)."""
        return self._device_inputs(
            self.build_step(seqs, num_new_tokens, do_sample, prompt_logits)
        )

    def build_step(
        self,
        seqs: Seq[ScheduledSeq],
        num_new_tokens: Seq[int],
        do_sample: Seq[bool],
        prompt_logits: Seq[bool] | None = None,
    ) -> StepInput:
        """The flat batch as host arrays, without per-token Python loops.

        prompt_logits[b]: return the logits of every new row of sequence b (for prompt
        logprobs), its sampled row last, instead of only the sampled row."""
        bs = self.block_size
        q_lens = np.asarray(num_new_tokens, dtype=np.int64)  # [B]
        starts = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, len(seqs))  # [B]
        cu = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        total = int(cu[-1])
        seq_lens = starts + q_lens

        input_ids = np.empty(total, dtype=np.int64)
        for i, s in enumerate(seqs):
            input_ids[cu[i] : cu[i + 1]] = s.token_ids[starts[i] : seq_lens[i]]
        seq_idx = np.repeat(np.arange(len(seqs)), q_lens)  # [T]
        positions = np.arange(total) - cu[seq_idx] + starts[seq_idx]  # [T]

        width = int(-(-seq_lens.max() // bs))
        block_tables = np.zeros((len(seqs), width), dtype=np.int32)  # [B, max_blocks]
        for i, s in enumerate(seqs):
            n = min(len(s.block_table), width)
            block_tables[i, :n] = s.block_table[:n]
        slot_mapping = block_tables[seq_idx, positions // bs].astype(np.int64) * bs + positions % bs
        logits_indices = (cu[1:] - 1)[np.asarray(do_sample, dtype=bool)]
        if prompt_logits is not None and any(prompt_logits):  # rare: a loop is fine
            rows = [np.empty(0, dtype=np.int64)]
            for i, (every, sample) in enumerate(zip(prompt_logits, do_sample)):
                if every:
                    rows.append(np.arange(cu[i], cu[i + 1]))
                elif sample:
                    rows.append(cu[i + 1 : i + 2] - 1)
            logits_indices = np.concatenate(rows)
        return StepInput(
            input_ids, positions, slot_mapping, cu.astype(np.int32), seq_lens.astype(np.int32),
            block_tables, logits_indices, int(q_lens.max()), int(seq_lens.max()),
        )

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
        return to(step.input_ids), to(step.positions), md, to(step.logits_indices)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(array)
        if self.pin:
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ execution

    @torch.inference_mode()
    def execute(
        self,
        seqs: Seq[ScheduledSeq],
        num_new_tokens: Seq[int],
        do_sample: Seq[bool],
        prompt_logits: Seq[bool] | None = None,
    ) -> torch.Tensor:
        """Run one step; returns float32 logits [num_sampled, vocab] in `seqs` order (with
        `prompt_logits`, the rows `build_step` describes)."""
        graphable = max(num_new_tokens) == 1 and not (prompt_logits and any(prompt_logits))
        if self.graphs is not None and graphable and self.graphs.fits(len(seqs)):
            logits = self.graphs.run(seqs)
            return logits[np.flatnonzero(np.asarray(do_sample, dtype=bool))]
        input_ids, positions, md, logits_indices = self.prepare(
            seqs, num_new_tokens, do_sample, prompt_logits
        )
        hidden = self.model(input_ids, positions, md)  # [T, hidden]
        return self.model.compute_logits(hidden[logits_indices])

    @torch.inference_mode()
    def execute_step(self, step: StepInput) -> torch.Tensor:
        """Run one step given as arrays (the tensor-parallel path: the same on every rank);
        returns float32 logits [S, vocab] of the rows in `step.logits_indices`."""
        num_seqs = len(step.seq_lens)
        if self.graphs is not None and step.max_query_len == 1 and self.graphs.fits(num_seqs):
            return self.graphs.run_step(step)[step.logits_indices]
        input_ids, positions, md, logits_indices = self._device_inputs(step)
        hidden = self.model(input_ids, positions, md)  # [T, hidden]
        return self.model.compute_logits(hidden[logits_indices])
