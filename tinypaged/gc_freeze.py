"""Keep Python's cycle collector off the long-lived heap of a serving process (as vLLM's
freeze_gc_heap does).

A process that imported torch, transformers and Triton and built a model holds several hundred
thousand container objects that live as long as the process. Each full (generation 2)
collection walks all of them, for hundreds of milliseconds, and while it runs every stream
waits: under load `tinypaged serve` showed stalls of every open stream at the same moment, the
size of a full collection, and they went away with the heap frozen (benchmarks/RESULTS.md;
TINYPAGED_GC_DEBUG below times the collections). `freeze_gc_heap()` collects once, then moves
every live object into the permanent generation, which later collections skip. Objects made
afterwards are collected as usual.

It is called only where a process lives exactly as long as its engine: the engine process of
`tinypaged serve`, the API server's process, and tensor-parallel workers. A forked worker
freezes without collecting first. A collection there would also free the garbage it inherited
from the parent, such as an earlier engine, and run those objects' finalizers. A finalizer can
wait on a lock that a thread of the parent held at the fork. That thread does not exist in the
child, so the worker would hang (seen in tests/distributed/test_tp.py). `LLM(...)` does not call it,
because the user's process outlives the engine, and the frozen cycles of a dropped engine would
never be freed. Code that must free a frozen cycle calls `gc.unfreeze()` first
(ModelRunner.release_graphs: a live decode graph that holds an all-reduce keeps NCCL from
leaving its group).

TINYPAGED_GC_DEBUG=1 logs every full collection of these processes with its duration (as vLLM's
VLLM_GC_DEBUG), so a pause in a serving benchmark can be told apart from a slow step.
"""

from __future__ import annotations

import gc
import logging
import os
import time

from tinypaged import envs

logger = logging.getLogger(__name__)


def freeze_gc_heap(collect: bool = True) -> None:
    """Freeze every live object (after one full collection, unless `collect` is False)."""
    if envs.TINYPAGED_GC_DEBUG and _log_full_collection not in gc.callbacks:
        gc.callbacks.append(_log_full_collection)
    if collect:
        gc.collect()
    gc.freeze()


_start = [0.0]


def _log_full_collection(phase: str, info: dict) -> None:
    if info["generation"] != 2:
        return
    if phase == "start":
        _start[0] = time.perf_counter()
    else:
        logger.warning("gc: full collection in process %d took %.1f ms (%d objects frozen)",
                       os.getpid(), (time.perf_counter() - _start[0]) * 1e3, gc.get_freeze_count())
