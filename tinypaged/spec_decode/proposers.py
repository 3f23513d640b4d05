"""Proposers: each guesses up to k next tokens for each sequence from what the step saw.

    proposer.propose(seqs, ks) -> one list of at most ks[i] token ids per sequence

A proposer may return fewer tokens than asked (none at all: the sequence decodes one token as
without speculation). Proposers here run on the host, from the tokens alone.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np

from tinypaged.scheduler import ScheduledSequence, Sequence


class Proposer:
    # True: propose takes a third argument, a DraftGrammar (grammar.py) for the constrained
    # sequences, and drafts only tokens their grammars allow.
    follows_grammar = False
    # True: what the proposer keeps follows the target's tokens alone, never its own drafts, so
    # its drafts may be padded with filler tokens (decoder.py, SpecDecoder._pad).
    paddable = False

    def propose(self, seqs: Seq[Sequence], ks: Seq[int]) -> list[list[int]]:
        raise NotImplementedError

    def finish(self, seq: Sequence) -> None:
        """`seq` ended (stop, length): drop what the proposer keeps for it."""

    def observe(self, items: Seq[ScheduledSequence], tokens: dict[int, list[int]]) -> None:
        """The target ran `items` (tokens: seq_id -> its accepted drafts + the target's token,
        for the sampled ones); the heads fed the target's hidden states read them here."""


class NgramProposer(Proposer):
    """Prompt lookup (vLLM's "ngram"): for n from prompt_lookup_max down to prompt_lookup_min,
    find the earliest place where the sequence's last n tokens (prompt + output) occurred before
    and propose the tokens that followed it there. The earliest, as vLLM's: in a text that
    copies or edits a passage of the prompt, that is the passage, while a later occurrence is
    often a phrase the output already repeated, followed by something else.

    It runs before every verification step, on the path the GPU waits for, so each sequence's
    tokens are kept in an array that grows by the step's new tokens (not rebuilt from the list),
    and one pass over it finds every candidate (see `lookup`)."""

    paddable = True

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.arrays: dict[int, tuple[np.ndarray, int]] = {}  # seq_id -> (buffer, tokens in it)

    def finish(self, seq: Sequence) -> None:
        self.arrays.pop(seq.seq_id, None)

    def propose(self, seqs: Seq[Sequence], ks: Seq[int]) -> list[list[int]]:
        if len(self.arrays) > 2 * len(seqs):  # aborted sequences are not finish()ed
            live = {seq.seq_id for seq in seqs}
            self.arrays = {i: a for i, a in self.arrays.items() if i in live}
        return [self.lookup(self.tokens(seq), k) if k > 0 else [] for seq, k in zip(seqs, ks)]

    def tokens(self, seq: Sequence) -> np.ndarray:
        """seq.token_ids as an int64 array, extended by what was appended since the last call
        (a sequence's tokens only grow)."""
        ids = seq.token_ids
        buffer, n = self.arrays.get(seq.seq_id, (None, 0))
        if buffer is None or n > len(ids):
            buffer, n = np.empty(2 * len(ids) + 64, dtype=np.int64), 0
        elif len(ids) > len(buffer):
            buffer = np.concatenate([buffer[:n], np.empty(len(ids) + n, dtype=np.int64)])
        buffer[n : len(ids)] = ids[n:]
        self.arrays[seq.seq_id] = (buffer, len(ids))
        return buffer[: len(ids)]

    def lookup(self, tokens: np.ndarray, k: int) -> list[int]:
        """The drafts after the earliest occurrence of the longest suffix of `tokens`
        (n tokens, min_n <= n <= max_n) that occurred before; [] if none did.

        An occurrence ending at e < L - 1 matches j tokens when tokens[e - i] = tokens[L-1 - i]
        for every i < j. The candidates are the e with tokens[e] = tokens[L-1] (one pass over
        the sequence); each one's match length is then read off a [candidates, max_n]
        comparison."""
        length = len(tokens)
        max_n = min(self.max_n, length - 1)
        if max_n < self.min_n:
            return []
        ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])  # ascending
        back = np.arange(max_n)
        at = ends[:, None] - back  # [C, max_n]: the positions compared, backwards from each end
        equal = (tokens[np.maximum(at, 0)] == tokens[length - 1 - back]) & (at >= 0)
        matched = np.logical_and.accumulate(equal, axis=1).sum(axis=1)  # [C]
        n = int(matched.max(initial=0))
        if n < self.min_n:
            return []
        start = int(ends[np.flatnonzero(matched == n)[0]]) + 1  # the earliest of the longest
        return tokens[start : start + k].tolist()


class OracleProposer(Proposer):
    """Benchmarking only: proposes the target's recorded greedy continuation (every draft is
    accepted), or with `miss` that continuation + 1 mod vocab (every draft is rejected)."""

    paddable = True

    def __init__(self, table: dict[tuple[int, ...], list[int]], vocab_size: int, miss: bool):
        self.table, self.vocab_size, self.miss = table, vocab_size, miss
        self.conts: dict[int, tuple[Sequence, list[int]]] = {}  # seq_id -> its continuation

    def finish(self, seq: Sequence) -> None:
        self.conts.pop(seq.seq_id, None)

    def propose(self, seqs: Seq[Sequence], ks: Seq[int]) -> list[list[int]]:
        if len(self.conts) > 2 * len(seqs):  # aborted sequences are not finish()ed
            self.conts = {i: e for i, e in self.conts.items() if not e[0].is_finished}
        out = []
        for seq, k in zip(seqs, ks):
            entry = self.conts.get(seq.seq_id)
            if entry is None:  # the prompt is hashed once per sequence, not once per step
                cont = self.table.get(tuple(seq.prompt_token_ids))
                if cont is None:
                    raise ValueError(
                        f"request {seq.request_id!r}: the oracle proposer has no recorded "
                        f"continuation for this prompt"
                    )
                entry = self.conts[seq.seq_id] = (seq, cont)
            cont = entry[1]
            done = seq.num_output_tokens
            guess = cont[done : done + k]
            out.append([(t + 1) % self.vocab_size for t in guess] if self.miss else guess)
        return out
