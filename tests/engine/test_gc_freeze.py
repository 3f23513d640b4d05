"""gc_freeze.py: a serving process's heap leaves the cycle collector's full walks."""

from __future__ import annotations

import gc
import logging
import time

import pytest

from tinypaged.gc_freeze import _log_full_collection, freeze_gc_heap


@pytest.fixture
def thawed():
    yield
    gc.unfreeze()
    while _log_full_collection in gc.callbacks:
        gc.callbacks.remove(_log_full_collection)


def full_collection_ms() -> float:
    start = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - start) * 1e3


def test_frozen_objects_are_skipped_by_full_collections(thawed):
    heap = [[i] for i in range(300_000)]  # long-lived containers, as a loaded engine's
    before = min(full_collection_ms() for _ in range(3))
    freeze_gc_heap()
    assert gc.get_freeze_count() > len(heap)
    after = min(full_collection_ms() for _ in range(3))
    assert after < before / 4, (before, after)
    # objects made afterwards are still collected
    cycle = [[]]
    cycle[0].append(cycle)
    del cycle
    assert gc.collect() >= 2


def test_without_collecting_first_garbage_stays_frozen(thawed):
    cycle = [[]]
    cycle[0].append(cycle)
    del cycle
    freeze_gc_heap(collect=False)  # a forked worker: its parent's garbage is not touched
    assert gc.collect() == 0


def test_debug_logs_every_full_collection(thawed, monkeypatch, caplog):
    monkeypatch.setenv("TINYPAGED_GC_DEBUG", "1")
    freeze_gc_heap()
    freeze_gc_heap()  # the callback is installed once
    assert gc.callbacks.count(_log_full_collection) == 1
    caplog.clear()  # the freezes' own collections were logged too
    with caplog.at_level(logging.WARNING, logger="tinypaged.gc_freeze"):
        gc.collect(1)
        gc.collect(2)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "full collection in process" in lines[0], lines
