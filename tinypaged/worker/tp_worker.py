"""A tensor-parallel worker process (ranks 1..N-1): how it starts, its loop, the step's format.

The engine's executor (executor.py) starts `worker_main` in a process per rank and talks to it
over one pipe: start-up messages are pickled tuples. Every step is then one byte string,
`pack_step(StepInput)`, broadcast through shared memory (distributed/shm_broadcast.py):

    int64 header [B, T, max_blocks, S, max_query_len, max_seq_len, P, V, W]
    int64 input_ids[T], positions[T], slot_mapping[T], logits_indices[S],
          prev_sample_indices[P] (P = T when the step has placeholders, else 0),
          verify_rows[B], verify_assumed[B] (V = 1: behind an overlapped verification)
    int32 query_start_loc[B + 1], seq_lens[B], block_tables[B * max_blocks]

(W: the width of the overlapped verification's tokens that rank 0 broadcasts after the step,
0 for none.)

(int64 arrays first, so every array starts aligned to its element size). A decode step of 256
sequences is ~10 KiB plus its block tables. The empty byte string means "stop".

    worker (<- -> the pipe, <= shared memory;     rank 0
            -> (kind, value): a WorkerReport)
    map the shm ring; -> ("hello", pid)           then everyone joins the process group
    load_model (its shard)  -> ("loaded", bytes read)
    <- EngineConfig (max_model_len resolved); ModelRunner (profile, KV min over ranks, graphs)
    -> ("ready", num_blocks)
    <= step bytes ... run each: the same forward as every rank, logits dropped; with async
                      scheduling, then receive rank 0's sampled ids (a broadcast on the device),
                      and after an overlapped verification (W > 0) its emitted tokens
    <= b"" (stop)           -> ("stopping", pid), then leave the group with rank 0 and exit
    <- a closed pipe / a dead parent: exit without teardown
    -> ("error", traceback) on any failure, then exit(1) without teardown

Start method. Like vLLM, workers are forked while CUDA is not initialized in the engine's
process: fork is fast and runs nothing of the user's script again. A process that already
initialized the CUDA driver (cuInit: torch did, or anything called torch.cuda.is_available())
cannot fork a child that uses CUDA, so then the workers are spawned, and a spawned child imports
the script that started the engine again: the engine must be built under
`if __name__ == "__main__":` (checked before any process starts). TINYPAGED_WORKER_MULTIPROC_METHOD
("fork" or "spawn") overrides the choice, as VLLM_WORKER_MULTIPROC_METHOD does.
"""

from __future__ import annotations

import ast
import ctypes
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Literal

import numpy as np
import torch

from tinypaged import envs
from tinypaged.config import EngineConfig
from tinypaged.distributed import parallel_state as distributed
from tinypaged.distributed.shm_broadcast import ShmBroadcast
from tinypaged.gc_freeze import freeze_gc_heap
from tinypaged.worker.gpu_memory import free_at_start
from tinypaged.worker.model_runner import StepInput
from tinypaged.worker.pipeline import runner_class

LEAVE_TIMEOUT_S = 10.0  # how long a stopping worker waits to leave the group with rank 0

_INT64_FIELDS = ("input_ids", "positions", "slot_mapping", "logits_indices",
                 "prev_sample_indices")
_INT32_FIELDS = ("query_start_loc", "seq_lens", "block_tables")
_VERIFY_FIELDS = ("verify_rows", "verify_assumed")  # int64, behind an overlapped verification


@dataclass(frozen=True)
class WorkerReport:
    """What a worker tells rank 0 over its pipe, in this order: "hello" (its pid), "loaded" (the
    checkpoint bytes it read), "ready" (the KV blocks it can hold), and at the end "stopping"
    (its pid); "error" (its traceback) may come at any point, and is its last word."""

    kind: Literal["hello", "loaded", "ready", "stopping", "error"]
    value: int | str


def pack_step(step: StepInput) -> bytes:
    """One step's arrays as one byte string (a few KiB for a decode batch)."""
    num_seqs, width = step.block_tables.shape
    prev = step.prev_sample_indices
    prev = np.empty(0, np.int64) if prev is None else prev
    verify = step.verify_rows is not None  # behind an overlapped verification
    header = np.array([num_seqs, len(step.input_ids), width, len(step.logits_indices),
                       step.max_query_len, step.max_seq_len, len(prev), verify,
                       step.broadcast_verified], dtype=np.int64)
    parts = [header] + [getattr(step, f).astype(np.int64, copy=False) for f in _INT64_FIELDS[:-1]]
    parts.append(prev)
    if verify:
        parts += [getattr(step, f).astype(np.int64, copy=False) for f in _VERIFY_FIELDS]
    parts += [getattr(step, f).astype(np.int32, copy=False) for f in _INT32_FIELDS]
    lora = b"" if step.lora is None else pickle.dumps(step.lora)  # after the arrays
    return b"".join(np.ascontiguousarray(p).tobytes() for p in parts) + lora


def unpack_step(payload: bytes) -> StepInput:
    buf = bytearray(payload)  # writable, so torch.from_numpy takes the arrays without a warning
    (num_seqs, num_tokens, width, num_sampled, max_query_len, max_seq_len, num_prev, verify,
     broadcast_verified) = np.frombuffer(buf, np.int64, 9).tolist()
    sizes = {"input_ids": num_tokens, "positions": num_tokens, "slot_mapping": num_tokens,
             "logits_indices": num_sampled, "prev_sample_indices": num_prev,
             "query_start_loc": num_seqs + 1, "seq_lens": num_seqs,
             "block_tables": num_seqs * width, "verify_rows": num_seqs,
             "verify_assumed": num_seqs}
    arrays, offset = {}, 72
    for name in _INT64_FIELDS + (_VERIFY_FIELDS if verify else ()) + _INT32_FIELDS:
        dtype = np.int32 if name in _INT32_FIELDS else np.int64
        arrays[name] = np.frombuffer(buf, dtype, sizes[name], offset)
        offset += arrays[name].nbytes
    arrays["block_tables"] = arrays["block_tables"].reshape(num_seqs, width)
    if not num_prev:
        arrays["prev_sample_indices"] = None
    lora = pickle.loads(bytes(buf[offset:])) if offset < len(buf) else None
    return StepInput(**arrays, max_query_len=max_query_len, max_seq_len=max_seq_len, lora=lora,
                     broadcast_verified=broadcast_verified)


def start_method() -> str:
    """"fork" while this process has not initialized CUDA, else "spawn" (or the value of
    TINYPAGED_WORKER_MULTIPROC_METHOD). Raises RuntimeError at once when spawned workers would
    build the engine again from the top level of the user's script."""
    method = envs.TINYPAGED_WORKER_MULTIPROC_METHOD or (
        "spawn" if _cuda_initialized() else "fork")
    if method == "spawn" and (line := _unguarded_main_line()) is not None:
        raise RuntimeError(
            f"tensor_parallel_size > 1 in a process that already initialized CUDA starts its "
            f"workers with 'spawn', which runs your script again: move line {line} of "
            f"{sys.modules['__main__'].__file__} (and the code that uses the engine) under "
            f"`if __name__ == \"__main__\":`"
        )
    return method


@contextmanager
def sigint_held_back() -> Iterator[None]:
    """Start worker processes inside: SIGINT is blocked in this thread meanwhile, and a child
    inherits the mask. A Ctrl-C reaches every process of the terminal's process group; one that
    comes while a worker is still in its bootstrap (a spawned one imports torch and the script
    for seconds) then stays pending there until `worker_main` ignores SIGINT, which discards it,
    instead of killing the worker with a traceback. In this process the signal is not lost:
    another thread takes it, or it arrives when the mask is lifted (resource_tracker in the
    standard library starts its process the same way)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _cuda_initialized() -> bool:
    """Whether this process has initialized the CUDA driver, by whatever means. Asks the driver
    itself: before cuInit, cuDeviceGetCount answers CUDA_ERROR_NOT_INITIALIZED (3)."""
    if torch.cuda.is_initialized():
        return True
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:  # no NVIDIA driver: nothing to initialize
        return False
    return libcuda.cuDeviceGetCount(ctypes.byref(ctypes.c_int())) != 3


def _unguarded_main_line() -> int | None:
    """The line of the script's top-level statement now running, if that statement is outside
    `if __name__ == "__main__":` and a spawned child would run it again; else None."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    name = getattr(getattr(main, "__spec__", None), "name", "") or ""
    if path is None or name == "__main__" or name.endswith(".__main__"):
        return None  # an interactive session or `python -m package`: spawn imports no script
    frame = sys._getframe()
    while frame is not None and not (frame.f_globals is vars(main)
                                     and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None:  # the script's top level has finished running
        return None
    try:
        tree = ast.parse(open(path).read())
    except (OSError, SyntaxError, ValueError):
        return None
    line = frame.f_lineno
    for node in tree.body:
        if isinstance(node, ast.If) and node.lineno <= line <= node.end_lineno and (
            ast.unparse(node.test).replace("'", '"') in
            ('__name__ == "__main__"', '"__main__" == __name__')
        ):
            return None
    return line


def _exit_with_parent() -> None:
    """A daemon thread that ends this worker when the engine process is gone, however it went
    (a SIGKILLed engine cannot stop its workers)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="tinypaged-parent-watch", daemon=True).start()


def worker_main(rank: int, world_size: int, backend: str, init_method: str,
                device: torch.device, config: EngineConfig, conn: Connection,
                channel_path: str) -> None:
    """Rank `rank`: join the group, load the shard, build the runner, then run every step rank
    0 sends until the empty message (stop: leave the group with rank 0) or the end of the pipe
    (engine gone)."""
    from tinypaged.models.loader import load_model

    # Ctrl-C reaches every process of the terminal; rank 0 alone decides when the workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # see sigint_held_back
    # a forked worker's signals are not the engine's (distributed/sigint_watch.py)
    signal.set_wakeup_fd(-1)
    _exit_with_parent()
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:  # share the cores with the other ranks instead of oversubscribing them
            torch.set_num_threads(max(1, torch.get_num_threads() // world_size))
        channel = ShmBroadcast.attach(channel_path, world_size - 1, rank - 1)
        conn.send(WorkerReport("hello", os.getpid()))
        distributed.init_tp(rank, world_size, backend, init_method,
                            custom_all_reduce=not config.disable_custom_all_reduce,
                            pipeline_parallel_size=config.pipeline_parallel_size)
        stats: dict = {}
        start = free_at_start(config, device)
        model, _, _ = load_model(config, device, stats)
        conn.send(WorkerReport("loaded", stats.get("bytes_read", 0)))
        config = conn.recv()  # the engine's final config (max_model_len resolved)
        torch.manual_seed(config.seed)
        runner = runner_class(config)(config, model, device, next(model.parameters()).dtype,
                                      start)
        freeze_gc_heap(collect=False)  # lives as long as its engine; forked (gc_freeze.py)
        conn.send(WorkerReport("ready", runner.kv_cache_info.num_blocks))
        while payload := channel.recv(conn):
            step = unpack_step(payload)
            runner.execute(step)
            if runner.broadcast_sampled:  # the next step's placeholders read rank 0's samples
                runner.keep_sampled(None)
            if step.broadcast_verified:  # and an overlapped verification's, its tokens
                runner.keep_verified(None, step.broadcast_verified)
        runner.release_graphs()  # NCCL cannot leave while a graph holds a collective
        # rank 0 destroys the group once all have said so
        conn.send(WorkerReport("stopping", os.getpid()))
    except EOFError:  # rank 0 closed the pipe (or stopped us during startup): just leave
        os._exit(0)
    except BaseException:  # sent to rank 0, which raises it
        try:
            conn.send(WorkerReport("error", traceback.format_exc()))
        except OSError:
            pass
        os._exit(1)  # no teardown: a collective with the other ranks could hang
    os._exit(0 if distributed.leave_tp(graceful=True, timeout_s=LEAVE_TIMEOUT_S) else 1)
