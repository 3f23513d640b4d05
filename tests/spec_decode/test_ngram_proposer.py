"""The n-gram proposer against a direct statement of prompt lookup, on token streams with many
repeats (a small vocabulary), and its per-sequence arrays as the sequence grows."""

import random

import numpy as np
import pytest

from tinypaged.scheduler import Sequence
from tinypaged.spec_decode.proposers import NgramProposer


def prompt_lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """For n from max_n down to min_n: the tokens after the earliest occurrence of the last n
    tokens before them (one that some token follows), the first n that has one."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (2, 5), (3, 3), (1, 8)])
def test_lookup_matches_prompt_lookup(min_n, max_n):
    rng = random.Random(min_n * 10 + max_n)
    proposer = NgramProposer(min_n, max_n)
    for _ in range(400):
        vocab = rng.choice([2, 3, 5, 50])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        k = rng.randrange(1, 6)
        got = proposer.lookup(np.asarray(tokens, dtype=np.int64), k)
        assert got == prompt_lookup(tokens, k, min_n, max_n), tokens


def test_the_earliest_of_the_longest_occurrences_is_followed():
    # As vLLM's lookup: [1, 2, 3] occurred at 0 (then 9) and at 4 (then 7); a copied passage sits
    # in the prompt, before the output's own repeats. A longer match wins over an earlier one.
    proposer = NgramProposer(1, 3)
    tokens = np.asarray([1, 2, 3, 9, 8, 1, 2, 3, 7, 1, 2, 3], dtype=np.int64)
    assert proposer.lookup(tokens, 3) == [9, 8, 1]
    longer = np.asarray([5, 3, 6, 0, 2, 3, 4, 0, 2, 3], dtype=np.int64)  # 3 alone first at 1
    assert proposer.lookup(longer, 2) == [4, 0]


def test_a_match_across_two_tokens_bytes_is_no_match():
    # The search runs over 4 bytes a token: t's bytes 01 02 03 04 also stand across a (00 00 01
    # 02) and b (03 04 00 00), which is no occurrence of t.
    t, a, b = 0x04030201, 0x02010000, 0x00000403
    proposer = NgramProposer(1, 1)
    assert proposer.lookup([a, b, 7, t, 9, t], 2) == [9, t]
    assert proposer.lookup([a, b, 7, 8, t], 2) == []
    large = [70_000, 131_071, 5, 70_000, 131_071]  # ids past 16 bits
    assert NgramProposer(1, 2).lookup(large, 3) == [5, 70_000, 131_071]


def test_arrays_follow_the_growing_sequences():
    rng = random.Random(0)
    proposer = NgramProposer(2, 4)
    seqs = [Sequence(f"r{i}", [rng.randrange(4) for _ in range(5 + i)]) for i in range(3)]
    for _ in range(60):  # the buffers start small: this outgrows them
        drafts = proposer.propose(seqs, [3, 0, 2])
        for seq, k, got in zip(seqs, [3, 0, 2], drafts):
            assert got == (prompt_lookup(seq.token_ids, k, 2, 4) if k else [])
        for seq in seqs:
            seq.token_ids.extend(rng.randrange(4) for _ in range(rng.randrange(1, 4)))
    proposer.finish(seqs[0])
    assert seqs[0].seq_id not in proposer.arrays
