"""The data-parallel router on its own (dp/router.py): prefixes stick to the engine that served
them, load breaks the tie and caps the stickiness, dead engines are skipped."""

from __future__ import annotations

import pytest

from tinypaged.dp.router import Router, prefix_hashes

BS = 4


def ids(prefix: int, n_blocks: int, tail: int = 0) -> list[int]:
    return [prefix * 1000 + i for i in range(n_blocks * BS)] + [7] * tail


def test_prefix_hashes_chain_and_skip_partial_blocks():
    a, b = prefix_hashes(ids(1, 3, tail=2), BS), prefix_hashes(ids(1, 2), BS)
    assert len(a) == 3 and a[:2] == b  # the partial last block is not hashed
    c = ids(1, 3)
    c[0] = 99  # a different first token changes every later hash
    assert not set(prefix_hashes(c, BS)) & set(a)
    assert prefix_hashes({"prompt_token_ids": ids(1, 2)}, BS) == b
    assert len(prefix_hashes("x" * 130, BS)) == 2 and prefix_hashes([1, 2], BS) == []


def test_cache_aware_sends_a_prefix_back_to_its_engine():
    r = Router(3, BS)
    first = [r.choose(ids(p, 4)) for p in range(3)]
    assert sorted(first) == [0, 1, 2]  # no prefix known: the least loaded, in turn
    for p in range(3):
        assert r.choose(ids(p, 4, tail=3)) == first[p]  # same prefix, longer prompt
        assert r.choose({"prompt_token_ids": ids(p, 2)}) == first[p]  # a shorter one
    assert r.cache_hits == 6 and r.load == [3, 3, 3]


def test_an_overloaded_engine_loses_its_prefix_to_the_least_loaded():
    r = Router(2, BS, balance_abs=2, balance_rel=1.5)
    home = r.choose(ids(1, 4))
    for _ in range(2):  # within the band: stays home
        assert r.choose(ids(1, 4)) == home
    assert r.load[home] == 3 and r.load[1 - home] == 0
    assert r.choose(ids(1, 4)) == 1 - home  # 3 - 0 > 2 and 3 > 1.5 * 0
    assert r.choose(ids(1, 4)) == 1 - home  # the prefix moved with it
    r.finished(1 - home)
    r.finished(1 - home)
    assert r.load[home] == 3 and r.load[1 - home] == 0 and r.routed[1 - home] == 2


def test_round_robin_and_least_loaded_ignore_prefixes():
    rr = Router(2, BS, policy="round_robin")
    assert [rr.choose(ids(1, 4)) for _ in range(4)] == [0, 1, 0, 1]
    ll = Router(2, BS, policy="least_loaded")
    a = ll.choose(ids(1, 4))
    assert ll.choose(ids(1, 4)) == 1 - a
    ll.finished(a)
    assert ll.choose(ids(1, 4)) == a and ll.cache_hits == 0
    with pytest.raises(ValueError, match="round_robin"):
        Router(2, BS, policy="random")


def test_a_dead_engine_is_never_chosen():
    r = Router(2, BS)
    home = r.choose(ids(1, 4))
    r.mark_dead(home)
    assert {r.choose(ids(1, 4)) for _ in range(3)} == {1 - home}
    r.mark_dead(1 - home)
    with pytest.raises(RuntimeError, match="every data-parallel engine has stopped"):
        r.choose(ids(1, 4))
