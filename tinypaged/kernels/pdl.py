"""Programmatic dependent launch (PDL): let a kernel start while the one before it finishes.

In a CUDA stream (and in a CUDA graph captured from it) a kernel normally starts only once the
kernel before it has completed and its writes are flushed; the gap between the two, a microsecond
or two, is paid at every kernel boundary. A decode step of Llama-3-8B at batch 256 has ~330 of
them. Hopper (sm_90) lets a kernel be launched with the "programmatic stream serialization"
attribute: its programs may then be scheduled as soon as the previous kernel's programs have
all exited (or all signalled that they may), and each program must execute
`griddepcontrol.wait` (`gdc_wait`) before it touches memory the previous kernel writes. That
wait returns once the previous kernel has completed and flushed, so the results are the same;
only the launch and ramp-up overlap the previous kernel's tail.

Kernels that opt in take a `USE_PDL: tl.constexpr` argument, call `gdc_wait()` first thing when
it is set (before any load: every input may come from the kernel before), and are launched with
`launch_pdl=enabled(x)`. Under the Triton interpreter and on GPUs before sm_90 `enabled` is False
and the kernels compile exactly as before; TINYPAGED_PDL=0 turns it off everywhere (to rule it
out when a driver misbehaves, or to measure what it gives: benchmarks/pdl_step.py).
"""

from __future__ import annotations

import functools
import os

import torch

from tinypaged.kernels._triton import HAS_TRITON, interpreting

if HAS_TRITON:
    from triton.language.extra.cuda import gdc_wait
else:  # never called: kernels only run with triton
    gdc_wait = None

__all__ = ["enabled", "gdc_wait"]


@functools.cache
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def enabled(x: torch.Tensor) -> bool:
    """Whether kernels on x's device launch with PDL: CUDA sm_90+, not the interpreter, and
    TINYPAGED_PDL is not 0."""
    return (x.is_cuda and not interpreting() and _supported(x.device.index or 0)
            and os.environ.get("TINYPAGED_PDL") != "0")
