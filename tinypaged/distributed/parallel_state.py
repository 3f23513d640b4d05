"""Tensor-parallel state and the collectives the layers and the executor use.

With tensor_parallel_size N the engine runs N processes (worker/executor.py): rank 0 is the engine's
own process, ranks 1..N-1 are workers. Every rank holds 1/N of each sharded weight (layers.py
cuts the slices at load time) and runs the same forward on the same batch; the partial results
are combined with one sum over ranks:

    y = sum_r x_r W_r^T          all_reduce after each row-parallel linear (o_proj, down_proj)
                                 and after the vocab-parallel embedding and LM head

The group is a `torch.distributed` process group: backend "nccl" between GPUs (one per rank),
"gloo" on the CPU. Between GPUs with P2P access, all-reduces of up to 16 MiB (every decode
step's) go through the custom all-reduce instead (custom_all_reduce.py: one Triton kernel over
buffers every rank maps), unless `custom_all_reduce=False`. With one rank and no group (the
default) every call here is a no-op and nothing is imported or created, so single-GPU runs do
not change at all.

    init_tp(rank, world_size, backend, init_method)   join the group (every rank, once)
    get_tp_rank(), get_tp_size()                      read by the layers when they are built
    all_reduce(x)                                     in-place sum over ranks
    min_over_ranks(n)                                 e.g. the KV-cache size every rank can hold
    abort_tp()                                        unblock collectives after a peer died
    leave_tp(graceful, timeout_s)                     leave the group, within a time bound
    build_as(rank, size)                              layers built as that rank, without a group
    local()                                           rank 0 alone: no sharding, no collectives

Pipeline parallelism (`pipeline_parallel_size` P > 1, worker/pipeline.py) makes the world
N = tp * P ranks: each stage's tp ranks form the group the layers' collectives use, and hidden
states go from stage to stage point to point (`send_to_next_stage`, `recv_from_prev_stage`).
World rank 0 is the engine's process, and it runs the LAST stage (where the logits are
sampled), so stages are numbered from the end: world rank w is tensor-parallel rank w % tp of
stage P - 1 - w // tp.

Leaving an NCCL group takes care. `destroy_process_group` flushes and finalizes the
communicators (ncclCommFinalize), which waits for the other ranks: a rank that destroys while a
peer is gone (or is not destroying too) waits forever. `abort` (ncclCommAbort) is local and safe
when a peer is gone, but kills whatever is still in flight. So the ranks leave in order: rank 0
tells every worker to stop, each acknowledges and then destroys, and rank 0 destroys too, all at
the same time (`leave_tp(graceful=True)`); when a rank is dead or did not acknowledge, rank 0
aborts instead (`leave_tp(graceful=False)`). Either call runs in a helper thread and is given up
after `timeout_s`, so that shutdown always returns. gloo has no abort; its destroy is local.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch

logger = logging.getLogger(__name__)

# Long enough for a slow rank to compile its Triton kernels or capture its CUDA graphs before a
# collective; a dead worker is noticed by the executor's liveness check long before this.
COLLECTIVE_TIMEOUT_S = 600.0

_TP_RANK = 0
_TP_SIZE = 1
_PP_RANK = 0  # this process's pipeline stage
_PP_SIZE = 1
_TP_GROUP = None  # the stage's tensor-parallel group; None = the whole world (no pipeline)
_GROUP_DEVICE: torch.device | None = None  # where collective inputs live; None = no group
_CUSTOM_AR = None  # a CustomAllreduce while the group has one
_LEAVE_LOCK = threading.Lock()  # abort (watchdog thread) and leave (finalizer) never overlap
_ABANDONED: list = []  # custom all-reduce buffers of groups left in a hurry (see leave_tp)


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def get_pp_rank() -> int:
    return _PP_RANK


def get_pp_size() -> int:
    return _PP_SIZE


def world_rank(tp_rank: int, pp_rank: int, tp_size: int, pp_size: int) -> int:
    """The world rank of tensor-parallel rank `tp_rank` of stage `pp_rank` (see above)."""
    return (pp_size - 1 - pp_rank) * tp_size + tp_rank


@contextmanager
def build_as(rank: int, size: int, pp_rank: int = 0, pp_size: int = 1) -> Iterator[None]:
    """Layers built inside see tensor-parallel rank `rank` of `size` (no group, no collectives):
    e.g. a model built on the meta device this way raises the layers' own error for heads that
    do not split over `size` ranks, before any worker process is started."""
    global _TP_RANK, _TP_SIZE, _PP_RANK, _PP_SIZE
    if _GROUP_DEVICE is not None:
        raise RuntimeError("build_as() cannot be used while a process group is active")
    saved = _TP_RANK, _TP_SIZE, _PP_RANK, _PP_SIZE
    _TP_RANK, _TP_SIZE, _PP_RANK, _PP_SIZE = rank, size, pp_rank, pp_size
    try:
        yield
    finally:
        _TP_RANK, _TP_SIZE, _PP_RANK, _PP_SIZE = saved


@contextmanager
def local() -> Iterator[None]:
    """Inside, this process is a group of its own: layers built see one rank and the
    collectives do nothing. For a small model that rank 0 alone builds and runs beside the
    sharded one (a speculative draft model); nothing inside may expect the other ranks."""
    global _TP_RANK, _TP_SIZE, _PP_RANK, _PP_SIZE, _TP_GROUP, _GROUP_DEVICE, _CUSTOM_AR
    saved = _TP_RANK, _TP_SIZE, _PP_RANK, _PP_SIZE, _TP_GROUP, _GROUP_DEVICE, _CUSTOM_AR
    _TP_RANK, _TP_SIZE, _PP_RANK, _PP_SIZE, _TP_GROUP, _GROUP_DEVICE, _CUSTOM_AR = (
        0, 1, 0, 1, None, None, None)
    try:
        yield
    finally:
        _TP_RANK, _TP_SIZE, _PP_RANK, _PP_SIZE, _TP_GROUP, _GROUP_DEVICE, _CUSTOM_AR = saved


def init_tp(rank: int, world_size: int, backend: str, init_method: str,
            timeout_s: float = COLLECTIVE_TIMEOUT_S, custom_all_reduce: bool = True,
            pipeline_parallel_size: int = 1) -> None:
    """Join the tensor-parallel group as `rank` of `world_size` (blocks until all ranks join).
    On CUDA, call `torch.cuda.set_device` first: NCCL binds this rank to the current device.
    `custom_all_reduce` must be the same on every rank (EngineConfig's
    `not disable_custom_all_reduce`). With `pipeline_parallel_size` P > 1, `world_size` counts
    every stage's ranks and each stage's tensor-parallel group is made here (no custom
    all-reduce then)."""
    global _TP_RANK, _TP_SIZE, _PP_RANK, _PP_SIZE, _TP_GROUP, _GROUP_DEVICE, _CUSTOM_AR
    import torch.distributed as dist

    if _GROUP_DEVICE is not None or dist.is_initialized():
        raise RuntimeError(
            "a torch.distributed process group already exists in this process: one "
            "tensor-parallel engine per process; call shutdown() on the previous engine first"
        )
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' (GPUs) or 'gloo' (CPU), got {backend!r}")
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
    # A dead peer is handled here (abort_tp, leave_tp), not by torch's NCCL watchdog, whose
    # default reaction to a failed collective is to take this whole process down.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout_s), device_id=device,
    )
    _TP_RANK, _TP_SIZE = rank, world_size
    if pipeline_parallel_size > 1:  # every rank makes every stage's group, in the same order
        tp = world_size // pipeline_parallel_size
        groups = [dist.new_group(list(range(s * tp, (s + 1) * tp)))
                  for s in range(pipeline_parallel_size)]
        _TP_GROUP = groups[rank // tp]
        _TP_RANK, _TP_SIZE = rank % tp, tp
        _PP_RANK, _PP_SIZE = pipeline_parallel_size - 1 - rank // tp, pipeline_parallel_size
    _GROUP_DEVICE = device or torch.device("cpu")
    if device is not None and pipeline_parallel_size == 1:
        from tinypaged.distributed.custom_all_reduce import create_custom_all_reduce

        _CUSTOM_AR = create_custom_all_reduce(device, disabled=not custom_all_reduce)


def _bounded(call, timeout_s: float, device: torch.device) -> bool:
    """Run `call()` in a daemon thread (on `device`); True if it returned (or raised) within
    `timeout_s`. An NCCL call that waits for a peer that never comes is left behind instead of
    hanging us."""
    done = threading.Event()

    def run() -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            call()
        except Exception:  # e.g. a communicator already aborted: the group is gone either way
            logger.debug("leaving the process group raised", exc_info=True)
        finally:
            done.set()

    threading.Thread(target=run, name="tinypaged-tp-leave", daemon=True).start()
    return done.wait(timeout_s)


def abort_tp(timeout_s: float = 10.0) -> None:
    """From any thread: abort the NCCL communicators so that a collective waiting for a dead
    rank returns (with an error) instead of spinning forever. The group's state stays until
    `leave_tp`. No-op on gloo, which notices a dead peer by itself, and without a group."""
    import torch.distributed as dist

    if _CUSTOM_AR is not None:  # its kernels wait for peers on their own, not through NCCL
        _CUSTOM_AR.abort()
    with _LEAVE_LOCK:
        if _GROUP_DEVICE is None or _GROUP_DEVICE.type != "cuda" or not dist.is_initialized():
            return
        if not _bounded(dist.distributed_c10d._abort_process_group, timeout_s, _GROUP_DEVICE):
            logger.warning("aborting the NCCL process group did not finish in %.0f s", timeout_s)


def leave_tp(graceful: bool, timeout_s: float = 10.0) -> bool:
    """Leave the group (a no-op without one): destroy it when every rank is leaving now
    (`graceful`), else abort it (NCCL). Returns False when that did not finish within
    `timeout_s` (a warning is logged; this process can then not join a new group). The layers
    built so far keep their shards."""
    global _TP_RANK, _TP_SIZE, _PP_RANK, _PP_SIZE, _TP_GROUP, _GROUP_DEVICE, _CUSTOM_AR
    import torch.distributed as dist

    with _LEAVE_LOCK:
        device, _GROUP_DEVICE = _GROUP_DEVICE, None
        _TP_RANK, _TP_SIZE, _PP_RANK, _PP_SIZE, _TP_GROUP = 0, 1, 0, 1, None
        if _CUSTOM_AR is not None:
            if not graceful:  # a kernel may still wait for a peer that is gone
                _CUSTOM_AR.abort()
                _ABANDONED.append(_CUSTOM_AR)  # freeing it would wait for the GPU: never
            _CUSTOM_AR = None
        if device is None or not dist.is_initialized():  # no group, or aborted already
            return True
        nccl = device.type == "cuda"
        if (graceful or not nccl) and _bounded(dist.destroy_process_group, timeout_s, device):
            return True
        if nccl and _bounded(dist.distributed_c10d._abort_process_group, timeout_s, device):
            if graceful:
                logger.warning("destroying the NCCL process group took over %.0f s; aborted "
                               "it instead", timeout_s)
            return True
        logger.warning("could not leave the %s process group within %.0f s; giving up on it",
                       "NCCL" if nccl else "gloo", timeout_s)
        return False


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel group in place (identity without a group): through
    the custom all-reduce when the group has one and x fits it, else through NCCL / gloo."""
    if _CUSTOM_AR is not None and _CUSTOM_AR.fits(x):
        return _CUSTOM_AR.all_reduce(x)
    if _GROUP_DEVICE is not None:
        torch.distributed.all_reduce(x, group=_TP_GROUP)
    return x


def custom_all_reduce_enabled() -> bool:
    """Whether this group has the custom all-reduce (custom_all_reduce.py)."""
    return _CUSTOM_AR is not None


def all_gather_columns(x: torch.Tensor) -> torch.Tensor:
    """[N, C] on each rank -> [N, tp * C], rank r's columns at [r * C, (r + 1) * C) (x itself
    without a group). Half the bytes of all-reducing a zero-padded [N, tp * C]."""
    if _GROUP_DEVICE is None:
        return x
    dist = torch.distributed
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch < 2.13
    tp = get_tp_size()
    out = x.new_empty(tp * x.shape[0], x.shape[1])  # rank-major rows, as gloo and NCCL want
    gather(out, x.contiguous(), group=_TP_GROUP)
    return out.view(tp, x.shape[0], x.shape[1]).permute(1, 0, 2).reshape(x.shape[0], -1)


def broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    """Overwrite `x` on every rank with rank 0's (in stream order on NCCL; x without a group)."""
    if _GROUP_DEVICE is not None:  # world rank 0 is in the last stage's group
        torch.distributed.broadcast(x, src=0, group=_TP_GROUP)
    return x


def send_to_next_stage(x: torch.Tensor) -> None:
    """Send `x` to the same tensor-parallel rank of the next pipeline stage."""
    dst = world_rank(_TP_RANK, _PP_RANK + 1, _TP_SIZE, _PP_SIZE)
    torch.distributed.send(x.contiguous(), dst=dst)


def recv_from_prev_stage(x: torch.Tensor) -> torch.Tensor:
    """Fill `x` (its shape and dtype known in advance) from the previous stage's same rank."""
    torch.distributed.recv(x, src=world_rank(_TP_RANK, _PP_RANK - 1, _TP_SIZE, _PP_SIZE))
    return x


def min_over_ranks(value: int) -> int:
    """The smallest of every rank's `value` over the whole world, every pipeline stage
    included (the value itself without a group)."""
    if _GROUP_DEVICE is None:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_GROUP_DEVICE)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return int(t.item())
