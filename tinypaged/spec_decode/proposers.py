"""Proposers: each guesses up to k next tokens for each sequence from what the step saw.

    proposer.propose(seqs, ks) -> one list of at most ks[i] token ids per sequence

A proposer may return fewer tokens than asked (none at all: the sequence decodes one token as
without speculation). Proposers here run on the host, from the tokens alone, so they can also
continue a text the host does not have yet: `propose(seqs, ks, tails)` proposes what follows
`seq.token_ids + tails[i]` (overlapped verification, decoder.py: the tail is what the
verification in flight is assumed to accept).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence as Seq

from tinypaged.scheduler import ScheduledSequence, Sequence


class Proposer:
    # True: propose takes a third argument, a DraftGrammar (grammar.py) for the constrained
    # sequences, and drafts only tokens their grammars allow.
    follows_grammar = False
    # True: what the proposer keeps follows the target's tokens alone, never its own drafts, so
    # its drafts may be padded with filler tokens (decoder.py, SpecDecoder._pad).
    paddable = False
    # True: propose takes `tails`, tokens assumed to follow each sequence's token_ids.
    overlaps = False

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
    tokens are kept as bytes (4 a token) that grow by the step's new tokens, and the search for
    each suffix is `bytes.find`, CPython's substring search in C (see `lookup`)."""

    paddable = overlaps = True

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.arrays: dict[int, bytearray] = {}  # seq_id -> its tokens as int32 bytes

    def finish(self, seq: Sequence) -> None:
        self.arrays.pop(seq.seq_id, None)

    def propose(self, seqs: Seq[Sequence], ks: Seq[int],
                tails: Seq[Seq[int]] | None = None) -> list[list[int]]:
        if len(self.arrays) > 2 * len(seqs):  # aborted sequences are not finish()ed
            live = {seq.seq_id for seq in seqs}
            self.arrays = {i: a for i, a in self.arrays.items() if i in live}
        if tails is None:
            return [self._lookup(self.tokens(seq), seq.token_ids, k) if k > 0 else []
                    for seq, k in zip(seqs, ks)]
        # Asked for the guess too (decoder.py), a match close to the end would leave no draft
        # after it: its copy goes on past the end, as the period it found (x y x y -> x y ...).
        return [self._lookup(self.tokens(seq) + array("i", tail).tobytes(),
                             seq.token_ids + list(tail), k, periodic=True) if k > 0 else []
                for seq, k, tail in zip(seqs, ks, tails)]

    def tokens(self, seq: Sequence) -> bytearray:
        """seq.token_ids as int32 bytes, extended by what was appended since the last call (a
        sequence's tokens only grow)."""
        ids = seq.token_ids
        buffer = self.arrays.get(seq.seq_id)
        if buffer is None or len(buffer) > 4 * len(ids):
            buffer = self.arrays[seq.seq_id] = bytearray()
        buffer += array("i", ids[len(buffer) // 4 :]).tobytes()
        return buffer

    def lookup(self, tokens: Seq[int], k: int) -> list[int]:
        """The drafts after the earliest occurrence of the longest suffix of `tokens`
        (n tokens, min_n <= n <= max_n) that occurred before; [] if none did."""
        ids = [int(t) for t in tokens]
        return self._lookup(array("i", ids).tobytes(), ids, k)

    def _lookup(self, data: bytes | bytearray, ids: Seq[int], k: int,
                periodic: bool = False) -> list[int]:
        """`lookup` on `ids` and the same ids as int32 bytes. The longest n is tried first (in
        a text that copies, it matches), then the shortest: no occurrence of the last min_n
        tokens means none of a longer suffix either, which settles a miss in two searches.
        `periodic`: a copy that reaches the end of `ids` goes on copying its own start."""
        length = len(ids)
        top = min(self.max_n, length - 1)
        if top < self.min_n:
            return []
        start = self._after(data, length, top)
        if start is None and top > self.min_n:
            shortest = self._after(data, length, self.min_n)
            if shortest is None:
                return []
            for n in range(top - 1, self.min_n, -1):
                if (start := self._after(data, length, n)) is not None:
                    break
            else:
                start = shortest
        if start is None:
            return []
        out = list(ids[start : start + k])
        while periodic and 0 < len(out) < k:  # position start + len(out) is out's own
            out.append(out[start + len(out) - length])
        return out

    @staticmethod
    def _after(data: bytes | bytearray, length: int, n: int) -> int | None:
        """The index after the earliest occurrence of the last n tokens that ends before the
        last token (the search stops at byte 4 (length - 1)), or None; a match at an offset
        that is not a multiple of 4 straddles two tokens and is skipped."""
        end, suffix = 4 * (length - 1), data[4 * (length - n) : 4 * length]
        at = data.find(suffix, 0, end)
        while at % 4 and at != -1:
            at = data.find(suffix, at + 1, end)
        return None if at == -1 else at // 4 + n


class OracleProposer(Proposer):
    """Benchmarking only: proposes the target's recorded greedy continuation (every draft is
    accepted), or with `miss` that continuation + 1 mod vocab (every draft is rejected)."""

    paddable = overlaps = True

    def __init__(self, table: dict[tuple[int, ...], list[int]], vocab_size: int, miss: bool):
        self.table, self.vocab_size, self.miss = table, vocab_size, miss
        self.conts: dict[int, tuple[Sequence, list[int]]] = {}  # seq_id -> its continuation

    def finish(self, seq: Sequence) -> None:
        self.conts.pop(seq.seq_id, None)

    def propose(self, seqs: Seq[Sequence], ks: Seq[int],
                tails: Seq[Seq[int]] | None = None) -> list[list[int]]:
        if len(self.conts) > 2 * len(seqs):  # aborted sequences are not finish()ed
            self.conts = {i: e for i, e in self.conts.items() if not e[0].is_finished}
        out = []
        for i, (seq, k) in enumerate(zip(seqs, ks)):
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
            done = seq.num_output_tokens + (len(tails[i]) if tails is not None else 0)
            guess = cont[done : done + k]
            out.append([(t + 1) % self.vocab_size for t in guess] if self.miss else guess)
        return out
