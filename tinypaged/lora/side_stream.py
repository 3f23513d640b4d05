"""A second CUDA stream for the LoRA shrink, so that it runs beside the base matmul.

At decode each LoRA kernel is tiny (it reads under a megabyte) and its time is mostly launch and
ramp-up, paid in series after the base matmul. The shrink h = x A^T reads only x, as the base
matmul does, so it need not wait for it, and at decode neither does the expand's product
d = h B^T (lora/layers.py SPLIT_MAX_TOKENS); only adding it into y does:

    current stream:  ...  --fork-->  base y = x W^T  --join-->  y += d    (larger batches:
    side stream:          \\-> shrink h = x A^T, d = h B^T  --/            y += h B^T after
                                                                         the join)

fork: the side stream waits for what the current stream has queued (x is ready); join: the
current stream waits for the side stream's work (h is ready) before the expand reads it. Under
CUDA graph capture (decode graphs, piecewise graphs) the same calls make two parallel branches
of the graph: waiting on an event recorded by the capturing stream pulls the side stream into
the capture, and the join brings it back before the capture ends (as CUDA requires). The side
stream allocates nothing (the shrink and the expand write the preallocated planes and deltas of
lora/layers.py), so the graph's memory pool is never touched from it.

Every tensor the side stream reads must stay alive until the join: the caching allocator frees
on the current stream's order, and the join orders the side stream's reads before any reuse.
The stream is made at high priority, so the shrink's few programs are scheduled ahead of the
base matmul's many when both wait for a free SM.

The side stream is taken under TINYPAGED_LORA_OVERLAP (on by default), for CUDA tensors that the
Triton kernels handle; the CPU (and the torch references, whose `.tolist()` would sync inside a
capture) take the plain path: shrink and expand after the base matmul on one stream.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from tinypaged import envs
from tinypaged.kernels._triton import use_triton


class SideStream:
    """One device's side stream with its fork (a context: work inside runs on the side stream
    once the current stream's queued work is done) and join."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device, priority=-1)
        # one event each way, re-recorded at every fork and join (a wait reads the event's
        # latest record, made just before it): no event made per call
        self.forked, self.joined = torch.cuda.Event(), torch.cuda.Event()

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        self.forked.record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(self.forked)
        with torch.cuda.stream(self.stream):
            yield

    def join(self) -> None:
        self.joined.record(self.stream)
        torch.cuda.current_stream(self.device).wait_event(self.joined)


@functools.cache
def _side_stream(device_index: int) -> SideStream:
    # one per device and process, made at the first eager step (before any capture), so every
    # graph captures the same stream
    return SideStream(torch.device("cuda", device_index))


def overlap_stream(x: torch.Tensor) -> SideStream | None:
    """The side stream to run x's LoRA shrink on (TINYPAGED_LORA_OVERLAP, x on CUDA and
    the Triton kernels chosen), else None: the plain path."""
    if not (envs.TINYPAGED_LORA_OVERLAP and x.is_cuda and use_triton(x)):
        return None
    return _side_stream(x.device.index if x.device.index is not None
                        else torch.cuda.current_device())
