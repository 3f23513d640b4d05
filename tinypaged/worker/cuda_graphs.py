"""CUDA graphs for pure-decode steps: one capture per batch-size bucket, replayed with padding.

A decode step of a small model is ~6 kernel launches per layer; from Python each costs several
microseconds of CPU, more than the GPU work itself. A captured graph replays all of them with one
launch. Graphs need fixed shapes and addresses, so every bucket reads its inputs from the front of
two static device buffers, laid out for that bucket's size bs (mb = max_blocks_per_seq):

    ids64 [4 * bs] int64:      input_ids | positions | slot_mapping | prev_sample_indices
    ids32 [bs + bs * mb] int32: seq_lens | block_tables [bs, mb]

and query_start_loc = 0..max_bs. Each region is contiguous, so a step's inputs travel from two
pinned host buffers of the same layout in two plain copies: no copy kernels, and no pageable
staging that would make the host wait for the copy (a strided or pageable source does).

The runner's StepInput of B decodes (the same arrays an eager step reads) fills the first B
entries of each field; entries B..bs-1 are padding: slot -1 (no KV store), seq_len 1 over the
first block their row names, and their logits are dropped. Attention is captured with
`max_seq_len = max_model_len` so its split count does not depend on the live batch. Graphs
of verification steps (q = k + 1 tokens a sequence) run their attention through the split-KV
decode kernel where that pays, so that a batch of one or a few sequences keeps every SM
streaming K/V: TINYPAGED_SPEC_DECODE_ATTENTION=auto (the default) captures buckets of up to
MULTI_QUERY_MAX_SEQS sequences as a uniform decode (the kernel's multi-query mode, each
sequence's K/V read once for its q tokens) and larger ones through the varlen kernel, which has
programs enough by then; =multi_query, =varlen or =decodes (B * q one-token decodes,
attention_metadata.as_decodes, each context read q times) take one way for every bucket. The
graph begins with the
placeholders' gather from the runner's `sampled_ids` (async scheduling), so a replay reads the
previous step's samples where that step left them.

With enable_lora each bucket is captured twice, with the LoRA kernels and without, and a step in
which no sequence has an adapter replays the graph without them (lora/idle.py says why this
way and what it costs).

A step behind a verification in flight (speculative decoding, overlapped: input_batch.py) has its
rows moved in the static inputs after the copies, before the replay (kernels/spec_shift.py).

The pinned buffers come in two sets used in turn: under async scheduling the host stages step
N+1 while step N's copy may still be queued behind the GPU's work (step N-1 has been processed by
then, so the set it used has been read).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import logging

import torch

from tinypaged import envs
from tinypaged.lora.idle import capturing, graph_variants, replay_variant
from tinypaged.models.attention_metadata import AttentionMetadata, as_decodes
from tinypaged.worker.input_batch import StepInput, gather_input_ids

logger = logging.getLogger(__name__)

# TINYPAGED_SPEC_DECODE_ATTENTION=auto: the largest verification bucket whose attention runs as
# the multi-query decode. On an H200 (benchmarks/spec_attention.py, k = 4) it beat the varlen
# kernel at 1 and 8 sequences for every context and lost at 32, where the varlen kernel has a
# program per query block and KV head enough to fill the GPU without splits to merge.
MULTI_QUERY_MAX_SEQS = 16


def verification_attention(setting: str | None, batch_size: int) -> str | None:
    """The attention mode of a verification graph of `batch_size` sequences under the setting
    (None: a graph of one token a sequence, the plain decode)."""
    if setting == "auto":
        return "multi_query" if batch_size <= MULTI_QUERY_MAX_SEQS else "varlen"
    return setting



def batch_size_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_num_seqs (as vLLM does)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class _Fields:
    """One bucket's layout (bs rows, mb blocks per row) as views of an ids64 / ids32 pair: torch
    tensors on the device, numpy arrays over the pinned host buffers."""

    def __init__(self, ids64, ids32, bs: int, mb: int, q: int = 1) -> None:
        self.q = q  # tokens per sequence (k + 1 for speculative verification)
        self.ids64, self.ids32 = ids64[: 4 * bs * q], ids32[: bs * (1 + mb)]
        rows = self.ids64.reshape(4, bs * q)
        self.input_ids, self.positions, self.slot_mapping, self.prev_sample_indices = rows
        self.seq_lens = self.ids32[:bs]
        self.block_tables = self.ids32[bs:].reshape(bs, mb)

    def fill(self, step: StepInput, b: int) -> None:
        """Rows 0..b-1 take a step's arrays; rows b.. become padding."""
        t = b * self.q
        self.input_ids[:t] = step.input_ids
        self.positions[:t] = step.positions
        self.slot_mapping[:t] = step.slot_mapping
        prev = step.prev_sample_indices
        self.prev_sample_indices[:t] = -1 if prev is None else prev
        self.seq_lens[:b] = step.seq_lens
        width = step.block_tables.shape[1]
        self.block_tables[:b, :width] = step.block_tables
        self.block_tables[:b, width:] = 0
        self.pad(b)

    def pad(self, start: int) -> None:
        """Rows start.. store nothing (slot -1), attend to q ignored keys, read no sample."""
        t = start * self.q
        self.input_ids[t:] = 0
        self.positions[t:] = 0
        self.slot_mapping[t:] = -1
        self.prev_sample_indices[t:] = -1
        self.seq_lens[start:] = self.q
        self.block_tables[start:] = 0


class DecodeGraphs:
    """`q` > 1: graphs of speculative verification steps, every sequence with q = k + 1 new
    tokens (rows b*q .. b*q + q - 1 of the flat arrays), for batches up to `max_batch_size`;
    `run` then returns the logits of all B*q rows."""

    def __init__(self, runner, q: int = 1, max_batch_size: int | None = None):
        self.runner = runner
        self.q = q
        self.buckets = batch_size_buckets(min(runner.config.max_num_seqs,
                                              max_batch_size or runner.config.max_num_seqs))
        max_bs, mb = self.buckets[-1], runner.max_blocks_per_seq
        self.mb = mb
        dev = runner.device
        self.ids64 = torch.zeros(4 * max_bs * q, dtype=torch.int64, device=dev)
        self.ids32 = torch.zeros(max_bs * (1 + mb), dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=dev) * q
        self.staging = [
            (torch.zeros(4 * max_bs * q, dtype=torch.int64).pin_memory(),
             torch.zeros(max_bs * (1 + mb), dtype=torch.int32).pin_memory())
            for _ in range(2)
        ]
        self.num_runs = 0
        self.host_fields: dict[tuple[int, int], _Fields] = {}  # (set, bs) -> numpy views
        self.device_fields: dict[int, _Fields] = {}  # bs -> the static inputs' views
        # the LoRA slots' step state (None without enable_lora): graphs are keyed by
        # (bs, run_lora), a step replays the one of its own run_lora (lora/idle.py)
        runtime = getattr(runner, "lora", None)
        self.lora_batch = None if runtime is None else runtime.batch
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, bool], torch.Tensor] = {}
        # the EAGLE / MTP heads' hidden states
        self.aux: dict[tuple[int, bool], torch.Tensor | None] = {}
        # auto, multi_query, decodes or varlen (q > 1 only), read once: the capture fixes it
        self.attention = envs.TINYPAGED_SPEC_DECODE_ATTENTION if q > 1 else None
        self._capture()

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.buckets[-1]

    @torch.inference_mode()
    def _capture(self) -> None:
        model = self.runner.model
        pool = None
        # largest bucket first, so smaller ones reuse its memory; with LoRA each bucket twice
        variants = graph_variants(self.lora_batch)
        for bs, lora in itertools.product(reversed(self.buckets), variants):
            f = _Fields(self.ids64, self.ids32, bs, self.mb, self.q)
            f.pad(0)
            with capturing(self.lora_batch, lora):
                for _ in range(2):  # warm up: compile kernels, settle the allocator
                    self._forward(f, bs)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[bs, lora] = self._forward(f, bs)
            self.aux[bs, lora] = getattr(model, "aux_hidden_states", None)  # None: none kept
            pool = graph.pool()
            self.graphs[bs, lora] = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s%s", self.buckets,
                    f" ({self.q} tokens per sequence)" if self.q > 1 else "")

    def _forward(self, f: _Fields, bs: int) -> torch.Tensor:
        """What bucket bs's graph holds: the placeholders' gather, the forward and the logits
        [bs * q, vocab]."""
        model = self.runner.model
        input_ids = gather_input_ids(f.input_ids, f.prev_sample_indices, self.runner.sampled_ids)
        return model.compute_logits(model(input_ids, f.positions, self._metadata(f, bs)))

    def _metadata(self, f: _Fields, bs: int) -> AttentionMetadata:
        """The attention's view of bucket bs; with q > 1 (verification) as
        verification_attention picks it: a uniform decode (multi_query), the varlen batch
        (varlen) or bs * q one-token decodes built in the graph (decodes, as_decodes)."""
        mode = verification_attention(self.attention, bs)
        md = AttentionMetadata(
            slot_mapping=f.slot_mapping, query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=f.seq_lens, block_tables=f.block_tables, max_query_len=self.q,
            max_seq_len=self.runner.max_model_len,
            uniform_decode=mode == "multi_query",
        )
        return as_decodes(md, self.q) if mode == "decodes" else md

    def run(self, step: StepInput) -> torch.Tensor:
        """Replay the bucket that fits a decode step of B sequences (its graph with or without
        the LoRA kernels, as the step's adapters ask); returns logits [B, vocab]
        (the graph's own output buffer, overwritten by the next replay: stream order keeps the
        sampler's reads of it before that).

        The inputs are staged in the bucket's layout in one pinned set, padding rows B..bs-1
        are added, and the set travels to the static inputs in two copies."""
        b = len(step.seq_lens)
        bs = self.buckets[bisect.bisect_left(self.buckets, b)]
        which = self.num_runs % 2
        self.num_runs += 1
        host64, host32 = self.staging[which]
        stage = self.host_fields.get((which, bs))
        if stage is None:
            stage = _Fields(host64.numpy(), host32.numpy(), bs, self.mb, self.q)
            self.host_fields[which, bs] = stage
        stage.fill(step, b)
        n64 = 4 * bs * self.q
        self.ids64[:n64].copy_(host64[:n64], non_blocking=True)
        self.ids32[: len(stage.ids32)].copy_(host32[: len(stage.ids32)], non_blocking=True)
        if step.verify_rows is not None:  # behind a verification in flight: move its rows
            f = self.device_fields.get(bs)
            if f is None:
                f = self.device_fields[bs] = _Fields(self.ids64, self.ids32, bs, self.mb, self.q)
            md = AttentionMetadata(f.slot_mapping, self.query_start_loc[: b + 1], f.seq_lens,
                                   f.block_tables, self.q, self.runner.max_model_len)
            self.runner.shift(step, f.input_ids, f.positions, md)
        key = bs, replay_variant(self.lora_batch)
        self.graphs[key].replay()
        if self.aux[key] is not None:  # the rows of this step, as an eager forward keeps them
            self.runner.model.aux_hidden_states = self.aux[key][: b * self.q]
        return self.logits[key][: b * self.q]


class HeadStepGraphs:
    """CUDA graphs of a draft head's drafting step (spec_decode/head_proposer.py: after draft 1,
    each further draft is one head step of one token per sequence, fed the features [B, hidden]
    of the step before). One graph per batch-size bucket, as DecodeGraphs: the bucket's inputs
    are the front of static buffers in _Fields' layout (no placeholders: the head's input ids
    are on the host) plus `features` [max_bs, hidden]; the graph writes the head's outputs
    (logits [bs, draft_vocab], next features [bs, hidden]). Padding rows store nothing and
    attend to one key of block 0; attention is captured with `max_seq_len` (the longest a twin
    gets), so its split count does not depend on the live batch.

    One pinned staging set is enough: the proposer reads each step's drafts on the host before
    it stages the next. `capture=False` runs the same padded fixed-shape forward eagerly in place
    of a replay, which is how the CPU tests check the layout and the padding."""

    @torch.inference_mode()
    def __init__(self, head, max_batch_size: int, max_blocks_per_seq: int, block_size: int,
                 hidden_size: int, device: torch.device, dtype: torch.dtype,
                 capture: bool = True) -> None:
        self.head = head
        self.buckets = batch_size_buckets(max_batch_size)
        max_bs, self.mb = self.buckets[-1], max_blocks_per_seq
        self.max_seq_len = max_blocks_per_seq * block_size
        self.ids64 = torch.zeros(4 * max_bs, dtype=torch.int64, device=device)
        self.ids32 = torch.zeros(max_bs * (1 + self.mb), dtype=torch.int32, device=device)
        self.features = torch.zeros(max_bs, hidden_size, dtype=dtype, device=device)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(max_bs, device=device)  # every row's logits (padding dropped)
        pin = device.type == "cuda"
        self.host64 = torch.zeros(4 * max_bs, dtype=torch.int64, pin_memory=pin)
        self.host32 = torch.zeros(max_bs * (1 + self.mb), dtype=torch.int32, pin_memory=pin)
        self.host_fields: dict[int, _Fields] = {}
        self.num_replays = 0
        self.replays = {}  # bs -> () -> (logits [bs, draft_vocab], features [bs, hidden])
        pool = None
        for bs in reversed(self.buckets):  # largest first, so smaller ones reuse its memory
            fields = _Fields(self.ids64, self.ids32, bs, self.mb)
            fields.pad(0)
            forward = functools.partial(self._forward, fields, bs)
            if not capture:
                self.replays[bs] = forward
                continue
            for _ in range(2):  # warm up: compile kernels, settle the allocator
                forward()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs = forward()
            pool = graph.pool()
            self.replays[bs] = functools.partial(_replay, graph, outputs)
        if capture:
            torch.cuda.synchronize()
            logger.info("captured CUDA graphs of the draft head's steps for batch sizes %s",
                        self.buckets)

    def _forward(self, f: _Fields, bs: int):
        md = AttentionMetadata(
            slot_mapping=f.slot_mapping, query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=f.seq_lens, block_tables=f.block_tables, max_query_len=1,
            max_seq_len=self.max_seq_len,
        )
        return self.head(f.input_ids, f.positions, md, self.features[:bs], self.rows[:bs])

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.buckets[-1]

    def run(self, step: StepInput, features: torch.Tensor):
        """A drafting step of B sequences (features [B, hidden]) -> (logits [B, draft_vocab],
        next features [B, hidden]): views of the bucket's static outputs, overwritten by the
        next replay."""
        b = len(step.seq_lens)
        bs = self.buckets[bisect.bisect_left(self.buckets, b)]
        stage = self.host_fields.get(bs)
        if stage is None:
            stage = self.host_fields[bs] = _Fields(self.host64.numpy(), self.host32.numpy(),
                                                   bs, self.mb)
        stage.fill(step, b)
        n32 = len(stage.ids32)
        self.ids64[: 4 * bs].copy_(self.host64[: 4 * bs], non_blocking=True)
        self.ids32[:n32].copy_(self.host32[:n32], non_blocking=True)
        self.features[:b].copy_(features)
        logits, hidden = self.replays[bs]()
        self.num_replays += 1
        return logits[:b], hidden[:b]


def _replay(graph: torch.cuda.CUDAGraph, outputs):
    graph.replay()
    return outputs
