"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's kernels.

Between two dependent kernels in a stream (or a CUDA graph) the GPU normally waits for the first
to finish and flush before it launches the second, whose programs then start their address
arithmetic and their first loads from nothing. At decode a kernel streams a few megabytes in
10-60 us, so that launch and ramp are a visible share of each one (fitted over the Llama-3-8B
GEMVs of benchmarks/RESULTS.md, "Kernels against their ceilings": about 3.5 us of each).

With PDL a kernel launched with the `launch_pdl` attribute may start while the one before it
is still running, once every program of that one has called `gdc_launch_dependents` (or
exited). It does whatever does not read the earlier kernels' results (index arithmetic, the L2
prefetch of its weights, which no kernel writes) and then calls `gdc_wait`, which returns once
the kernel before it has finished and its writes are visible. So, for every kernel here:

- `pdl_wait` runs in every program, before the program reads or writes anything another kernel
  of the step reads or writes (activations, the KV cache, the split-K workspace). A program
  that returns early waits first: a kernel completes only after its own wait, so the kernel
  after it, waiting for it, also waits for everything before (the chain stays ordered).
- `pdl_trigger` says where the next kernel may start: at once in the short elementwise kernels
  (norms, rotary + KV store, the decode attention), after the K loop in the GEMVs, so that
  only one GEMV's programs hold the SMs' registers and shared memory while the next one waits.

A kernel takes both as constexpr flags (USE_PDL), set from `pdl_enabled` at the launch, and is
launched with `launch_kwargs(use)`; without the flag both helpers compile to nothing and the
launch is an ordinary one. Off on the CPU (the interpreter has no grid dependencies), before
Hopper, above PDL_MAX_TOKENS rows (prefill and large decode batches: kernels long enough that
their launch is noise) and with $TINYPAGED_PDL=0 (the A/B switch).
"""

from __future__ import annotations

import functools

import torch

from tinypaged import envs
from tinypaged.kernels._triton import jit, tl

# rows (tokens) of a launch up to which the decode kernels chain by PDL: 64 takes in a batch-8
# speculative verification's 40 (k = 4) and decode batches to 64, where the chain measured
# slightly faster than ordinary launches (benchmarks/RESULTS.md, Speculative decoding)
PDL_MAX_TOKENS = 64


@functools.cache
def pdl_device(device_index: int) -> bool:
    """Whether the device can launch by PDL (compute capability 9.0 and up)."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_enabled(x: torch.Tensor) -> bool:
    """Whether a decode kernel over x [tokens, ...] chains by PDL (see the module docstring)."""
    return (x.is_cuda and envs.TINYPAGED_PDL and x.shape[0] <= PDL_MAX_TOKENS
            and pdl_device(x.device.index or 0))


def launch_kwargs(use: bool) -> dict:
    """The launch's extra keyword: Triton's `launch_pdl` when the kernel chains by PDL."""
    return {"launch_pdl": True} if use else {}


@jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait until the kernel before this one has finished and its writes are visible."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@jit
def pdl_trigger(USE_PDL: tl.constexpr):
    """Let the next kernel in the stream start its programs (they wait in `pdl_wait`)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@jit
def prefetch_rows(ptr, rows, stride, start, end, SPAN: tl.constexpr, USE_PDL: tl.constexpr):
    """Ask L2 for elements start .. min(start + SPAN, end) - 1 of each row in rows [R] of the
    matrix at ptr (row stride `stride`), one prefetch a 128-byte line: a GEMV's first weight
    tiles, fetched while the kernel before it still runs (weights: no kernel writes them)."""
    if USE_PDL:
        LINE: tl.constexpr = 1024 // ptr.dtype.element_ty.primitive_bitwidth  # elements a line
        cols = start + tl.arange(0, max(SPAN // LINE, 1)) * LINE
        lines = ptr + rows[:, None] * stride + cols[None, :]  # [R, SPAN / LINE]
        mask = (cols < tl.minimum(start + SPAN, end))[None, :] & (rows >= 0)[:, None]
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [lines, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
