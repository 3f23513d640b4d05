"""CUDA graphs for pure-decode steps: one capture per batch-size bucket, replayed with padding.

A decode step of a small model is ~6 kernel launches per layer; from Python each costs several
microseconds of CPU, more than the GPU work itself. A captured graph replays all of them with one
launch. Graphs need fixed shapes and addresses, so every bucket reads from the same static
buffers (sized for the largest bucket):

    input_ids[max_bs], prev_sample_indices[max_bs], positions[max_bs], slot_mapping[max_bs],
    seq_lens[max_bs], query_start_loc[max_bs + 1] = 0..max_bs,
    block_tables[max_bs, max_blocks_per_seq]

The runner's StepInput of B decodes (the same arrays an eager step reads) is copied into the first
B rows; rows B..bucket-1 are padding: slot -1 (no KV store), seq_len 1 over the first block their
row names, and their logits are dropped. Attention is captured with
`max_seq_len = max_model_len` so its split count does not depend on the live batch. The graph
begins with the placeholders' gather from the runner's `sampled_ids` (async scheduling), so a
replay reads the previous step's samples where that step left them.

The inputs travel through two pinned staging buffers used in turn: under async scheduling the
host stages step N+1 while step N's copy may still be queued behind the GPU's work.
"""

from __future__ import annotations

import bisect
import logging

import torch

from tinypaged.input_batch import StepInput, gather_input_ids
from tinypaged.models.batch import AttentionMetadata

logger = logging.getLogger(__name__)


def batch_size_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_num_seqs (as vLLM does)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    def __init__(self, runner):
        self.runner = runner
        self.buckets = batch_size_buckets(runner.config.max_num_seqs)
        max_bs = self.buckets[-1]
        dev = runner.device
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.prev_sample_indices = torch.full((max_bs,), -1, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(
            (max_bs, runner.max_blocks_per_seq), dtype=torch.int32, device=dev
        )
        # Pinned staging: all per-step inputs travel in a single host-to-device copy.
        shape = (5 + runner.max_blocks_per_seq, max_bs)
        self.staging = [torch.zeros(shape, dtype=torch.int64).pin_memory() for _ in range(2)]
        self.num_runs = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self._capture()

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.buckets[-1]

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            max_query_len=1,
            max_seq_len=self.runner.max_model_len,
        )

    @torch.inference_mode()
    def _capture(self) -> None:
        model = self.runner.model
        pool = None
        for bs in reversed(self.buckets):  # largest first, so smaller ones reuse its memory
            md = self._metadata(bs)
            for _ in range(2):  # warm up: compile kernels, settle the allocator
                model.compute_logits(model(self.input_ids[:bs], self.positions[:bs], md))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                input_ids = gather_input_ids(self.input_ids[:bs], self.prev_sample_indices[:bs],
                                             self.runner.sampled_ids)
                hidden = model(input_ids, self.positions[:bs], md)
                self.logits[bs] = model.compute_logits(hidden)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.buckets)

    def run(self, step: StepInput) -> torch.Tensor:
        """Replay the bucket that fits a decode step of B sequences; returns logits [B, vocab].

        The inputs are staged in columns 0..B-1 of one pinned buffer, padding rows B..bucket-1
        are added, and the whole buffer travels to the static inputs in one copy."""
        b = len(step.seq_lens)
        bs = self.buckets[bisect.bisect_left(self.buckets, b)]
        staging = self.staging[self.num_runs % 2]
        self.num_runs += 1
        # rows: ids, positions, slots, seq_lens, prev_sample_indices, block table...
        stage = staging.numpy()
        stage[0, :b] = step.input_ids
        stage[1, :b] = step.positions
        stage[2, :b] = step.slot_mapping
        stage[3, :b] = step.seq_lens
        stage[4, :b] = -1 if step.prev_sample_indices is None else step.prev_sample_indices
        stage[5 : 5 + step.block_tables.shape[1], :b] = step.block_tables.T
        stage[0:2, b:bs] = 0
        stage[2, b:bs] = -1  # padding rows store nothing and attend to one (ignored) key
        stage[3, b:bs] = 1
        stage[4, b:bs] = -1
        dev = staging[:, :bs].to(self.input_ids.device, non_blocking=True)
        self.input_ids[:bs] = dev[0]
        self.positions[:bs] = dev[1]
        self.slot_mapping[:bs] = dev[2]
        self.seq_lens[:bs] = dev[3]
        self.prev_sample_indices[:bs] = dev[4]
        self.block_tables[:bs] = dev[5:].T
        self.graphs[bs].replay()
        return self.logits[bs][:b]
