"""BlockManager: allocation, refcounts, hash-chained prefix reuse, LRU eviction, no leaks."""

import random

import pytest

from tinypaged.scheduler import BlockManager, Sequence, hash_block

BS = 4


def run(bm: BlockManager, seq: Sequence, num_tokens: int, hits=()) -> None:
    """Allocate and 'compute' num_tokens more tokens of seq, as one engine step would."""
    assert bm.allocate(seq, num_tokens, hits)
    seq.num_computed_tokens += num_tokens
    bm.mark_computed(seq)


def prefill(bm: BlockManager, seq: Sequence) -> list[int]:
    """Admit seq taking its prefix hits, compute the rest; returns the hit blocks."""
    hits = bm.find_cached_prefix(seq)
    run(bm, seq, len(seq.token_ids) - len(hits) * BS, hits)
    return hits


def test_hash_is_chained_and_stable():
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, [1, 2, 3, 4])  # deterministic (no per-process salt)
    assert a != hash_block(None, [1, 2, 3, 5])
    # The same block tokens under different parents hash differently: a hash names a whole prefix.
    assert hash_block(a, [9, 9, 9, 9]) != hash_block(hash_block(None, [0, 2, 3, 4]), [9, 9, 9, 9])


def test_allocate_grows_table_and_free_returns_blocks():
    bm = BlockManager(8, BS)
    seq = Sequence("r", list(range(10)))
    run(bm, seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    run(bm, seq, 2)  # 12 tokens still fit in 3 blocks
    assert len(seq.block_table) == 3
    run(bm, seq, 1)
    assert len(seq.block_table) == 4
    bm.check_invariants([seq])
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == [] and seq.num_computed_tokens == 0
    bm.check_invariants([])


def test_shared_prefix_reuses_blocks_with_refcounts():
    bm = BlockManager(32, BS)
    prefix = list(range(100, 120))  # 5 full blocks
    a = Sequence("a", prefix + [1, 2, 3])
    b = Sequence("b", prefix + [7, 8, 9, 10, 11])
    assert prefill(bm, a) == []
    hits = prefill(bm, b)
    assert hits == a.block_table[:5]
    assert b.num_computed_tokens == len(b.token_ids)
    assert all(bm.ref_counts[blk] == 2 for blk in hits)
    assert set(b.block_table[5:]).isdisjoint(a.block_table)
    bm.check_invariants([a, b])
    bm.free(a)
    assert all(bm.ref_counts[blk] == 1 for blk in hits)
    bm.free(b)
    assert bm.num_free_blocks == 32
    bm.check_invariants([])


def test_identical_prompt_still_computes_its_last_token():
    bm = BlockManager(16, BS)
    a = Sequence("a", list(range(16)))  # exactly 4 full blocks
    prefill(bm, a)
    b = Sequence("b", list(range(16)))
    hits = bm.find_cached_prefix(b)
    assert len(hits) == 3  # the 4th block holds the last token, which must run for its logits
    run(bm, b, 4, hits)
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] != a.block_table[3]


def test_decode_filled_blocks_become_cached():
    bm = BlockManager(16, BS)
    a = Sequence("a", [1, 2, 3])
    prefill(bm, a)
    for tok in [4, 5, 6]:  # decode: each sampled token is computed in the next step
        a.append_token(tok)
        run(bm, a, 1)
    assert a.num_computed_tokens == 6 and len(bm.cached) == 1  # block [1, 2, 3, 4]
    a.append_token(7)
    a.append_token(8)
    run(bm, a, 2)  # [5, 6, 7, 8] is now full and computed
    assert len(bm.cached) == 2
    b = Sequence("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.find_cached_prefix(b) == a.block_table[:2]


def test_partial_or_uncomputed_blocks_are_not_shared():
    bm = BlockManager(16, BS)
    a = Sequence("a", list(range(12)))
    run(bm, a, 6)  # chunked prefill: only block 0 is full and computed
    b = Sequence("b", list(range(12)) + [99])
    assert bm.find_cached_prefix(b) == a.block_table[:1]


def test_freed_cached_blocks_stay_reusable_until_evicted():
    bm = BlockManager(6, BS)
    a = Sequence("a", list(range(9)))
    prefill(bm, a)  # 3 blocks, 2 of them full and cached
    bm.free(a)
    assert bm.num_free_blocks == 6 and len(bm.evictable) == 2
    b = Sequence("b", list(range(9)))
    hits = bm.find_cached_prefix(b)
    assert len(hits) == 2
    assert not bm.can_allocate(b, 4 * BS + 2, hits)  # the hits come out of the free pool
    run(bm, b, 1, hits)
    assert len(bm.evictable) == 0 and bm.num_free_blocks == 3
    bm.check_invariants([b])


def test_uncached_free_blocks_go_before_cached_ones_and_eviction_is_lru():
    bm = BlockManager(8, BS)
    a = Sequence("a", list(range(100, 109)))  # blocks a0 a1 full, a2 partial
    b = Sequence("b", list(range(200, 209)))
    prefill(bm, a)
    prefill(bm, b)
    a_full, b_full = a.block_table[:2], b.block_table[:2]
    bm.free(a)  # tail first: a1 is evicted before a0
    bm.free(b)
    assert list(bm.evictable) == [a_full[1], a_full[0], b_full[1], b_full[0]]
    # 4 uncached free blocks are handed out before any cached block is evicted.
    c = Sequence("c", list(range(300, 316)))
    run(bm, c, 16)
    assert len(bm.cached) == 4 + 4 and len(bm.free_block_ids) == 0
    d = Sequence("d", list(range(400, 409)))
    run(bm, d, 9)  # needs 3 blocks: evicts the three least recently used
    assert set(d.block_table) == {a_full[1], a_full[0], b_full[1]}
    assert bm.find_cached_prefix(Sequence("x", list(range(100, 109)))) == []
    assert bm.find_cached_prefix(Sequence("y", list(range(200, 209)))) == b_full[:1]
    bm.check_invariants([c, d])


def test_reused_block_moves_to_the_lru_tail():
    bm = BlockManager(4, BS)
    a = Sequence("a", list(range(5)))
    b = Sequence("b", list(range(50, 55)))
    prefill(bm, a)
    prefill(bm, b)
    bm.free(a)
    bm.free(b)
    a0 = bm.find_cached_prefix(Sequence("a2", list(range(5))))[0]
    b0 = bm.find_cached_prefix(Sequence("b2", list(range(50, 55))))[0]
    assert list(bm.evictable)[-2:] == [a0, b0]
    again = Sequence("a3", list(range(5)))
    prefill(bm, again)  # touch a0
    bm.free(again)
    assert list(bm.evictable)[-2:] == [b0, a0]


def test_duplicate_content_computed_concurrently_stays_private():
    bm = BlockManager(8, BS)
    a = Sequence("a", list(range(9)))
    b = Sequence("b", list(range(9)))
    # Both admitted before either computed anything: no hits for b.
    assert bm.allocate(a, 9) and bm.allocate(b, 9)
    for s in (a, b):
        s.num_computed_tokens = 9
        bm.mark_computed(s)
    assert len(bm.cached) == 2 and all(bm.block_hash[blk] is None for blk in b.block_table)
    bm.free(b)
    assert len(bm.free_block_ids) == 8 - 3  # b's blocks went back uncached
    bm.check_invariants([a])


def test_allocate_failure_changes_nothing():
    bm = BlockManager(3, BS)
    a = Sequence("a", list(range(9)))
    prefill(bm, a)
    bm.free(a)
    b = Sequence("b", list(range(9)) + list(range(50, 60)))
    hits = bm.find_cached_prefix(b)
    assert not bm.allocate(b, 19 - len(hits) * BS, hits)
    assert b.block_table == [] and b.num_computed_tokens == 0 and len(bm.evictable) == 2
    bm.check_invariants([])


def test_prefix_caching_off_never_shares():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    a = Sequence("a", list(range(20)))
    prefill(bm, a)
    assert bm.find_cached_prefix(Sequence("b", list(range(20)))) == [] and not bm.cached
    bm.free(a)
    assert len(bm.free_block_ids) == 16


def test_check_invariants_catches_corruption():
    bm = BlockManager(4, BS)
    a = Sequence("a", [1, 2, 3, 4, 5])
    prefill(bm, a)
    bm.check_invariants([a])
    with pytest.raises(AssertionError, match="holders"):
        bm.check_invariants([])  # a's blocks would be leaked
    bm.ref_counts[a.block_table[0]] += 1
    with pytest.raises(AssertionError, match="ref_count"):
        bm.check_invariants([a])


def test_random_operations_keep_invariants_and_never_leak():
    rng = random.Random(0)
    bm = BlockManager(24, BS)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 14))] for _ in range(4)]
    live: list[Sequence] = []
    for i in range(400):
        op = rng.random()
        if op < 0.4:
            seq = Sequence(
                f"r{i}", rng.choice(prefixes) + [rng.randrange(50)] * rng.randrange(1, 6)
            )
            hits = bm.find_cached_prefix(seq)
            n = rng.randrange(1, len(seq.token_ids) - len(hits) * BS + 1)
            if bm.allocate(seq, n, hits):
                seq.num_computed_tokens += n
                bm.mark_computed(seq)
                live.append(seq)
        elif op < 0.8 and live:
            seq = rng.choice(live)
            if seq.num_uncomputed_tokens == 0:
                seq.append_token(rng.randrange(50))
            n = rng.randrange(1, seq.num_uncomputed_tokens + 1)
            if bm.allocate(seq, n):
                seq.num_computed_tokens += n
                bm.mark_computed(seq)
        elif live:
            bm.free(live.pop(rng.randrange(len(live))))
        bm.check_invariants(live)
        assert bm.num_free_blocks + sum(1 for b in range(24) if bm.ref_counts[b]) == 24
    for seq in live:
        bm.free(seq)
    assert bm.num_free_blocks == 24
    bm.check_invariants([])
