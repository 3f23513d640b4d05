"""Custom all-reduce: buffers every rank can read, and when to use them instead of NCCL.

At decode a row-parallel layer all-reduces a few KiB to a few MiB (batch x hidden), twice per
layer; NCCL's fixed cost per call is then most of the time. When every GPU of the group can
load from every other's memory (P2P over NVLink), kernels/all_reduce.py does the sum in one
kernel over buffers that all ranks map. This module allocates those buffers and decides:

    create_custom_all_reduce(device)           at init_tp; None where it cannot be used
    ca.fits(x)                                 x small enough, a supported dtype, contiguous
    ca.all_reduce(x)                           in place, CUDA-graph capturable
    ca.abort()                                 make kernels waiting for a dead peer return

Buffers come from torch's symmetric memory (torch.distributed._symmetric_memory): `empty`
allocates on every rank, `rendezvous` (a collective) maps every rank's allocation into every
process. Plain peer loads and stores only: NVLink multicast is never used, and
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (set here) keeps rendezvous from creating a multicast object.
The kernel copies its input into the buffer itself (a layer cannot write its output there
directly: which half a call uses is decided on the GPU, so that CUDA graphs can replay it).
Each rank's buffer: int32 flags [num_programs, W], then [2 halves][input, result] areas of
`max_size` bytes each (kernels/all_reduce.py says why).

Used when (as vLLM's custom all-reduce): the group runs on CUDA with 2+ ranks, every GPU can
access every other's memory, and `disable_custom_all_reduce` is off; per call, when the message
is at most `max_size` bytes (default 16 MiB: 2048 tokens x hidden 4096 in bf16). Everything else
goes to NCCL. One-shot at 2 ranks; with more, two-shot from TWO_SHOT_MIN_SIZE bytes on.

One more condition: every rank's process must have made the same number of rendezvous before.
torch numbers the store exchanges of a rendezvous per process (keys
CUDASymmetricMemory/<n>/<rank>, n counting up from 0 in each process), so rank 0 of a second
tensor-parallel engine in one process (n = 2 after the first engine) and that engine's fresh
workers (n = 0) would each wait for keys the other never writes: a hang of the collective
timeout, seen as `tp_check.py`'s second TP=2 engine on two GPUs and reproduced on one GPU with
two processes (benchmarks/RESULTS-log.md). Such a group uses NCCL instead.
"""

from __future__ import annotations

import logging
import os

import torch

from tinypaged.kernels._triton import num_sms
from tinypaged.kernels.all_reduce import custom_all_reduce

logger = logging.getLogger(__name__)

DEFAULT_MAX_SIZE = 16 * 2**20  # 2048 x 4096 bf16, every decode step's; measured still ahead of NCCL
# One-shot below this, two-shot from it on, with more than 2 ranks (at 2 ranks both read the
# same bytes from the peer, and one-shot waits at one barrier instead of two); vLLM's threshold.
TWO_SHOT_MIN_SIZE = 512 * 2**10
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ALIGN = 256  # bytes: every region starts aligned, so the kernel's loads are 16-byte vectors
_rendezvous_done = 0  # symmetric-memory rendezvous made by this process (see the docstring)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class CustomAllreduce:
    """The sum over ranks through buffers at `buffer_ptrs` (rank r's buffer as this process sees
    it), each `buffer_bytes(world_size, max_size, num_programs)` bytes with zeroed flags. Every
    rank must build it with the same arguments and make the same calls in the same order."""

    def __init__(self, buffer_ptrs: list[int], rank: int, device: torch.device,
                 max_size: int = DEFAULT_MAX_SIZE, num_programs: int = 132,
                 block: int = 4096, num_warps: int = 16,
                 two_shot_min_size: int | None = None) -> None:
        self.rank, self.world_size = rank, len(buffer_ptrs)
        self.max_size = max_size
        self.block, self.num_warps = block, num_warps
        if two_shot_min_size is None:
            two_shot_min_size = TWO_SHOT_MIN_SIZE if self.world_size > 2 else max_size + 1
        self.two_shot_min_size = two_shot_min_size
        self.flags_bytes = flags_bytes(self.world_size, num_programs)
        # Host memory the GPU reads (pinned: mapped into the device's address space).
        self.abort_flag = torch.zeros(1, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.ptrs = torch.tensor([*buffer_ptrs, self.abort_flag.data_ptr()], dtype=torch.int64,
                                 device=device)
        self.counters = torch.zeros(num_programs, dtype=torch.int32, device=device)
        self.keepalive: list = []  # whatever owns the buffers' memory

    def fits(self, x: torch.Tensor) -> bool:
        """Whether `all_reduce(x)` can take x (else use NCCL)."""
        return (x.dtype in SUPPORTED_DTYPES and x.is_contiguous()
                and x.numel() * x.element_size() <= self.max_size
                and x.device == self.ptrs.device)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        elem = x.element_size()
        return custom_all_reduce(
            x, x, self.ptrs, self.counters, self.rank, data_offset=self.flags_bytes // elem,
            max_elems=self.max_size // elem,
            two_shot=x.numel() * elem >= self.two_shot_min_size,
            block=self.block, num_warps=self.num_warps)

    def abort(self) -> None:
        """From any thread: kernels waiting for a peer give up within a few ms (their output
        is garbage; the group is unusable afterwards)."""
        self.abort_flag[0] = 1


def flags_bytes(world_size: int, num_programs: int) -> int:
    return _round_up(4 * num_programs * world_size, ALIGN)


def buffer_bytes(world_size: int, max_size: int, num_programs: int) -> int:
    """Bytes of each rank's buffer: the flags, then two halves of input and result areas."""
    if max_size % ALIGN:
        raise ValueError(f"max_size must be a multiple of {ALIGN} bytes, got {max_size}")
    return flags_bytes(world_size, num_programs) + 4 * max_size


def unsupported_reason(device_type: str, world_size: int, disabled: bool,
                       peer_access: list[list[bool]],
                       rendezvous_done: list[int] | None = None) -> str | None:
    """Why the custom all-reduce cannot serve this group (None: it can). `peer_access[i][j]`:
    can rank i's GPU read rank j's memory; `rendezvous_done[i]`: how many symmetric-memory
    rendezvous rank i's process has made before."""
    if disabled:
        return "disabled (disable_custom_all_reduce)"
    if device_type != "cuda":
        return f"the group runs on {device_type}, not on CUDA GPUs"
    if world_size < 2:
        return "a single rank has nothing to reduce"
    missing = [(i, j) for i in range(world_size) for j in range(world_size)
               if i != j and not peer_access[i][j]]
    if missing:
        return f"no P2P access between the GPUs of ranks {missing[0]}"
    if rendezvous_done and len(set(rendezvous_done)) > 1:
        return (f"the ranks' processes made {rendezvous_done} symmetric-memory rendezvous before "
                "(a second tensor-parallel engine in one process), and torch's rendezvous would "
                "wait forever across processes whose counts differ")
    return None


def create_custom_all_reduce(device: torch.device, disabled: bool = False,
                             max_size: int = DEFAULT_MAX_SIZE, num_programs: int | None = None,
                             **launch) -> CustomAllreduce | None:
    """Collective (every rank of the default group calls it): the buffers, mapped on every
    rank, or None (logged) where the custom all-reduce cannot serve this group. The kernels'
    grid is `num_programs` (default: one per SM of the smallest GPU); `launch`: CustomAllreduce's
    block, num_warps and two_shot_min_size (the defaults are the fastest of a sweep on 2 x H200,
    benchmarks/all_reduce.py --sweep)."""
    import torch.distributed as dist

    world_size, rank = dist.get_world_size(), dist.get_rank()
    global _rendezvous_done
    mine = (device.index, num_sms(device.index) if device.type == "cuda" else 0, _rendezvous_done)
    ranks: list[tuple] = [mine] * world_size
    dist.all_gather_object(ranks, mine)
    devices = [index for index, _, _ in ranks]
    peer_access = [[i == j or (a is not None and b is not None
                               and torch.cuda.can_device_access_peer(a, b))
                    for j, b in enumerate(devices)] for i, a in enumerate(devices)]
    reason = unsupported_reason(device.type, world_size, disabled, peer_access,
                                [done for _, _, done in ranks])
    if reason is not None:
        logger.info("custom all-reduce off: %s; all-reduces go through NCCL", reason)
        return None
    # Peer loads and stores only: rendezvous must not create an NVLink multicast object.
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    import torch.distributed._symmetric_memory as symm_mem

    num_programs = num_programs or min(sms for _, sms, _ in ranks)
    nbytes = buffer_bytes(world_size, max_size, num_programs)
    buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    buffer[: flags_bytes(world_size, num_programs)].zero_()
    torch.cuda.synchronize(device)  # zeroed before rendezvous lets any peer signal here
    handle = symm_mem.rendezvous(buffer, dist.group.WORLD.group_name)
    _rendezvous_done += 1
    # buffer_ptrs may name each allocation's start while `buffer` sits inside it (torch's
    # symmetric memory pool): the offset is the same on every rank.
    offset = buffer.data_ptr() - handle.buffer_ptrs[rank]
    ca = CustomAllreduce([p + offset for p in handle.buffer_ptrs], rank, device, max_size,
                         num_programs, **launch)
    ca.keepalive = [buffer, handle]
    logger.info("custom all-reduce on: %d ranks, messages up to %d MiB", world_size,
                max_size >> 20)
    return ca
