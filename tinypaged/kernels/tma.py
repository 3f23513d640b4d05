"""A weight [N, K] streamed by TMA: the host-side descriptor the decode GEMVs take instead of a
pointer when their tiles ask for it (w_tma in FP8_ROWS_CONFIGS and FP8_ONE_ROW_CONFIGS), and
the FP8 GEMM above 64 rows for both of its operands (TMA in kernels/fp8.py's gemm_config).

    w_tma_fits(w, block_n, block_k) -> bool
    w_operand(w, use_tma, block_n, block_k) -> TensorDescriptor over w, or w itself

A kernel taking the descriptor loads its [block_n, block_k] tile at (row, column) with
`w_ptr.load([row, column])`: one bulk asynchronous copy (Hopper's Tensor Memory Accelerator)
into shared memory instead of a load per thread, the rows past N and the columns past K filled
with zeros by the copy engine. The descriptor is built on the host for each launch and passed
by value (a CUtensorMap; launcher/launch.py packs it), so a CUDA graph captures it with the
launch and replays it as long as the weight stays where it is (weights do).
"""

from __future__ import annotations

import functools

import torch

from tinypaged import envs


@functools.cache
def tma_device(device_index: int) -> bool:
    """Whether the GPU has the Tensor Memory Accelerator (compute capability 9.0 and up)."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def w_tma_fits(w: torch.Tensor, block_n: int, block_k: int) -> bool:
    """Whether a descriptor can stream w [N, K] (contiguous along K) in [block_n, block_k]
    tiles: a GPU with TMA (or the interpreter, on the CPU), a 16-byte aligned base and row
    stride (K % 16 == 0 for e4m3, % 8 for bf16), boxes of at most 256 a side; and
    $TINYPAGED_FP8_TMA not 0 (the A/B switch)."""
    return (envs.TINYPAGED_FP8_TMA and (not w.is_cuda or tma_device(w.device.index or 0))
            and w.stride(1) == 1 and w.data_ptr() % 16 == 0
            and w.stride(0) * w.element_size() % 16 == 0 and block_n <= 256 and block_k <= 256)


def w_operand(w: torch.Tensor, use_tma: bool, block_n: int, block_k: int):
    """w as the kernel reads it: a TMA descriptor of [block_n, block_k] boxes over w [N, K], or
    w itself for pointer loads."""
    if not use_tma:
        return w
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(w, list(w.shape), [w.stride(0), 1], [block_n, block_k])
