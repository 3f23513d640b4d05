"""Structured output off the engine thread: after a step is sampled, the grammar matchers of its
constrained rows take their tokens in batched calls (chunks on a few threads: xgrammar walks one
batch on one thread) and fill their next masks in one call, on a thread of its own, while the
engine thread schedules and launches the next step.

    step N sampled (tokens on their way to the host)  -> GrammarWorker.advance(...)   engine thread
        wait for the tokens; batch_accept_token;         (GrammarAdvance.run)         worker thread
        batch_fill_next_token_bitmask -> next masks; flag the rows whose grammar ended
    schedule N+1, launch its forward                                                   engine thread
    process N: text first, then the verdicts           (GrammarAdvance.verdict)       engine thread
    sample N+1: the worker's bitmask rows go to the device (LogitsMaskBuilder.build)

Per constrained row the engine thread keeps only bookkeeping (a list entry, a dict lookup, a set
test). The worker's calls overlap the engine thread's waits for the device, not its Python:
measured with xgrammar 0.2.9, a fill call beside a thread running Python takes several times its
time alone, and two fill calls on two threads take as long as one after the other
(benchmarks/RESULTS.md, Structured output). So on a step that the host bounds, a constrained row
costs its accept and its fill either way; with TINYPAGED_GRAMMAR_THREAD=0 the same batched calls
run on the engine thread at the first verdict (an A/B switch: on the H200 the two modes gave the
same constrained throughput).

Per advanced matcher the worker's bitmask row is its next mask as long as the matcher takes no
other token, which holds because the engine reads the rows (build) before it hands the worker the
next step's tokens, and nothing else advances these matchers (speculative decoding keeps its own
per-token path: spec_decode/).

A matcher ends a request in two ways (engine.py's stop checks): it accepted a stop token
(terminated), or its grammar is complete and only a stop token may follow. The second is read
from the mask the worker fills anyway: a row whose only set bits are stop tokens (stop tokens are
allowed exactly when the grammar is complete), so no extra fill per row is needed.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from tinypaged import envs
from tinypaged.sampling.structured_output import (
    MaskFiller,
    batch_accept,
    grammar_only_allows_stop,
    grammar_threads,
)


class GrammarAdvance:
    """One step's grammar work: `seqs` are the step's sampled sequences (the rows of `tokens`,
    which has `tolist()`, waiting for the device); `positions[i]` is the row whose token
    `matchers[i]` takes. Filled in by `run` on the worker thread; read after `wait`."""

    def __init__(self, seqs: Sequence[Any], positions: list[int], matchers: list[Any],
                 tokens: Any) -> None:
        self.seqs, self.positions, self.matchers, self.tokens = seqs, positions, matchers, tokens
        self.rejected: set[int] = set()  # seq_ids whose token the grammar rejected
        self.ended: set[int] = set()  # seq_ids whose grammar now allows only a stop token
        self.live: list[Any] = []  # the matchers that filled a next mask: row i of `bitmask`
        self.bitmask: torch.Tensor | None = None  # int32 [>= len(live), W], host
        self.error: BaseException | None = None
        self._stop_token_ids: frozenset[int] = frozenset()
        self._finished = False  # read without the event's lock once set (every verdict)
        self._done = threading.Event()
        self._deferred: tuple | None = None  # run's arguments, without a thread: run at wait()

    def join(self) -> None:
        """Block until the work is done (without a worker thread: do it now)."""
        if self._finished:
            return
        if self._deferred is not None:
            args, self._deferred = self._deferred, None
            self.run(*args)
        self._done.wait()

    def wait(self) -> GrammarAdvance:
        """Block until the work is done; re-raise what it raised."""
        self.join()
        if self.error is not None:
            raise RuntimeError(f"the grammar worker failed: {self.error!r}") from self.error
        return self

    def verdict(self, seq_id: int, token: int) -> tuple[bool, bool]:
        """(rejected, ended) for the sequence's token: the grammar rejected it, or the request
        must stop here (a stop token was accepted, or only a stop token may follow)."""
        if not self._finished or self.error is not None:
            self.wait()
        if seq_id in self.rejected:
            return True, False
        return False, token in self._stop_token_ids or seq_id in self.ended

    @property
    def rows(self) -> dict[int, int]:
        """id(matcher) -> the row of `bitmask` that holds its next mask."""
        return {id(m): i for i, m in enumerate(self.live)}

    def run(self, filler: MaskFiller, bitmask: torch.Tensor, stop_words: np.ndarray,
            stop_bits: np.ndarray, pool: Executor | None = None, num_chunks: int = 1) -> None:
        """The worker thread's part. bitmask: int32 [>= len(matchers), W] host rows it owns;
        stop_words / stop_bits: the words holding stop-token bits and those bits (uint32);
        pool, num_chunks: threads that take chunks of the accepts (batch_accept)."""
        try:
            sampled = self.tokens.tolist()  # waits for the device with the GIL released
            tokens = [sampled[p] for p in self.positions]
            rejected = batch_accept(self.matchers, tokens, pool, num_chunks)
            stop = self._stop_token_ids
            # A terminated matcher (it took a stop token) has no next mask: xgrammar raises.
            live = self.matchers if stop.isdisjoint(tokens) else [
                m for m, t in zip(self.matchers, tokens) if t not in stop
            ]
            if live:
                filler.fill(live, bitmask)
                words = bitmask[: len(live)].numpy().view(np.uint32)  # [k, W]
                has_stop = (words[:, stop_words] & stop_bits).any(axis=1)
                if has_stop.any():  # a complete grammar: ended when nothing else is allowed
                    rows = np.flatnonzero(has_stop)
                    other = words[rows].copy()
                    other[:, stop_words] &= ~stop_bits
                    index = {id(m): i for i, m in enumerate(self.matchers)}
                    self.ended = {
                        self.seqs[self.positions[index[id(live[r])]]].seq_id
                        for r in rows[~other.any(axis=1)]
                    }
            self.rejected = {self.seqs[self.positions[i]].seq_id for i in rejected}
            self.live = live
            self.bitmask = bitmask
        except BaseException as exc:  # surfaces on the engine thread, at wait()
            self.error = exc
        finally:
            self._finished = True
            self._done.set()


class GrammarWorker:
    """The thread that runs each step's GrammarAdvance, one at a time, in order. One per engine
    (built at the first structured-output request); `latest()` is the last step's advance, whose
    mask rows the next step's LogitsMaskBuilder.build reads.

    vocab_size: the logits' width; stop_token_ids: the ids that end a sequence (the grammar
    compiler's, the engine's eos set); device: the logits' device."""

    def __init__(self, vocab_size: int, stop_token_ids: Sequence[int],
                 device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.stop_token_ids = frozenset(stop_token_ids)
        ids = np.asarray(sorted(self.stop_token_ids), dtype=np.int64)
        self._stop_words = np.unique(ids >> 5)
        bits = np.zeros(len(self._stop_words), dtype=np.uint32)
        np.bitwise_or.at(bits, np.searchsorted(self._stop_words, ids >> 5),
                         (1 << (ids & 31)).astype(np.uint32))
        self._stop_bits = bits
        self._filler = MaskFiller()
        # Pinned on a GPU: the next step copies these rows straight to the device (one
        # asynchronous copy, LogitsMaskBuilder.build). The copy is queued before that step's
        # sampling, and the next advance refills the rows only once that sampling's tokens are
        # on the host, so the copy has finished by then.
        self._pin = device.type == "cuda"
        self._bitmask = torch.empty((0, (vocab_size + 31) // 32), dtype=torch.int32)
        self._latest: GrammarAdvance | None = None
        # xgrammar takes a batch's tokens on one thread: chunks go to these threads as well.
        self._num_chunks = grammar_threads()
        self._accept_pool = None
        if self._num_chunks > 1:
            self._accept_pool = ThreadPoolExecutor(self._num_chunks - 1,
                                                   thread_name_prefix="tinypaged-grammar-accept")
        # Not a daemon thread: one killed at exit inside an xgrammar call aborts the process.
        # The executor joins it at exit and ends it when the worker is collected. Without it
        # (TINYPAGED_GRAMMAR_THREAD=0) the same calls run on the engine thread, at the verdicts.
        self._thread = None
        if envs.TINYPAGED_GRAMMAR_THREAD:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="tinypaged-grammar")

    def advance(self, seqs: Sequence[Any], positions: list[int], matchers: list[Any],
                tokens: Any) -> GrammarAdvance:
        """Queue a step's accepts and next masks (see GrammarAdvance); returns at once. The
        matchers belong to the worker until the returned advance is waited for."""
        self.latest()  # the last advance has finished: its bitmask rows were read
        if self._bitmask.shape[0] < len(matchers):
            self._bitmask = torch.empty((max(len(matchers), 2 * self._bitmask.shape[0]),
                                         self._bitmask.shape[1]), dtype=torch.int32,
                                        pin_memory=self._pin)
        job = GrammarAdvance(seqs, positions, matchers, tokens)
        job._stop_token_ids = self.stop_token_ids
        self._latest = job
        args = (self._filler, self._bitmask, self._stop_words, self._stop_bits,
                self._accept_pool, self._num_chunks)
        if self._thread is None:
            job._deferred = args
        else:
            self._thread.submit(job.run, *args)
        return job

    def advance_step(self, seqs: Sequence[Any], reqs: Sequence[Any],
                     tokens: Any) -> GrammarAdvance | None:
        """`advance` for a sampled step's grammar rows (`grammar_rows`); None when it has
        none."""
        rows, matchers = grammar_rows(seqs, reqs)
        return self.advance(seqs, rows, matchers, tokens) if matchers else None

    def latest(self) -> GrammarAdvance | None:
        """The last advance, finished (None before the first or when it failed)."""
        job = self._latest
        if job is None:
            return None
        job.join()
        return None if job.error is not None else job


def grammar_rows(seqs: Sequence[Any], reqs: Sequence[Any]) -> tuple[list[int], list[Any]]:
    """(rows, matchers) of a sampled step whose matchers take the rows' tokens: each sequence
    with a grammar that was not finished when the step was sampled (its token is dropped)."""
    rows, matchers = [], []
    for i, (r, s) in enumerate(zip(reqs, seqs)):
        c = r.constraints
        if c is not None and c.matchers and s.finish_reason is None:
            rows.append(i)
            matchers.append(c.matchers[s.index])
    return rows, matchers


def grammar_verdict(matcher: Any, seq_id: int, token: int, advance: GrammarAdvance | None,
                    rejected: bool | None, check_end: bool, vocab_size: int,
                    stop_token_ids: Collection[int]) -> tuple[bool, bool]:
    """(rejected, ended) for a sequence's sampled token (see GrammarAdvance.verdict): the
    worker's when `advance` took it; else `matcher` takes it here, unless `rejected` says the
    caller already had it take the token (speculative decoding). Whether the grammar ended is
    asked only with `check_end` (no other stop reason yet)."""
    if advance is not None:
        return advance.verdict(seq_id, token)
    if rejected is None:
        rejected = not matcher.accept_token(token)
    ended = not rejected and check_end and (
        matcher.is_terminated()
        or grammar_only_allows_stop(matcher, vocab_size, list(stop_token_ids))
    )
    return rejected, ended
