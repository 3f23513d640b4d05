"""Logits constraints inside drafts: structured output (and allowed_token_ids, bad_words,
logit_bias) for a speculating sequence, one mask per verified position.

A constrained sequence with drafts x_0..x_{n-1} is verified on n + 1 logits rows; row j scores
the token after x_0..x_{j-1}, so its mask is the grammar's state after those drafts:

    cut_draft (in propose, before scheduling): the matcher accepts x_0, x_1, ... until the
        grammar rejects one (or has terminated: a stop token was accepted); the draft is cut
        there, so the tokens after an invalid one are neither scheduled nor verified; then the
        matcher is rolled back (xgrammar's `rollback(n)`) to where it was.
    DraftMaskBuilder.build (in launch, on the scheduled drafts): fill row 0 from the matcher's
        state, accept x_0, fill row 1, ... fill row n; roll back. Rows after a terminated
        grammar allow everything (the request stops at the stop token before them, so their
        token is dropped). allowed_token_ids applies to every row, bad_words read the row's own
        history output + x_0..x_{j-1}, logit_bias is added to every row.

A proposer that decodes its drafts itself (the draft model) can follow the constraints too
(DraftGrammar): each draft step takes its argmax among the tokens the grammar (and
allowed_token_ids, bad_words) allows after the drafts so far, with the logit bias added, so
its drafts are never cut; the matchers are rolled back after proposing.

The matcher itself advances only when the engine's stop checks take the emitted tokens (the
accepted drafts and the target's own token, decoder.py's after_tokens), exactly as it would one
token a step. The rejection sampler verifies on the masked rows, so every emitted token is one
the grammar allows and greedy output equals decoding without speculation token for token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tinypaged.kernels.logits import apply_token_bitmask_
from tinypaged.sampling.logits_processors import (
    LogitsConstraints,
    LogitsMaskBuilder,
    LogitsMasks,
    clear_bits,
    num_words,
)


def cut_draft(constraints: LogitsConstraints | None, index: int, draft: list[int]) -> list[int]:
    """The longest prefix of `draft` that sample `index`'s grammar accepts from its current
    state (the whole draft without a grammar); the matcher is left as it was."""
    if constraints is None or not constraints.matchers or not draft:
        return draft
    matcher = constraints.matchers[index]
    taken = 0
    try:
        for token in draft:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            taken += 1
    finally:
        if taken:
            matcher.rollback(taken)
    return draft[:taken]


class DraftMaskBuilder(LogitsMaskBuilder):
    """LogitsMaskBuilder over the n + 1 rows of each speculating sequence (one host buffer)."""

    def build_drafts(
        self, seqs: Sequence[tuple[int, LogitsConstraints, int, list[int], list[int]]]
    ) -> LogitsMasks | None:
        """seqs: (first logits row, the request's constraints, sample index, output ids so far,
        the scheduled drafts) of each sampled sequence whose request has constraints; its rows
        are first .. first + len(drafts). Returns None when nothing applies. Raises
        RuntimeError when the grammar rejects a scheduled draft (cut_draft ran before)."""
        masks = LogitsMasks()
        masked = [s for s in seqs if s[1].has_mask]
        if masked:
            host = self._buffer(sum(len(s[4]) + 1 for s in masked))
            words = host.numpy().view(np.uint32)
            rows: list[int] = []
            for first, c, index, output_ids, draft in masked:
                self._fill(host, words, len(rows), c, index, output_ids, draft)
                rows += range(first, first + len(draft) + 1)
            masks.bitmask = host.to(self.device, non_blocking=True)
            masks.bitmask_rows = torch.tensor(rows).to(self.device, non_blocking=True)
        entries = [
            (first + j, t, b)
            for first, c, _, _, draft in seqs
            for j in range(len(draft) + 1)
            for t, b in zip(c.bias_ids, c.bias_values)
        ]
        return self._finish(masks, entries)

    @staticmethod
    def _fill(host: torch.Tensor, words: np.ndarray, at: int, c: LogitsConstraints, index: int,
              output_ids: list[int], draft: list[int]) -> None:
        """Host rows at .. at + len(draft): sequence `index`'s masks along its drafts."""
        matcher = c.matchers[index] if c.matchers else None
        taken = 0
        try:
            for j in range(len(draft) + 1):
                row = at + j
                if matcher is None or matcher.is_terminated():
                    words[row] = 0xFFFFFFFF
                else:
                    matcher.fill_next_token_bitmask(host, row)
                if c.allowed_words is not None:
                    words[row] &= c.allowed_words
                if c.bad_words_ids:
                    clear_bits(words[row], c.banned_tokens(output_ids + draft[:j]))
                if j == len(draft) or matcher is None:
                    continue
                if not matcher.accept_token(draft[j]):
                    raise RuntimeError(
                        f"the grammar rejects scheduled draft token {draft[j]} at position {j}"
                    )
                taken += 1
        finally:
            if taken:
                matcher.rollback(taken)


class DraftGrammar:
    """The logits constraints of the sequences a proposer drafts for, walked along its drafts:
    entries[i] = (constraints, sample index, output ids so far) of sequence i, or None. Use as a
    context manager: leaving it rolls every matcher back to where it was."""

    def __init__(self, entries: list[tuple[LogitsConstraints, int, list[int]] | None],
                 vocab_size: int) -> None:
        self.entries = entries
        self.matchers = [e[0].matchers[e[1]] if e is not None and e[0].matchers else None
                         for e in entries]
        self.drafts: list[list[int]] = [[] for _ in entries]
        self.vocab_size = vocab_size

    def __enter__(self) -> DraftGrammar:
        return self

    def __exit__(self, *exc: object) -> None:
        for matcher, drafted in zip(self.matchers, self.drafts):
            if matcher is not None and drafted:
                matcher.rollback(len(drafted))
        self.drafts = [[] for _ in self.entries]

    def mask_(self, logits: torch.Tensor, seqs: Sequence[int]) -> None:
        """logits [N, >= vocab_size]: row r drafts the next token of sequence seqs[r]; it gets
        that sequence's mask and logit bias at its drafts so far (in place)."""
        rows = [r for r, i in enumerate(seqs) if self.entries[i] is not None]
        if not rows:
            return
        host = torch.empty((len(rows), num_words(self.vocab_size)), dtype=torch.int32)
        words = host.numpy().view(np.uint32)
        bias: list[tuple[int, int, float]] = []
        for n, r in enumerate(rows):
            i = seqs[r]
            c, _, output_ids = self.entries[i]
            if self.matchers[i] is not None:
                self.matchers[i].fill_next_token_bitmask(host, n)
            else:
                words[n] = 0xFFFFFFFF
            if c.allowed_words is not None:
                words[n] &= c.allowed_words
            if c.bad_words_ids:
                clear_bits(words[n], c.banned_tokens(output_ids + self.drafts[i]))
            bias += [(r, t, b) for t, b in zip(c.bias_ids, c.bias_values)]
        view = logits[:, : self.vocab_size]
        index = torch.tensor(rows, dtype=torch.int64)
        apply_token_bitmask_(view, host.to(logits.device), index.to(logits.device))
        if bias:
            r, t, b = zip(*bias)
            view[list(r), list(t)] += torch.tensor(b, dtype=view.dtype).to(logits.device)

    def accept(self, i: int, token: int) -> bool:
        """Whether sequence i may draft `token` next (its matcher takes it)."""
        matcher = self.matchers[i]
        if matcher is not None and (matcher.is_terminated() or not matcher.accept_token(token)):
            return False
        self.drafts[i].append(token)
        return True

    def ended(self, i: int) -> bool:
        """Sequence i's grammar has taken a stop token: nothing can follow."""
        return self.matchers[i] is not None and self.matchers[i].is_terminated()
