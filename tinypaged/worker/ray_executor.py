"""RayExecutor: the tensor-parallel ranks 1..N-1 as Ray actors, on one node or several
(`distributed_executor_backend="ray"`, vLLM's name; `pip install tinypaged[ray]`). With
pipeline_parallel_size P the world is tensor_parallel_size * P ranks, the engine's process the
last stage (pipeline.py); PACK fills a node before the next, so a stage's TP ranks share a node
when it has the room and the stages spread over nodes.

Rank 0 stays the engine's process, as with MultiprocExecutor (executor.py); the other ranks are
actors placed by a placement group (one bundle of 1 CPU, plus 1 GPU on CUDA, per rank; strategy
PACK: one node while it has room, else the next), so the same code runs on a laptop, on one node
of 8 GPUs or across nodes of a Ray cluster. Every rank joins one torch.distributed group at
`tcp://<rank 0's node address>:<free port>`: NCCL between GPUs, gloo on the CPU.

    rank 0 (engine process)                          actor r = 1..N-1 (any node)
    placement group; actors; join.remote()  ---->    join the group; load its shard
    join the group; load its shard                   -> checkpoint bytes read
    init_runner.remote(config)              ---->    ModelRunner (profile, KV = min over ranks)
    per step: execute.remote(pack_step(step)) -->    unpack, the same forward; logits dropped
              its own shard  <-- all-reduces -->     (async scheduling: rank 0's samples)
    collect: the step's actor calls answered
    (pipeline parallelism: `submit` starts the calls, `result()` runs rank 0's stage later;
     each actor runs its calls in order, so several steps can be in flight, pipeline.py)

Not yet: rank 0's GPU is not reserved in the placement group (Ray does not know the engine's
process uses it), so on a node whose GPUs Ray hands out, start that node's Ray with one GPU fewer
(`ray start --head --num-gpus 7` on 8) or Ray may give an actor the engine's GPU. Only the CPU
path (gloo, a local multi-node cluster: tests/ray_cluster) is tested so far.

A step's arrays travel as the byte string of tp_worker.pack_step in one actor call per rank
(Ray's object store across nodes). A dead actor (killed, its node lost) resolves the call in
flight with an error: a watchdog thread waits on those calls, aborts the group so that rank 0 is
not left in a collective, and every later call raises RuntimeError naming the rank and its node.
`shutdown()` leaves the group on every rank when all are healthy, then kills the actors and
removes the placement group, so nothing of the engine outlives it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import weakref
from collections import deque
from typing import Any

import torch

from tinypaged.config import EngineConfig
from tinypaged.distributed import parallel_state as distributed
from tinypaged.scheduler import ScheduledSequence
from tinypaged.worker.gpu_memory import free_at_start
from tinypaged.worker.model_runner import ModelRunner, SampledTokens
from tinypaged.worker.pipeline import LastStageQueue, SubmittedStep, runner_class
from tinypaged.worker.tp_worker import pack_step, unpack_step

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 1800.0
STOP_TIMEOUT_S = 10.0
INSTALL = "pip install 'tinypaged[ray]'"


def import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError(f"distributed_executor_backend='ray' needs Ray: {INSTALL}") from None
    return ray


class RayWorker:
    """One tensor-parallel rank in a Ray actor (the actor class is ray.remote(RayWorker))."""

    def where(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), os.getpid()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def join(self, rank: int, world_size: int, backend: str, init_method: str,
             config: EngineConfig) -> int:
        from tinypaged.models.loader import load_model

        self.device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(self.device)
        distributed.init_tp(rank, world_size, backend, init_method,
                            custom_all_reduce=False,  # peers may sit on other nodes
                            pipeline_parallel_size=config.pipeline_parallel_size)
        stats: dict = {}
        self.start = free_at_start(config, self.device)
        self.model, _, _ = load_model(config, self.device, stats)
        return stats.get("bytes_read", 0)

    def init_runner(self, config: EngineConfig) -> int:
        torch.manual_seed(config.seed)
        self.runner = runner_class(config)(config, self.model, self.device,
                                           next(self.model.parameters()).dtype, self.start)
        return self.runner.kv_cache_info.num_blocks

    def execute(self, payload: bytes) -> None:
        step = unpack_step(payload)
        self.runner.execute(step)
        if self.runner.broadcast_sampled:
            self.runner.keep_sampled(None)
        if step.broadcast_verified:  # an overlapped verification's tokens (tp_worker.py)
            self.runner.keep_verified(None, step.broadcast_verified)

    def leave(self) -> bool:
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.release_graphs()
        return distributed.leave_tp(graceful=True, timeout_s=STOP_TIMEOUT_S)


def _node_address() -> str:
    ray = import_ray()
    return ray.util.get_node_ip_address()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class _State:
    """What the watchdog and the finalizer share (never the executor itself)."""

    def __init__(self) -> None:
        self.failure: str | None = None
        self.in_flight: list = []  # the actor calls of the steps in flight (pipeline.py)
        self.where: list[tuple[str, int]] = []  # (node, pid) of ranks 1..N-1
        self.stopping = False
        self.runner: ModelRunner | None = None
        self.wake = threading.Event()

    def fail(self, message: str) -> None:
        if self.failure is None:
            self.failure = message


def _watch(state: _State, ray) -> None:
    """Wait on each step's actor calls; the first that fails breaks the group."""
    checked = None
    while not state.stopping:
        refs = state.in_flight
        if not refs or refs is checked:
            state.wake.wait(0.2)
            state.wake.clear()
            continue
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=0.2)
        if _check(state, ray, refs, ready) and not state.stopping:
            distributed.abort_tp()  # rank 0 may wait in a collective the dead rank left
            return
        if not pending:
            checked = refs


def _check(state: _State, ray, refs: list, ready: list) -> bool:
    """Record the first failed call among `ready` (refs holds one call per rank 1..N-1 for each
    step, in rank order); True if one did."""
    for i, ref in enumerate(refs):
        if ref not in ready:
            continue
        try:
            ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - the actor died or raised
            i %= max(1, len(state.where))
            node, pid = state.where[i] if i < len(state.where) else ("?", "?")
            state.fail(f"tensor-parallel worker rank {i + 1} (Ray actor on node {node}, pid "
                       f"{pid}) failed: {type(exc).__name__}: {exc}")
            return True
    return False


def _stop(ray, actors: list, pg, state: _State, clean: list[bool]) -> None:
    state.stopping = True
    state.wake.set()
    healthy = clean[0] and state.failure is None
    if state.runner is not None:
        state.runner.release_graphs()
        state.runner = None
    if healthy and actors:
        refs = [a.leave.remote() for a in actors]
        distributed.leave_tp(graceful=True, timeout_s=STOP_TIMEOUT_S)
        try:
            ray.get(refs, timeout=STOP_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - killed just below anyway
            pass
    for a in actors:
        try:
            ray.kill(a)
        except Exception:  # noqa: BLE001 - already gone
            pass
    if not healthy:
        distributed.leave_tp(graceful=False, timeout_s=STOP_TIMEOUT_S)
    if pg is not None:
        try:
            ray.util.remove_placement_group(pg)
        except Exception:  # noqa: BLE001 - the cluster is gone
            pass


class RayExecutor:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from tinypaged.models.loader import load_model

        ray = import_ray()
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"))
        # create_executor checked that it shards (and cuts into stages)
        world_size = config.tensor_parallel_size * config.pipeline_parallel_size
        gpu = device.type == "cuda"
        backend = "nccl" if gpu else "gloo"
        self.config, self.device, self.runner = config, device, None
        self.state = _State()
        self._recent: deque[list] = deque(maxlen=config.pipeline_parallel_size)
        self._clean = [False]
        bundle = {"CPU": 1, **({"GPU": 1} if gpu else {})}
        self.pg = placement_group([bundle] * (world_size - 1), strategy="PACK")
        self.actors: list = []
        self._finalizer = weakref.finalize(self, _stop, ray, self.actors, self.pg, self.state,
                                           self._clean)
        try:
            ray.get(self.pg.ready(), timeout=STARTUP_TIMEOUT_S)
            package_root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
            env = {"PYTHONPATH": os.pathsep.join(
                p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
            actor_cls = ray.remote(RayWorker)
            for rank in range(1, world_size):
                self.actors.append(actor_cls.options(
                    num_cpus=1, num_gpus=1 if gpu else 0, runtime_env={"env_vars": env},
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.pg, placement_group_bundle_index=rank - 1),
                ).remote())
            self.state.where = ray.get([a.where.remote() for a in self.actors],
                                       timeout=STARTUP_TIMEOUT_S)
            host = _node_address()
            init_method = f"tcp://{host}:{_free_port(host)}"
            joined = [a.join.remote(rank, world_size, backend, init_method, config)
                      for rank, a in enumerate(self.actors, start=1)]
            if gpu:
                torch.cuda.set_device(device)
            distributed.init_tp(0, world_size, backend, init_method, custom_all_reduce=False,
                                pipeline_parallel_size=config.pipeline_parallel_size)
            stats: dict = {}
            self.free_at_start = free_at_start(config, device)
            self.model, self.hf_config, self.model_dir = load_model(config, device, stats)
            self.bytes_read = [stats.get("bytes_read", 0),
                               *ray.get(joined, timeout=STARTUP_TIMEOUT_S)]
            nodes = sorted({node for node, _ in self.state.where})
            logger.info("tensor parallel over %d ranks (%s, Ray actors on %s)", world_size,
                        backend, ", ".join(nodes))
        except BaseException:
            self.shutdown()
            raise
        self._ray = ray
        threading.Thread(target=_watch, args=(self.state, ray), name="tinypaged-ray-watchdog",
                         daemon=True).start()

    @property
    def failure(self) -> str | None:
        return self.state.failure

    def init_runner(self) -> ModelRunner:
        ray = self._ray
        try:
            refs = [a.init_runner.remote(self.config) for a in self.actors]
            torch.manual_seed(self.config.seed)
            self.runner = runner_class(self.config)(
                self.config, self.model, self.device, next(self.model.parameters()).dtype,
                self.free_at_start)
            self.state.runner = self.runner
            self.last_stage = LastStageQueue(lambda step: self._guarded(self.runner.execute,
                                                                        step))
            blocks = ray.get(refs, timeout=STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        mine = self.runner.kv_cache_info.num_blocks
        if any(b != mine for b in blocks):
            self.shutdown()
            raise RuntimeError(f"ranks disagree on the KV-cache size: {[mine, *blocks]} blocks")
        self._clean[0] = True
        return self.runner

    def execute(self, scheduled: list[ScheduledSequence],
                prompt_logits: list[bool] | None = None) -> torch.Tensor:
        return self._guarded(self.runner.execute, self._send(scheduled, prompt_logits))

    def submit(self, scheduled: list[ScheduledSequence],
               prompt_logits: list[bool] | None = None) -> SubmittedStep:
        """Pipeline parallelism: the actors' calls start the earlier stages on the step; its
        last stage runs here at `result()` (pipeline.py). An actor runs its calls in order."""
        return self.last_stage.add(self._send(scheduled, prompt_logits))

    def _send(self, scheduled: list[ScheduledSequence], prompt_logits: list[bool] | None):
        """Build the step and start every actor's call on it; the watchdog waits on the calls
        of the last pipeline_parallel_size steps (those that may be in flight)."""
        self._raise_if_failed()
        step = self.runner.build_step(scheduled, prompt_logits)
        payload = pack_step(step)
        self._recent.append([a.execute.remote(payload) for a in self.actors])
        self.state.in_flight = [ref for refs in self._recent for ref in refs]
        self.state.wake.set()
        return step

    def keep_sampled(self, sampled: torch.Tensor | None) -> SampledTokens | None:
        return self._guarded(self.runner.keep_sampled, sampled)

    def keep_verified(self, emitted: torch.Tensor) -> None:
        self._guarded(self.runner.keep_verified, emitted)

    def collect(self, tokens: SampledTokens) -> list[int]:
        return self._guarded(tokens.tolist)

    def _guarded(self, call, *args: Any):
        self._raise_if_failed()
        try:
            result = call(*args)
        except Exception as exc:
            self._wait_for_verdict()
            self.state.fail(f"tensor-parallel rank 0 failed during a step: {exc!r}")
            self._raise_if_failed(exc)
        self._raise_if_failed()
        return result

    def _wait_for_verdict(self, timeout_s: float = 5.0) -> None:
        """After a failed collective: let the calls in flight say which actor died."""
        refs = self.state.in_flight
        if refs:
            ready, _ = self._ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
            _check(self.state, self._ray, refs, ready)

    def _raise_if_failed(self, cause: BaseException | None = None) -> None:
        failure = self.state.failure
        if failure is not None:
            self.shutdown()
            raise RuntimeError(failure) from cause

    def shutdown(self) -> None:
        self._finalizer()
