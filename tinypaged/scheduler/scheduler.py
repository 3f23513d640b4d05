"""Scheduler: continuous batching over the paged KV cache, with chunked prefill and preemption.

Each step has a budget of `max_num_batched_tokens` new tokens (vLLM v1 style: there is no separate
prefill or decode phase, a step is a list of (sequence, num_new_tokens)). `schedule()` spends it:

1. Running sequences, decodes first (1 token each), then those still in a chunked prefill (their
   next chunk: as many prompt tokens as the budget and the free blocks allow). Decodes go first so
   a long prompt never starves them. When a running sequence needs a block and none is free, the
   most recently admitted running sequence not yet scheduled this step is preempted: its blocks are
   freed, its computed count reset to 0, and it goes back to the *front* of the waiting queue, to
   recompute prompt + generated tokens later (prefix-cache hits usually make that cheap).
2. Waiting sequences, FIFO, while the budget lasts and fewer than `max_num_seqs` run. A sequence is
   admitted only when its whole chunk fits in the free blocks (else admission stops, so a newcomer
   never forces a preemption). Prefix-cache hits are taken at admission. No admission happens in a
   step that preempted. Siblings of an n>1 request wait while one of them prefills the shared
   prompt, then hit its cached blocks instead of computing the prompt n times.

A sequence is sampled in a step when that step computes up to its last token:
`num_computed_tokens + num_new_tokens == len(token_ids) + num_output_placeholders`. Scheduling
advances `num_computed_tokens` and adds a placeholder for each sampled sequence; `update` swaps
the placeholder for the sampled token.

The engine's step (every call O(batch)):

    out = scheduler.schedule()                       # SchedulerOutput
    # model runs out.scheduled: for item in it, the new tokens are
    # item.seq.token_ids[item.num_computed_tokens : item.num_computed_tokens + item.num_new_tokens]
    sampled = {item.seq.seq_id: token for item in out.scheduled if item.sample}
    for seq in scheduler.update(out, sampled):       # caches full blocks, appends tokens
        if stop condition(seq):                      # eos / stop ids / stop strings / max_tokens
            scheduler.finish(seq, "stop" or "length")
    scheduler.abort(request_id)                      # any time between steps

Async scheduling (engine/engine.py) calls `schedule()` for step N+1 before `update()` of step N.
Then a sequence sampled in step N is one placeholder ahead: it is scheduled for one token (the
placeholder, whose id the runner takes from step N's sampled ids on the device), unless its tokens
in flight already reach max_tokens or max_model_len (it ends at step N). A preempted sequence with a
placeholder waits for its token before it is admitted again.

Pipeline parallelism (`pipeline_parallel_size` P > 1, engine/batch_queue.py) keeps up to P
scheduled batches in flight, each in a different stage, and calls `schedule()` while earlier
batches are not updated yet. Those batches are disjoint: a sequence in a batch in flight
(`in_flight`) is left out of the next ones, running or waiting (preempted meanwhile), until
`update()` of its batch. So a sequence never has two steps in flight, and a later batch that
reuses the blocks freed meanwhile (an abort, a preemption) runs after the earlier one on every
stage. Decodes are spread evenly over the free batch slots (`_batch_slots`): with all P slots
free, one batch takes 1/P of the running sequences and the next the rest, so the stages have
work to overlap from the first step on.

Submission: `add(seq)` raises ValueError for a sequence that could never run: prompt + max_tokens
over `max_model_len`, or more KV blocks than the whole cache. The engine must finish a sequence at
its max_tokens; the admission check relies on it.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tinypaged.scheduler.block_manager import BlockManager
from tinypaged.scheduler.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int
    num_computed_tokens: int  # tokens already in the cache: the new ones start at this position
    sample: bool  # this step reaches the last token, so its logits give a sampled token
    # Speculative decoding: proposed tokens scheduled after the last one (num_new_tokens counts
    # them); the step verifies them and update() rolls back the slots of the rejected ones.
    spec_token_ids: list[int] = field(default_factory=list)
    # Overlapped verification (spec_decode/decoder.py): the drafts a later schedule counted as
    # accepted (placeholders) before this step's tokens were known; update() takes them back.
    num_assumed: int = 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)  # decodes first
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """`config` needs max_num_seqs, max_num_batched_tokens, max_model_len (an int by now),
    block_size and enable_prefix_caching (an EngineConfig does)."""

    def __init__(self, config: Any, num_blocks: int) -> None:
        self.max_num_seqs: int = config.max_num_seqs
        self.max_num_batched_tokens: int = config.max_num_batched_tokens
        self.max_model_len: int = config.max_model_len
        if not isinstance(self.max_model_len, int) or self.max_model_len < 1:
            raise ValueError(
                f"max_model_len must be resolved to a positive int before building the "
                f"scheduler, got {self.max_model_len!r}"
            )
        self.block_size: int = config.block_size
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # seq_id -> seq, in admission order
        self.requests: dict[str, list[Sequence]] = {}  # request_id -> its unfinished sequences
        self._arrival = itertools.count()
        self.max_loras = config.max_loras if getattr(config, "enable_lora", False) else 0
        # Pipeline parallelism: the seq_ids of the scheduled batches not yet updated; None
        # without stages, where nothing is left out.
        self.max_concurrent_batches: int = getattr(config, "pipeline_parallel_size", 1)
        self.in_flight: set[int] | None = set() if self.max_concurrent_batches > 1 else None
        self.num_batches_in_flight = 0

    # ---- stats ---------------------------------------------------------------------------
    @property
    def num_running(self) -> int:  # sequences, so a request with n=3 counts 3
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        return self.block_manager.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.block_manager.num_blocks

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    # ---- submission ----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence, rejecting at once one that could never run."""
        if seq.status is not SequenceStatus.WAITING or seq.block_table or seq.num_output_tokens:
            raise ValueError(f"seq {seq.seq_id} was already scheduled; add fresh Sequences only")
        siblings = self.requests.setdefault(seq.request_id, [])
        if any(s.seq_id == seq.seq_id for s in siblings):
            raise ValueError(f"seq_id {seq.seq_id} is already queued for {seq.request_id!r}")
        try:
            self._check_fits(seq)
        except ValueError:
            if not siblings:
                del self.requests[seq.request_id]
            raise
        seq.arrival_order = next(self._arrival)
        max_tokens = seq.max_tokens
        seq.max_length = self.max_model_len if max_tokens is None else min(
            self.max_model_len, seq.num_prompt_tokens + max_tokens
        )
        siblings.append(seq)
        self.waiting.append(seq)

    def _check_fits(self, seq: Sequence) -> None:
        num_prompt, limit = seq.num_prompt_tokens, self.max_model_len
        max_tokens = seq.max_tokens
        if max_tokens is None:  # generate until max_model_len
            if num_prompt >= limit:
                raise ValueError(
                    f"request {seq.request_id!r}: the prompt has {num_prompt} tokens, leaving no "
                    f"room to generate within max_model_len={limit}; shorten the prompt"
                )
            total, what = limit, f"max_model_len={limit}"
        else:
            if max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
            total = num_prompt + max_tokens
            if total > limit:
                raise ValueError(
                    f"request {seq.request_id!r}: prompt ({num_prompt} tokens) + max_tokens "
                    f"({max_tokens}) = {total} tokens exceeds max_model_len={limit}; shorten the "
                    f"prompt or lower max_tokens"
                )
            what = f"prompt ({num_prompt}) + max_tokens ({max_tokens})"
        # The last sampled token never enters the cache.
        needed = self.block_manager.blocks_needed(total - 1)
        if needed > self.block_manager.num_blocks:
            raise ValueError(
                f"request {seq.request_id!r}: {what} needs up to {needed} KV-cache blocks of "
                f"{self.block_size} tokens, but the whole cache has "
                f"{self.block_manager.num_blocks}; lower max_tokens or shorten the prompt, or give "
                f"the cache more memory (gpu_memory_utilization / num_kv_blocks)"
            )

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        scheduled_ids: set[int] = set()

        def take(seq: Sequence, n: int) -> None:
            nonlocal budget
            computed = seq.num_computed_tokens
            spec = seq.spec_token_ids[: max(0, n - seq.num_uncomputed_tokens)]
            sample = computed + n - len(spec) == len(seq.token_ids) + seq.num_output_placeholders
            out.scheduled.append(ScheduledSequence(seq, n, computed, sample, spec))
            seq.num_computed_tokens = computed + n
            seq.num_output_placeholders += sample
            scheduled_ids.add(seq.seq_id)
            budget -= n

        # 1. Running sequences: decodes, then chunked prefills.
        decodes, prefills = [], []
        in_flight = self.in_flight
        running = self.running.values()
        if in_flight:  # their batch is still in the pipeline
            running = [s for s in running if s.seq_id not in in_flight]
        for seq in running:
            (prefills if seq.num_uncomputed_tokens > 1 else decodes).append(seq)
        candidates = decodes + prefills
        if in_flight is not None:  # spread them over the batch slots still free
            candidates = candidates[: -(-len(candidates) // self._batch_slots())]
        for seq in candidates:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            if len(seq.token_ids) + seq.num_output_placeholders >= seq.max_length:
                # The step in flight gives its last token (or, with speculation under async
                # scheduling, gave it: its stop checks run after this schedule).
                continue
            want = min(seq.num_uncomputed_tokens + len(seq.spec_token_ids), budget)
            if len(seq.block_table) * self.block_size >= seq.num_computed_tokens + want:
                # The common decode (and a verification whose drafts fit the blocks kept from
                # its last rollback): its slots are in its blocks, nothing to allocate.
                take(seq, want)
                continue
            while (n := min(want, bm.num_allocatable_tokens(seq))) == 0:
                victim = self._newest_unscheduled(scheduled_ids)
                if victim is seq and len(self.running) == 1:
                    raise RuntimeError(
                        f"seq {seq.seq_id} ({len(seq)} tokens) cannot grow although it is alone "
                        f"in the cache: the admission check should have rejected it, or the "
                        f"engine did not finish it at max_tokens (bug)"
                    )
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                bm.allocate(seq, n)
                take(seq, n)

        # 2. Waiting sequences, FIFO.
        deferred: list[Sequence] = []
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and not out.preempted
        ):
            seq = self.waiting[0]
            if (seq.num_output_placeholders or self._sibling_prefilling(seq)
                    or (seq.lora_int_id and not self._lora_fits(seq))
                    or (in_flight and seq.seq_id in in_flight)):
                deferred.append(self.waiting.popleft())
                continue
            hits = bm.find_cached_prefix(seq)
            n = min(len(seq.token_ids) - len(hits) * self.block_size, budget)
            if not bm.allocate(seq, n, hits):
                break
            self.waiting.popleft()
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running[seq.seq_id] = seq
            take(seq, n)
        self.waiting.extendleft(reversed(deferred))
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        if in_flight is not None and out.scheduled:
            in_flight.update(scheduled_ids)
            self.num_batches_in_flight += 1
        return out

    def drop_in_flight(self) -> None:
        """Forget the batches in flight (after a failed step, which aborted their requests)."""
        if self.in_flight is not None:
            self.in_flight.clear()
            self.num_batches_in_flight = 0

    def _batch_slots(self) -> int:
        """How many batches may still join the ones in flight, this one included."""
        return max(1, self.max_concurrent_batches - self.num_batches_in_flight)

    def _lora_fits(self, seq: Sequence) -> bool:
        """Whether admitting seq keeps the running adapters within the max_loras GPU slots."""
        running = {s.lora_int_id for s in self.running.values() if s.lora_int_id}
        return seq.lora_int_id in running or len(running) < self.max_loras

    def _newest_unscheduled(self, scheduled_ids: set[int]) -> Sequence:
        for seq in reversed(self.running.values()):
            if seq.seq_id not in scheduled_ids:
                return seq
        raise RuntimeError("no running sequence left to preempt (bug)")

    def _preempt(self, seq: Sequence) -> None:
        del self.running[seq.seq_id]
        self.block_manager.free(seq)  # also resets num_computed_tokens: recompute everything
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _sibling_prefilling(self, seq: Sequence) -> bool:
        """True while another sample of seq's request is computing prompt blocks seq could hit."""
        if not self.block_manager.enable_prefix_caching:
            return False
        shareable = (seq.num_prompt_tokens - 1) // self.block_size * self.block_size
        return any(  # blocks become hits once registered, after the step that fills them
            s is not seq
            and s.status is SequenceStatus.RUNNING
            and s.num_registered_blocks * self.block_size < shareable
            for s in self.requests[seq.request_id]
        )

    def update(self, out: SchedulerOutput, sampled_tokens: Mapping[int, int]) -> list[Sequence]:
        """Record a finished model step: register the blocks it filled in the prefix cache,
        replace each placeholder by its sampled token (`sampled_tokens[seq_id]`, for every item
        with `sample`). Returns the sequences that got a token, for the engine's stop checks.
        Sequences finished or aborted since `schedule()` are skipped; one preempted since gets
        its token (it recomputes it later) but keeps no blocks to register."""
        grown = []
        running = SequenceStatus.RUNNING
        if self.in_flight is not None and out.scheduled:  # its sequences may join a batch again
            self.in_flight.difference_update(it.seq.seq_id for it in out.scheduled)
            self.num_batches_in_flight -= 1
        for item in out.scheduled:
            seq = item.seq
            if seq.status is SequenceStatus.FINISHED:
                continue
            if item.sample and isinstance(sampled_tokens[seq.seq_id], list):
                self._update_verified(item, sampled_tokens[seq.seq_id])
                grown.append(seq)
                continue
            if seq.status is running:  # this step's tokens only: a later step may be in flight
                end = item.num_computed_tokens + item.num_new_tokens
                self.block_manager.mark_computed(seq, end)
            if item.sample:
                seq.num_output_placeholders -= 1
                seq.append_token(sampled_tokens[seq.seq_id])
                grown.append(seq)
        return grown

    def _update_verified(self, item: ScheduledSequence, tokens: list[int]) -> None:
        """Speculative decoding: `tokens` are the accepted drafts plus one token of the target's;
        the slots of the rejected drafts are rolled back before the filled blocks are
        registered (so every registered hash names tokens whose K/V is in the block)."""
        seq = item.seq
        seq.num_output_placeholders -= 1 + item.num_assumed
        seq.token_ids.extend(tokens)
        if seq.status is SequenceStatus.RUNNING:
            self.block_manager.rollback(seq, len(item.spec_token_ids) + 1 - len(tokens))
            # up to the last token, which is not computed yet (a later step in flight may be)
            self.block_manager.mark_computed(seq, min(seq.num_computed_tokens, len(seq) - 1))

    # ---- ending --------------------------------------------------------------------------
    def finish(self, seq: Sequence, reason: str = "stop") -> None:
        """End a sequence (running or waiting) and free its blocks at once."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            del self.running[seq.seq_id]
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        siblings = self.requests[seq.request_id]
        siblings.remove(seq)
        if not siblings:
            del self.requests[seq.request_id]

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every sequence of a request with reason "abort"; unknown ids are a no-op."""
        seqs = list(self.requests.get(request_id, ()))
        for seq in seqs:
            self.finish(seq, "abort")
        return seqs

    def check_invariants(self) -> None:
        """Raise AssertionError when queues and the cache disagree (for tests)."""
        for seq in self.waiting:
            if seq.status is not SequenceStatus.WAITING or seq.block_table:
                raise AssertionError(f"waiting {seq} holds blocks or has the wrong status")
        if len(self.running) > self.max_num_seqs:
            raise AssertionError(f"{len(self.running)} running > max_num_seqs")
        queued = len(self.running) + len(self.waiting)
        if queued != sum(len(v) for v in self.requests.values()):
            raise AssertionError("request map out of sync with the queues")
        self.block_manager.check_invariants(self.running.values())
