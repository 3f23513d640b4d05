"""How many threads torch's intra-op pool gets on the CPU.

torch sizes its pool from the machine's cores, not from the cores this process may use, and the
engine's own threads (the step loop; the server's event loop and its engine thread) then compete
with that pool for the same cores. On a loaded 2-core machine that collapses decode (measured:
examples/offline_batch.py at 1.5 tok/s with two intra-op threads, ~14 tok/s with one;
benchmarks/RESULTS.md). So on the CPU the engine sets the pool to:

    cpu_threads            when given (LLM(cpu_threads=N), --cpu-threads N)
    $OMP_NUM_THREADS       when set (the standard knob; torch reads it too)
    usable cores - 1       else, at least 1: the cores of os.sched_getaffinity (a container's
                           or taskset's share, not the machine's), one left to the engine's and
                           the server's threads

On a GPU only an explicit cpu_threads changes anything (the host does little arithmetic there).
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), else the machine's."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS, Windows: no affinity call
        return max(1, os.cpu_count() or 1)


def omp_num_threads() -> int | None:
    """$OMP_NUM_THREADS as a positive int, or None when unset or not one."""
    text = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def default_cpu_threads() -> int:
    """The intra-op threads on the CPU when cpu_threads is not given (module docstring)."""
    return omp_num_threads() or max(1, usable_cores() - 1)


def apply_cpu_threads(cpu_threads: int | None, device_type: str) -> int | None:
    """Set torch's intra-op threads for an engine on `device_type`; return the count set, or
    None when left alone (a GPU engine without an explicit cpu_threads)."""
    if cpu_threads is None and device_type != "cpu":
        return None
    import torch

    threads = cpu_threads or default_cpu_threads()
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
        logger.info("torch CPU threads: %d (of %d usable cores)", threads, usable_cores())
    return threads
