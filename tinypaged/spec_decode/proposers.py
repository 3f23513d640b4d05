"""Proposers: each guesses up to k next tokens for each sequence from what the step saw.

    proposer.propose(seqs, ks) -> one list of at most ks[i] token ids per sequence

A proposer may return fewer tokens than asked (none at all: the sequence decodes one token as
without speculation). Proposers here run on the host, from the tokens alone.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tinypaged.scheduler import ScheduledSequence, Sequence


class Proposer:
    # True: propose takes a third argument, a DraftGrammar (grammar.py) for the constrained
    # sequences, and drafts only tokens their grammars allow.
    follows_grammar = False

    def propose(self, seqs: Seq[Sequence], ks: Seq[int]) -> list[list[int]]:
        raise NotImplementedError

    def finish(self, seq: Sequence) -> None:
        """`seq` ended (stop, length): drop what the proposer keeps for it."""

    def observe(self, items: Seq[ScheduledSequence], tokens: dict[int, list[int]]) -> None:
        """The target ran `items` (tokens: seq_id -> its accepted drafts + the target's token,
        for the sampled ones); the heads fed the target's hidden states read them here."""


class NgramProposer(Proposer):
    """Prompt lookup (vLLM's "ngram"): for n from prompt_lookup_max down to prompt_lookup_min,
    find the latest earlier place where the sequence's last n tokens (prompt + output) occurred
    and propose the tokens that followed it there."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: Seq[Sequence], ks: Seq[int]) -> list[list[int]]:
        return [self.lookup(seq.token_ids, k) if k > 0 else [] for seq, k in zip(seqs, ks)]

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows over tokens[:-1]: every match is followed by at least one token.
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + k].tolist()
        return []


class OracleProposer(Proposer):
    """Benchmarking only: proposes the target's recorded greedy continuation (every draft is
    accepted), or with `miss` that continuation + 1 mod vocab (every draft is rejected)."""

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
