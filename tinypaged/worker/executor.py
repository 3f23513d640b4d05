"""Executors: how the engine runs the model, in its own process or over N tensor-parallel ranks.

    executor = create_executor(config, device)  # builds and loads the model on every rank
    executor.model, executor.hf_config, executor.model_dir   # rank 0's shard, the checkpoint's
    runner = executor.init_runner()             # once config.max_model_len is final
    logits = executor.execute(scheduled)        # [rows, vocab], model dtype (input_batch.py)
    tokens = executor.keep_sampled(sampled)     # the sampled ids: kept on the device for the
    token_ids = executor.collect(tokens)        #   next step, then waited for on the host
    submitted = executor.submit(scheduled)      # pipeline parallelism: the earlier stages
    logits = submitted.result()                 #   start at once, the last one runs here
    executor.shutdown()

UniprocExecutor (tensor_parallel_size 1): the model and its ModelRunner live in the engine's
process and `execute` is `runner.execute(runner.build_step(scheduled))`. No process group, no
other process.

MultiprocExecutor (N = tensor_parallel_size * pipeline_parallel_size > 1; pipeline.py for the
stages): rank 0 is the engine's process (it also hosts the scheduler and the
sampler); ranks 1..N-1 are worker processes (forked, or spawned once CUDA is initialized here:
tp_worker.start_method) joined in one torch.distributed group: "nccl" with rank r on
cuda:(i + r) when the engine runs on cuda:i, "gloo" on the CPU.

    rank 0 (engine process)                      worker r = 1..N-1
    start the workers; join the group            join the group
    load_model: its shard                        load_model: its shard            -> "loaded"
    send the final config; ModelRunner           ModelRunner: profile, KV blocks = min over
      (the same collectives)                       ranks, CUDA graphs              -> "ready"
    per step: build_step (numpy) --bytes, shm--> unpack_step
              execute (its shard) <--all-reduces--> execute (its shard)
              logits -> sampler                           logits dropped
              (async scheduling) sampled ids --broadcast--> sampled ids, for the next step

A step's arrays travel as one byte string (tp_worker.py holds the format and the worker's loop),
written once into a shared-memory ring that every worker polls (distributed/shm_broadcast.py); the
pipes carry start-up messages and errors. All ranks run the same forward on the same arrays, so
their collectives line up and their block tables agree; each rank's KV cache holds its own KV heads
only.

Failures. A watchdog thread waits on the worker processes: when one dies (crash, OOM, kill), the
step in flight and every later call raise RuntimeError naming the rank, pid and exit status (with
the worker's traceback when it sent one). gloo collectives fail by themselves once the dead
peer's sockets close; NCCL ones are aborted by the watchdog. Startup waits on pipes with
liveness checks rather than blocking in a collective. A failed step leaves the ranks out of
step with each other, so after any failure the executor (and its engine) stays dead.

Shutdown. `shutdown()`, garbage collection of the executor and interpreter exit all run one
finalizer, `_stop`. While every rank is healthy: broadcast "stop"; each worker answers
"stopping" and destroys the group; once all have answered, rank 0 destroys it too, so that
NCCL's finalize meets every rank. When a rank is dead, failed, or did not answer within
STOP_TIMEOUT_S: kill the workers and abort the group (distributed.leave_tp). Every wait is
bounded, so shutdown returns within seconds whatever state the ranks are in. Workers are daemon
processes, ignore Ctrl-C (the engine decides when they stop) and exit by themselves when the
engine process is gone (SIGTERM or SIGKILL of the engine included).

Ctrl-C. The KeyboardInterrupt fails the step it lands in (the other ranks wait in a collective
rank 0 will not join), so the executor stops. When rank 0 itself waits in a collective for a
worker that is stuck, the interrupt cannot surface: a second after the Ctrl-C the workers are
killed, which ends that collective (distributed/sigint_watch.py).
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

import torch

from tinypaged.config import EngineConfig
from tinypaged.distributed import parallel_state as distributed
from tinypaged.distributed.shm_broadcast import SLOT_BYTES, ShmBroadcast
from tinypaged.distributed.sigint_watch import StepWatch
from tinypaged.scheduler import ScheduledSequence
from tinypaged.worker.gpu_memory import free_at_start
from tinypaged.worker.model_runner import ModelRunner, SampledTokens
from tinypaged.worker.pipeline import LastStageQueue, SubmittedStep, check_pipeline, runner_class
from tinypaged.worker.tp_worker import (
    WorkerReport,
    pack_step,
    sigint_held_back,
    start_method,
    worker_main,
)

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 1800.0  # loading a 70B shard from a cold disk, then profiling and capture
STOP_TIMEOUT_S = 10.0  # a stopping worker gets this long to answer, and again to leave and exit
DEATH_GRACE_S = 5.0  # after a failed collective: how long to wait for the watchdog's verdict


def create_executor(config: EngineConfig, device: torch.device):
    """UniprocExecutor for one rank, else MultiprocExecutor (or RayExecutor)."""
    if config.tensor_parallel_size == 1 and config.pipeline_parallel_size == 1:
        return UniprocExecutor(config, device)
    if config.pipeline_parallel_size > 1:  # stages of layers (worker/pipeline.py)
        check_pipeline(config)
    if config.distributed_executor_backend == "ray":  # ranks as Ray actors (ray_executor.py)
        from tinypaged.worker.ray_executor import RayExecutor

        check_shardable(config, config.tensor_parallel_size)
        return RayExecutor(config, device)
    return MultiprocExecutor(config, device)


def _dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


class UniprocExecutor:
    failure: str | None = None  # never fails on its own: errors raise from execute

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        from tinypaged.models.loader import load_model

        self.config, self.device = config, device
        self.free_at_start = free_at_start(config, device)
        self.model, self.hf_config, self.model_dir = load_model(config, device)
        self.runner: ModelRunner | None = None

    def init_runner(self) -> ModelRunner:
        self.runner = ModelRunner(self.config, self.model, self.device, _dtype(self.model),
                                  self.free_at_start)
        return self.runner

    def execute(self, scheduled: list[ScheduledSequence],
                prompt_logits: list[bool] | None = None) -> torch.Tensor:
        return self.runner.execute(self.runner.build_step(scheduled, prompt_logits))

    def keep_sampled(self, sampled: torch.Tensor | None) -> SampledTokens | None:
        return self.runner.keep_sampled(sampled)

    def keep_verified(self, emitted: torch.Tensor) -> None:
        self.runner.keep_verified(emitted)

    def collect(self, tokens: SampledTokens) -> list[int]:
        return tokens.tolist()

    def shutdown(self) -> None:
        pass


# ---------------------------------------------------------------- rank 0's side
def tp_devices(device: torch.device, world_size: int) -> list[torch.device]:
    """Each rank's device: cuda:(i + r) for rank r when the engine runs on cuda:i; on the CPU
    every rank uses the CPU. Raises ValueError when too few GPUs are visible."""
    if device.type != "cuda":
        return [device] * world_size
    first = device.index or 0
    visible = torch.cuda.device_count()
    if first + world_size > visible:
        raise ValueError(
            f"tensor_parallel_size={world_size} needs GPUs cuda:{first}..cuda:"
            f"{first + world_size - 1}, but {visible} GPU(s) are visible; lower "
            "tensor_parallel_size or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
        )
    return [torch.device("cuda", first + r) for r in range(world_size)]


def check_shardable(config: EngineConfig, world_size: int) -> None:
    """Raise the layers' ValueError now if the model does not split over `world_size` ranks
    (heads, KV heads, MLP width), by building it on the meta device: no memory, no workers."""
    from tinypaged.models.loader import load_hf_config, resolve_model
    from tinypaged.models.registry import get_model_class

    hf_config = load_hf_config(resolve_model(config.model))
    with distributed.build_as(0, world_size), torch.device("meta"):
        get_model_class(hf_config)(hf_config)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class _Worker:
    rank: int
    process: multiprocessing.Process
    conn: Connection  # rank 0's end of the pipe


@dataclass
class _Health:
    """What the watchdog, the finalizer and the executor share (never the executor itself, so
    that the executor can be garbage-collected)."""

    failure: str | None = None  # the message every call raises once the group is broken
    dead: _Worker | None = None  # set by the watchdog; described by whoever reads it first
    failed: threading.Event = field(default_factory=threading.Event)
    stopping: bool = False
    runner: ModelRunner | None = None  # rank 0's; its CUDA graphs must go before the group

    @property
    def broken(self) -> bool:
        return self.failure is not None or self.dead is not None

    def fail(self, message: str) -> None:
        if self.failure is None:
            self.failure = message
        self.failed.set()


def _describe_death(worker: _Worker) -> str:
    """'worker rank r (pid p) <how it ended>', with the traceback it sent, if any."""
    proc = worker.process
    proc.join(timeout=1.0)  # its exit code, once the OS has reaped it
    code = proc.exitcode
    if code is None:
        how = "stopped answering (its pipe closed)"
    elif code < 0:
        how = f"was killed by signal {signal.Signals(-code).name}"
    else:
        how = f"exited with code {code}"
    message = f"tensor-parallel worker rank {worker.rank} (pid {proc.pid}) {how}"
    try:
        while worker.conn.poll(0):
            item = worker.conn.recv()
            if isinstance(item, WorkerReport) and item.kind == "error":
                message += f"; its error:\n{item.value}"
    except (EOFError, OSError):
        pass
    return message


def _watch(workers: list[_Worker], health: _Health, wake: Connection) -> None:
    """Watchdog thread: wait until a worker process ends; unless we are stopping, record it and
    abort the NCCL group so that rank 0 is not left waiting in a collective. (It never reads the
    pipes: only the thread that calls the executor does.)"""
    sentinels = {w.process.sentinel: w for w in workers}
    ready = wait([*sentinels, wake])
    dead = [sentinels[s] for s in ready if s in sentinels]
    if dead and not health.stopping:
        health.dead = dead[0]
        health.failed.set()
        distributed.abort_tp()


def _interrupted(workers: list[_Worker], health: _Health) -> None:
    """A Ctrl-C did not get rank 0 out of its step within sigint_watch.GRACE_S: kill the
    workers, so that the collective rank 0 waits in fails (the watchdog aborts NCCL's) and the
    KeyboardInterrupt surfaces."""
    health.fail("tensor-parallel step interrupted (Ctrl-C) while rank 0 waited for the workers")
    for w in workers:
        w.process.kill()


def _stopping(workers: list[_Worker], timeout_s: float) -> bool:
    """True when every worker answered the stop with "stopping" within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    for w in workers:
        try:
            if not w.conn.poll(max(0.0, deadline - time.monotonic())):
                return False
            message = w.conn.recv()
        except (EOFError, OSError):
            return False
        if not (isinstance(message, WorkerReport) and message.kind == "stopping"):
            return False
    return True


def _stop(workers: list[_Worker], channel: ShmBroadcast, health: _Health, wake: Connection,
          graceful: list[bool], owner_pid: int) -> None:
    """The finalizer: stop the watchdog and the workers, leave the process group."""
    if os.getpid() != owner_pid:  # a forked worker's copy of the engine's objects
        return
    health.stopping = True
    try:
        wake.send_bytes(b"")
    except OSError:
        pass
    channel.unlink()
    clean = graceful[0] and not health.broken  # else the workers may be stuck in a collective
    deadline = time.monotonic() + STOP_TIMEOUT_S

    def give_up() -> None:  # while waiting for a free slot
        if time.monotonic() > deadline:
            raise TimeoutError

    if clean:
        try:
            channel.send(b"", lambda r: workers[r].conn, give_up)  # the empty message: stop
        except (TimeoutError, OSError):
            clean = False
    clean = clean and _stopping(workers, STOP_TIMEOUT_S)
    if health.runner is not None:  # NCCL cannot leave while a graph holds a collective
        health.runner.release_graphs()
        health.runner = None
    if clean:  # every rank destroys the group now, each in its own process
        distributed.leave_tp(graceful=True, timeout_s=STOP_TIMEOUT_S)
    deadline = time.monotonic() + (STOP_TIMEOUT_S if clean else 0.0)
    for w in workers:
        w.process.join(timeout=max(0.0, deadline - time.monotonic()))
    for w in workers:
        if w.process.is_alive():
            w.process.kill()
            w.process.join(timeout=5.0)
        w.conn.close()
    if not clean:  # the peers are gone now: abort, never wait on them
        distributed.leave_tp(graceful=False, timeout_s=STOP_TIMEOUT_S)


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        from tinypaged.models.loader import load_model

        world_size = config.tensor_parallel_size * config.pipeline_parallel_size
        devices = tp_devices(device, world_size)
        check_shardable(config, config.tensor_parallel_size)
        backend = "nccl" if device.type == "cuda" else "gloo"
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.config, self.device = config, device
        self.runner: ModelRunner | None = None
        self.health = _Health()
        self.workers: list[_Worker] = []
        self._graceful = [False]  # a clean stop only once every rank is up
        self._watch = StepWatch(functools.partial(_interrupted, self.workers, self.health))
        # Decided last: whatever ran before (imports included) may have initialized CUDA.
        ctx = torch.multiprocessing.get_context(start_method())
        wake_recv, wake_send = ctx.Pipe(duplex=False)
        self.channel = ShmBroadcast(world_size - 1)  # the steps, to every worker
        self._finalizer = weakref.finalize(
            self, _stop, self.workers, self.channel, self.health, wake_send, self._graceful,
            os.getpid(),
        )
        try:
            for rank in range(1, world_size):
                conn, child_conn = ctx.Pipe()
                process = ctx.Process(
                    target=worker_main, name=f"tinypaged-tp{rank}", daemon=True,
                    args=(rank, world_size, backend, init_method, devices[rank], config,
                          child_conn, self.channel.path),
                )
                with sigint_held_back():
                    process.start()
                child_conn.close()  # so that the worker's death reads as EOF here
                self.workers.append(_Worker(rank, process, conn))
            threading.Thread(target=_watch, args=(self.workers, self.health, wake_recv),
                             name="tinypaged-tp-watchdog", daemon=True).start()
            self._receive("hello")  # every worker is up before rank 0 waits in the rendezvous
            self.channel.unlink()  # every worker has mapped it
            if device.type == "cuda":
                torch.cuda.set_device(device)
            distributed.init_tp(0, world_size, backend, init_method,
                                custom_all_reduce=not config.disable_custom_all_reduce,
                                pipeline_parallel_size=config.pipeline_parallel_size)
            stats: dict = {}
            self.free_at_start = free_at_start(config, device)
            self.model, self.hf_config, self.model_dir = load_model(config, device, stats)
            self.bytes_read = [stats.get("bytes_read", 0), *self._receive("loaded")]
            logger.info("tensor parallel over %d ranks (%s): checkpoint bytes read per rank %s",
                        world_size, backend, self.bytes_read)
        except BaseException:
            self.shutdown()
            raise

    @property
    def failure(self) -> str | None:
        """Why this executor cannot run any more (None while it can)."""
        health = self.health
        if health.failure is None and health.dead is not None:
            health.failure = _describe_death(health.dead)  # reads the traceback it sent
        return health.failure

    def init_runner(self) -> ModelRunner:
        """Every rank builds its ModelRunner with the final config (same KV size everywhere)."""
        try:
            for w in self.workers:
                w.conn.send(self.config)
            torch.manual_seed(self.config.seed)
            self.runner = runner_class(self.config)(self.config, self.model, self.device,
                                                    _dtype(self.model), self.free_at_start)
            self.health.runner = self.runner
            self.last_stage = LastStageQueue(functools.partial(self._guarded,
                                                               self.runner.execute))
            blocks = self._receive("ready")
        except BaseException as exc:
            self._raise_worker_failure(exc)  # profiling and capture run collectives
            self.shutdown()
            raise
        mine = self.runner.kv_cache_info.num_blocks
        if any(b != mine for b in blocks):  # min_over_ranks makes them equal
            self.shutdown()
            raise RuntimeError(f"ranks disagree on the KV-cache size: {[mine, *blocks]} blocks")
        self._graceful[0] = True
        return self.runner

    def execute(self, scheduled: list[ScheduledSequence],
                prompt_logits: list[bool] | None = None) -> torch.Tensor:
        """Send the step to every worker, run rank 0's shard, return its logits (on a GPU,
        still being computed: `collect` waits)."""
        self._raise_if_failed()
        step = self.runner.build_step(scheduled, prompt_logits)
        payload = pack_step(step)
        return self._guarded(self._run, step, payload)

    def _run(self, step, payload: bytes) -> torch.Tensor:
        self._send(payload)
        return self.runner.execute(step)

    def _send(self, payload: bytes) -> None:
        self.channel.send(payload, lambda r: self.workers[r].conn, self._raise_if_failed)

    def submit(self, scheduled: list[ScheduledSequence],
               prompt_logits: list[bool] | None = None) -> SubmittedStep:
        """Pipeline parallelism: send the step to every worker, where the earlier stages start
        on it at once; its last stage runs here at `result()` (pipeline.py)."""
        self._raise_if_failed()
        step = self.runner.build_step(scheduled, prompt_logits)
        payload = pack_step(step)
        if len(payload) > SLOT_BYTES:  # it takes the pipes, which a stuck worker never reads
            self.last_stage.run_through()
        self._guarded(self._send, payload)
        return self.last_stage.add(step)

    def keep_sampled(self, sampled: torch.Tensor | None) -> SampledTokens | None:
        """Rank 0's samples: kept for the next step and, with async scheduling, broadcast."""
        return self._guarded(self.runner.keep_sampled, sampled)

    def keep_verified(self, emitted: torch.Tensor) -> None:
        """A verification's emitted tokens (overlapped): kept and broadcast to the workers."""
        self._guarded(self.runner.keep_verified, emitted)

    def collect(self, tokens: SampledTokens) -> list[int]:
        """Wait for a step's sampled ids on the host: a hung NCCL kernel surfaces here, and the
        watchdog frees it."""
        return self._guarded(tokens.tolist)

    def _guarded(self, call, *args):
        """call(*args) as part of a step: any failure, here or on a worker, fails the group."""
        self._raise_if_failed()
        token = self._watch.begin()
        try:
            result = call(*args)
        except BaseException as exc:
            try:
                self._raise_worker_failure(exc)
            finally:  # a Ctrl-C may land in here too (distributed/sigint_watch.py)
                # Rank 0 itself failed or was interrupted mid-step: the workers now wait in a
                # collective it never joined, so the group cannot go on.
                self.health.fail(f"tensor-parallel rank 0 failed during a step: {exc!r}")
                self.shutdown()
            raise
        finally:
            self._watch.end(token)
        self._raise_if_failed()
        return result

    def _raise_worker_failure(self, exc: BaseException) -> None:
        """If rank 0's error `exc` comes from a worker's death (a collective that lost its peer),
        raise that death's description instead, chained to `exc`."""
        if isinstance(exc, Exception):  # not for Ctrl-C
            self.health.failed.wait(DEATH_GRACE_S)
            self._raise_if_failed(exc)

    def _raise_if_failed(self, cause: BaseException | None = None) -> None:
        failure = self.failure
        if failure is not None:
            self.shutdown()  # stop the other ranks now: the group cannot go on
            raise RuntimeError(failure) from cause

    def _receive(self, kind: str) -> list:
        """Each worker's next message, which must be a WorkerReport of `kind`; returns the values in
        rank order. Raises RuntimeError as soon as a worker fails or dies instead."""
        values: dict[int, object] = {}
        pending = {w.rank: w for w in self.workers}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while pending:
            self._raise_if_failed()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"tensor-parallel worker rank(s) {sorted(pending)} did not report "
                    f"{kind!r} within {STARTUP_TIMEOUT_S:.0f} s"
                )
            wait([w.conn for w in pending.values()], timeout=0.5)
            for w in list(pending.values()):
                if not w.conn.poll(0):
                    continue
                try:
                    message = w.conn.recv()
                except (EOFError, OSError):
                    message = None
                if not (isinstance(message, WorkerReport) and message.kind == kind):
                    self.health.fail(_describe_unexpected(w, message))
                    self._raise_if_failed()
                values[w.rank] = message.value
                del pending[w.rank]
        return [values[r] for r in sorted(values)]

    def shutdown(self) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        self._finalizer()


def _describe_unexpected(worker: _Worker, message) -> str:
    if isinstance(message, WorkerReport) and message.kind == "error":
        return (f"tensor-parallel worker rank {worker.rank} (pid {worker.process.pid}) failed:"
                f"\n{message.value}")
    if message is None:
        return _describe_death(worker)
    return f"tensor-parallel worker rank {worker.rank} sent an unexpected message {message!r}"
