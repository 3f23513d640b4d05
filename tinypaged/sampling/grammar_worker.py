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
same constrained throughput). Hence the worker's backend: `LocalGrammar` makes the calls here,
a grammar_process.GrammarProcess (the default on a GPU) makes them in a process of its own, and
the thread then only waits for the tokens, sends them and copies the mask rows back.

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
import weakref
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
        self.live: list[Any] = []  # weakrefs to the matchers that filled row i of `bitmask`
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
        return {id(m()): i for i, m in enumerate(self.live) if m() is not None}

    def run(self, backend: Any, bitmask: torch.Tensor) -> None:
        """The worker thread's part. backend: `LocalGrammar` or a `GrammarProcess` (its `step`
        does the accepts and fills); bitmask: int32 [>= len(matchers), W] host rows it owns."""
        try:
            sampled = self.tokens.tolist()  # waits for the device with the GIL released
            tokens = [sampled[p] for p in self.positions]
            rejected, ended, live = backend.step(self.matchers, tokens, bitmask)
            seq_ids = [self.seqs[p].seq_id for p in self.positions]
            self.rejected = {seq_ids[i] for i in rejected}
            self.ended = {seq_ids[i] for i in ended}
            # Weakly: a finished request's matcher goes (and leaves the grammar process) when
            # the request does, not at the next step; a dead entry matches no matcher.
            self.live = [weakref.ref(self.matchers[i]) for i in live]
            self.matchers = []
            self.bitmask = bitmask
        except BaseException as exc:  # surfaces on the engine thread, at wait()
            self.error = exc
        finally:
            self._finished = True
            self._done.set()


class StopTokens:
    """The stop tokens' bits in a packed bitmask row [W] (uint32 words): the words that hold
    them (`words`) and their bits in those words (`bits`)."""

    def __init__(self, stop_token_ids: Collection[int]) -> None:
        self.ids = frozenset(stop_token_ids)
        ids = np.asarray(sorted(self.ids), dtype=np.int64)
        self.words = np.unique(ids >> 5)
        self.bits = np.zeros(len(self.words), dtype=np.uint32)
        np.bitwise_or.at(self.bits, np.searchsorted(self.words, ids >> 5),
                         (1 << (ids & 31)).astype(np.uint32))

    def only_stop(self, words: np.ndarray) -> np.ndarray:
        """The rows of `words` [k, W] (uint32) that allow a stop token and nothing else."""
        has_stop = (words[:, self.words] & self.bits).any(axis=1)
        rows = np.flatnonzero(has_stop)
        if not len(rows):
            return rows
        other = words[rows].copy()
        other[:, self.words] &= ~self.bits
        return rows[~other.any(axis=1)]


def accept_and_fill(matchers: list[Any], tokens: list[int], filler: MaskFiller,
                    bitmask: torch.Tensor, stop: StopTokens, pool: Executor | None = None,
                    num_chunks: int = 1) -> tuple[list[int], list[int], list[int]]:
    """One step's grammar work: matcher i takes tokens[i] (batch_accept), and each matcher that
    did not take a stop token fills its next mask into `bitmask` [>= len(matchers), W] int32,
    rows 0, 1, ... in order. Returns (rejected, ended, live), indices into `matchers`: the
    tokens the grammar rejected (those matchers keep their state), the matchers whose grammar
    now allows only a stop token, and the matchers whose masks fill the rows. A matcher that
    took a stop token is terminated: it has no next mask (xgrammar raises), and ends anyway."""
    rejected = batch_accept(matchers, tokens, pool, num_chunks)
    if stop.ids.isdisjoint(tokens):
        live, filled = list(range(len(matchers))), matchers
    else:
        live = [i for i, t in enumerate(tokens) if t not in stop.ids]
        filled = [matchers[i] for i in live]
    ended = []
    if live:
        filler.fill(filled, bitmask)
        # A complete grammar allows the stop tokens: ended when it allows nothing else.
        ended = [live[r] for r in stop.only_stop(bitmask[: len(live)].numpy().view(np.uint32))]
    return rejected, ended, live


class LocalGrammar:
    """The worker's grammar calls in this process: accepts in chunks on a few threads
    (xgrammar takes one batch's tokens on one thread) and one batched fill."""

    def __init__(self, stop_token_ids: Collection[int]) -> None:
        self.stop = StopTokens(stop_token_ids)
        self.filler = MaskFiller()
        self.num_chunks = grammar_threads()
        self.pool = None
        if self.num_chunks > 1:
            self.pool = ThreadPoolExecutor(self.num_chunks - 1,
                                           thread_name_prefix="tinypaged-grammar-accept")

    def step(self, matchers: list[Any], tokens: list[int],
             bitmask: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
        """accept_and_fill with this object's filler and threads."""
        return accept_and_fill(matchers, tokens, self.filler, bitmask, self.stop, self.pool,
                               self.num_chunks)


class GrammarWorker:
    """The thread that runs each step's GrammarAdvance, one at a time, in order. One per engine
    (built at the first structured-output request); `take_latest()` is the last step's advance,
    whose mask rows the next step's LogitsMaskBuilder.build reads.

    vocab_size: the logits' width; stop_token_ids: the ids that end a sequence (the grammar
    compiler's, the engine's eos set); device: the logits' device."""

    def __init__(self, vocab_size: int, stop_token_ids: Sequence[int],
                 device: torch.device, backend: Any = None) -> None:
        self.vocab_size = vocab_size
        self.stop_token_ids = frozenset(stop_token_ids)
        # Where the accepts and fills run: this process (LocalGrammar) or the grammar process.
        self.backend = backend if backend is not None else LocalGrammar(self.stop_token_ids)
        # Pinned on a GPU: the next step copies these rows straight to the device (one
        # asynchronous copy, LogitsMaskBuilder.build). The copy is queued before that step's
        # sampling, and the next advance refills the rows only once that sampling's tokens are
        # on the host, so the copy has finished by then.
        self._pin = device.type == "cuda"
        self._bitmask = torch.empty((0, (vocab_size + 31) // 32), dtype=torch.int32)
        self._latest: GrammarAdvance | None = None
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
        args = (self.backend, self._bitmask)
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

    def take_latest(self) -> GrammarAdvance | None:
        """`latest()`, let go of: the next step's masks read it once, and then its matchers
        (a finished request's among them) are no longer held here."""
        job = self.latest()
        self._latest = None
        return job


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
