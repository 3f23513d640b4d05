"""The flat batch of one step: what the scheduler picked, as the arrays a forward pass reads.

One step's batch is B sequences with `q_len[b]` new tokens each (T = sum q_len, S of them
sampled). `build_step` makes, on the CPU and without per-token Python loops, a StepInput:

    input_ids[T], positions[T], slot_mapping[T]      one row per new token
    query_start_loc[B+1] = [0, cumsum(q_len)]        where each sequence's rows start
    seq_lens[B] = num_computed[b] + q_len[b]         whole context after this step
    block_tables[B, max_blocks]                       int32, 0 past each table
    logits_indices[S]                                 rows whose logits are returned: the
                                                      last row of each sampled sequence, or
                                                      every row of one that asks for prompt logits
    prev_sample_indices[T] or None                    under async scheduling: for a token not on
                                                      the host yet (a placeholder), its row in the
                                                      previous step's sampled ids, else -1
    verify_rows[B], verify_assumed[B] or None         speculative decoding, overlapped: for a
                                                      sequence whose verification is in flight,
                                                      its row in that step's emitted tokens and
                                                      the count assumed emitted, else -1 and 0

A placeholder's input id is gathered on the device (`gather_input_ids`), from the previous step's
sampled ids, which never come back to the host in between. Behind a verification in flight the
whole sequence moves on the device instead (kernels/spec_shift.py): its rows were placed as if
every draft were accepted, and the placeholder is the verification's last emitted token.

Eager steps, CUDA-graph replays and every tensor-parallel rank read the same StepInput, so the
slot of each token is computed here and nowhere else:

    slot_mapping[t] = block_tables[b, positions[t] // block_size] * block_size
                      + positions[t] % block_size                        (t a token of seq b)

Block tables change rarely (one new block every block_size tokens), so `HostBlockTables` keeps
the host copy from step to step and rewrites a row only when the sequence in it or the length of
its table changed: at batch 256 that saves ~256 list-to-array copies per step.
`python -m docs.walkthrough` prints a few steps of it.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tinypaged.scheduler import ScheduledSequence, Sequence


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
    prev_sample_indices: np.ndarray | None = None  # int64 [T], -1 = the id is in input_ids
    verify_rows: np.ndarray | None = None  # int64 [B], -1 = no verification in flight
    verify_assumed: np.ndarray | None = None  # int64 [B]: tokens it was assumed to emit
    # tensor parallelism, overlapped: after this step rank 0 broadcasts the tokens it emits in
    # a buffer of this width (ModelRunner.keep_verified); 0: not
    broadcast_verified: int = 0
    lora: Any = None  # lora.slots.LoRAStep: each token's adapter slot (None: no adapter)


def build_step(
    scheduled: Seq[ScheduledSequence], block_size: int, block_tables: HostBlockTables,
    prompt_logits: Seq[bool] | None = None, prev_sample_rows: Mapping[int, int] | None = None,
    prev_assumed: Mapping[int, int] | None = None,
) -> StepInput:
    """The flat batch of one scheduled step as host arrays (see the module docstring).

    prompt_logits[b]: return the logits of every new row of sequence b (for prompt logprobs),
    its sampled row last, instead of only the sampled row. prev_sample_rows[seq_id]: the row
    of each sequence sampled by the previous step, for the placeholders (async scheduling).
    prev_assumed[seq_id] (speculative decoding): that step was a verification, and a sequence
    with a placeholder was scheduled as if it emitted this many tokens."""
    bs = block_size
    num_seqs = len(scheduled)
    seqs = [it.seq for it in scheduled]
    # Per-sequence counts as Python ints first: their sums and maxima cost less there than as
    # numpy reductions, which take microseconds each on arrays this small.
    computed = list(map(_num_computed, scheduled))
    new = list(map(_num_new, scheduled))
    ends = list(map(operator.add, computed, new))  # seq_lens
    total, max_query_len, max_seq_len = sum(new), max(new), max(ends)
    starts = np.array(computed, np.int64)  # [B]
    q_lens = np.array(new, np.int64)  # [B]
    cu = np.zeros(num_seqs + 1, dtype=np.int64)  # [B + 1]
    np.add.accumulate(q_lens, out=cu[1:])
    # A placeholder (a token past the host's token_ids) is the one new token of its sequence.
    if total == num_seqs:  # one token each (decodes, mostly): no repeat, no per-seq slices
        seq_idx = np.arange(num_seqs)  # [T]: which sequence each token is of
        positions = starts  # [T]
        input_ids = np.array(list(map(_token_at, seqs, computed)), np.int64)
    else:
        seq_idx = np.arange(num_seqs).repeat(q_lens)
        positions = np.arange(total) + (starts - cu[:-1]).repeat(q_lens)
        new_tokens = itertools.chain.from_iterable(
            (s.token_ids[c:c + n] if c < len(s.token_ids) else _PLACEHOLDER) + it.spec_token_ids
            for it, s, c, n in zip(scheduled, seqs, computed, new)
        )
        input_ids = np.fromiter(new_tokens, np.int64, total)
    prev_sample_indices = verify_rows = verify_assumed = None
    holes = (input_ids < 0).nonzero()[0]
    if holes.size and prev_assumed is not None:  # behind verifications in flight
        verify_rows = np.full(num_seqs, -1, np.int64)
        verify_assumed = np.zeros(num_seqs, np.int64)
        where = seq_idx[holes]
        try:
            verify_rows[where] = [prev_sample_rows[seqs[b].seq_id] for b in where.tolist()]
            verify_assumed[where] = [prev_assumed[seqs[b].seq_id] for b in where.tolist()]
        except (KeyError, TypeError):
            raise RuntimeError(
                "a scheduled token is a placeholder that the previous step did not verify (bug)"
            ) from None
        input_ids[holes] = 0
    elif holes.size:
        prev_sample_indices = np.full(total, -1, np.int64)
        try:
            prev_sample_indices[holes] = [
                prev_sample_rows[seqs[b].seq_id] for b in seq_idx[holes].tolist()
            ]
        except (KeyError, TypeError):
            raise RuntimeError(
                "a scheduled token is a placeholder that the previous step did not sample (bug)"
            ) from None
        input_ids[holes] = 0

    width = -(-max_seq_len // bs)
    tables = block_tables.rows(seqs)[:, :width].copy()
    slot_mapping = tables[seq_idx, positions // bs].astype(np.int64) * bs + positions % bs
    if prompt_logits is not None and all(prompt_logits):  # a verification: every row
        logits_indices = np.arange(total)
    else:
        sample = np.fromiter(map(_sample, scheduled), bool, num_seqs)
        logits_indices = (cu[1:] - 1)[sample]  # [S]: the last new token of each sampled seq
        if prompt_logits is not None and any(prompt_logits):
            keep = np.fromiter(prompt_logits, bool, num_seqs)[seq_idx]  # [T]: all its rows
            keep[logits_indices] = True
            logits_indices = np.flatnonzero(keep)  # in token order: sequence by sequence
    return StepInput(
        input_ids, positions, slot_mapping, cu.astype(np.int32), np.array(ends, np.int32),
        tables, logits_indices, max_query_len, max_seq_len, prev_sample_indices, verify_rows,
        verify_assumed,
    )


def sample_rows(scheduled: Seq[ScheduledSequence]) -> dict[int, int]:
    """seq_id -> row of the step's sampled ids (the sampled sequences, in step order)."""
    return {it.seq.seq_id: row for row, it in enumerate(it for it in scheduled if it.sample)}


def gather_input_ids(
    input_ids: torch.Tensor, prev_sample_indices: torch.Tensor, sampled_ids: torch.Tensor
) -> torch.Tensor:
    """input_ids [T] with each placeholder (prev_sample_indices[t] >= 0) replaced on the device
    by the previous step's sampled_ids[prev_sample_indices[t]]."""
    taken = sampled_ids[prev_sample_indices.clamp(min=0)]  # [T]
    return torch.where(prev_sample_indices >= 0, taken, input_ids)


class HostBlockTables:
    """The host copy of the block tables, kept from step to step: [max_rows, max_blocks] int32.

    Row i holds the table of the step's i-th sequence; row_keys[i] = (seq_id, num_preemptions,
    table length) says whose it is and how much of it is written.
    """

    def __init__(self, max_rows: int, max_blocks_per_seq: int) -> None:
        self.array = np.zeros((max_rows, max_blocks_per_seq), np.int32)
        self.row_keys: list[tuple[int, int, int] | None] = [None] * max_rows

    def rows(self, seqs: Seq[Sequence]) -> np.ndarray:
        """Rows 0..B-1 [B, max_blocks_per_seq], made to hold `seqs`' tables.

        A row is rewritten only where its key changed; a table that only grew gets its new tail.
        The preemption count is part of the key: a preempted sequence gets new blocks, possibly
        as many as before. Entries past a row's table are 0."""
        if len(seqs) > len(self.row_keys):  # only the profiling pass can be this wide
            self.array = np.zeros((len(seqs), self.array.shape[1]), np.int32)
            self.row_keys = [None] * len(seqs)
        rows, keys = self.array, self.row_keys
        for i, seq in enumerate(seqs):
            table = seq.block_table
            key = (seq.seq_id, seq.num_preemptions, len(table))
            old = keys[i]
            if old == key:
                continue
            old_len = 0 if old is None else old[2]
            done = old_len if old is not None and old[:2] == key[:2] and old_len < key[2] else 0
            rows[i, done : len(table)] = table[done:]
            rows[i, len(table) : old_len] = 0
            keys[i] = key
        return rows[: len(seqs)]


def _token_at(seq: Sequence, position: int) -> int:
    tokens = seq.token_ids
    return tokens[position] if position < len(tokens) else -1  # -1: a placeholder


_PLACEHOLDER = [-1]
_num_computed = operator.attrgetter("num_computed_tokens")
_num_new = operator.attrgetter("num_new_tokens")
_sample = operator.attrgetter("sample")
