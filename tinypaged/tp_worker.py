"""A tensor-parallel worker process (ranks 1..N-1) and the step's wire format.

The engine's executor (executor.py) starts `worker_main` in a spawned process per rank and talks
to it over one pipe. Startup messages are pickled tuples; after that every step is one byte
string, `pack_step(StepInput)`:

    int64 header [B, T, max_blocks, S, max_query_len, max_seq_len]
    int64 input_ids[T], positions[T], slot_mapping[T], logits_indices[S]
    int32 query_start_loc[B + 1], seq_lens[B], block_tables[B * max_blocks]

(int64 arrays first, so every array starts aligned to its element size). A decode step of 256
sequences is ~10 KiB plus its block tables. The empty byte string means "stop".

    worker                                        rank 0
    -> ("hello", pid)                              then everyone joins the process group
    load_model (its shard)  -> ("loaded", bytes read)
    <- EngineConfig (max_model_len resolved); ModelRunner (profile, KV min over ranks, graphs)
    -> ("ready", num_blocks)
    <- step bytes ... run each: the same forward as every rank, logits dropped
    <- b"" (stop)           or a closed pipe / a dead parent: exit
    -> ("error", traceback) on any failure, then exit(1) without teardown
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import traceback
from multiprocessing.connection import Connection, wait

import numpy as np
import torch

from tinypaged import distributed
from tinypaged.config import EngineConfig
from tinypaged.runner import ModelRunner, StepInput

_INT64_FIELDS = ("input_ids", "positions", "slot_mapping", "logits_indices")
_INT32_FIELDS = ("query_start_loc", "seq_lens", "block_tables")


def pack_step(step: StepInput) -> bytes:
    """One step's arrays as one byte string (a few KiB for a decode batch)."""
    num_seqs, width = step.block_tables.shape
    header = np.array([num_seqs, len(step.input_ids), width, len(step.logits_indices),
                       step.max_query_len, step.max_seq_len], dtype=np.int64)
    parts = [header] + [getattr(step, f).astype(np.int64, copy=False) for f in _INT64_FIELDS]
    parts += [getattr(step, f).astype(np.int32, copy=False) for f in _INT32_FIELDS]
    return b"".join(np.ascontiguousarray(p).tobytes() for p in parts)


def unpack_step(payload: bytes) -> StepInput:
    buf = bytearray(payload)  # writable, so torch.from_numpy takes the arrays without a warning
    num_seqs, num_tokens, width, num_sampled, max_query_len, max_seq_len = (
        np.frombuffer(buf, np.int64, 6).tolist()
    )
    sizes = {"input_ids": num_tokens, "positions": num_tokens, "slot_mapping": num_tokens,
             "logits_indices": num_sampled, "query_start_loc": num_seqs + 1,
             "seq_lens": num_seqs, "block_tables": num_seqs * width}
    arrays, offset = {}, 48
    for name in _INT64_FIELDS + _INT32_FIELDS:
        dtype = np.int64 if name in _INT64_FIELDS else np.int32
        arrays[name] = np.frombuffer(buf, dtype, sizes[name], offset)
        offset += arrays[name].nbytes
    arrays["block_tables"] = arrays["block_tables"].reshape(num_seqs, width)
    return StepInput(**arrays, max_query_len=max_query_len, max_seq_len=max_seq_len)


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
                 device: torch.device, config: EngineConfig, conn: Connection) -> None:
    """Rank `rank`: join the group, load the shard, build the runner, then run every step rank
    0 sends until the empty message (stop) or the end of the pipe (engine gone)."""
    from tinypaged.models.loader import load_model

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every process of the terminal
    _exit_with_parent()
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:  # share the cores with the other ranks instead of oversubscribing them
            torch.set_num_threads(max(1, torch.get_num_threads() // world_size))
        conn.send(("hello", os.getpid()))
        distributed.init_tp(rank, world_size, backend, init_method)
        stats: dict = {}
        model, _, _ = load_model(config, device, stats)
        conn.send(("loaded", stats.get("bytes_read", 0)))
        config = conn.recv()  # the engine's final config (max_model_len resolved)
        torch.manual_seed(config.seed)
        runner = ModelRunner(config, model, device, next(model.parameters()).dtype)
        conn.send(("ready", runner.kv_cache_info.num_blocks))
        while payload := conn.recv_bytes():
            runner.execute(unpack_step(payload))
    except EOFError:  # rank 0 closed the pipe (or stopped us during startup): just leave
        os._exit(0)
    except BaseException:  # sent to rank 0, which raises it
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        os._exit(1)  # no teardown: a collective with the other ranks could hang
    distributed.destroy_tp()
