"""Tensor-parallel layers in one process: ranks in threads whose all-reduce meets at a barrier."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

import tinypaged.distributed.parallel_state as dist


class ThreadAllReduce:
    """all_reduce (and the LM head's column all-gather) across `size` threads; each thread
    sets `rank.value` first."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list[torch.Tensor | None] = [None] * size
        self.rank = threading.local()

    def _exchange(self, x: torch.Tensor, combine) -> torch.Tensor:
        self.slots[self.rank.value] = x
        self.barrier.wait()
        result = combine(self.slots)  # same order on every rank: same result
        self.barrier.wait()  # every rank has read the others' inputs before any is overwritten
        return result

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.copy_(self._exchange(x, lambda slots: torch.stack(slots).sum(0)))

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        return self._exchange(x, lambda slots: torch.cat(slots, dim=1))


def set_tp(monkeypatch, rank: int, size: int) -> None:
    monkeypatch.setattr(dist, "_TP_RANK", rank)
    monkeypatch.setattr(dist, "_TP_SIZE", size)


def run_ranks(reduce: ThreadAllReduce, fns) -> list:
    """Run fns[r]() in one thread per rank; returns their results, re-raising any failure."""

    def target(r):
        reduce.rank.value = r
        done = False
        try:
            result = fns[r]()
            done = True
            return result
        finally:
            if not done:  # free the other ranks waiting at the barrier
                reduce.barrier.abort()

    with ThreadPoolExecutor(len(fns)) as pool:
        futures = [pool.submit(target, r) for r in range(len(fns))]
        return [f.result() for f in futures]
