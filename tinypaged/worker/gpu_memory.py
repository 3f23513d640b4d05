"""How much GPU memory an engine's KV cache gets: `gpu_memory_utilization` as vLLM reads it.

The utilization is this engine's share of the GPU, whatever other engines (in this process or
others) hold: an engine may use u x total bytes in all. Before it loads its weights it notes the
free memory (`free_at_start`; it must be at least u x total, or the engine stops at once with the
numbers); after the profiling forward (model_runner.py) the KV cache gets

    budget = u x total - used - peak_extra
    used = free_at_start - free        this engine's weights, buffers and CUDA workspaces
    peak_extra                         the largest forward's activations above what stays allocated

It never asks for more than is free: budget + peak_extra = free - (free_at_start - u x total),
and free_at_start >= u x total (memory another process takes meanwhile counts as used). So two
engines of 0.45 share one GPU, as they do under vLLM. When `free_at_start` is unknown, `used`
counts everything in use on the GPU (free_at_start = total).
"""

from __future__ import annotations

import torch

from tinypaged.config import EngineConfig

GIB = 2**30


def free_at_start(config: EngineConfig, device: torch.device) -> int | None:
    """Free bytes on `device` before the engine loads its weights (None off CUDA); raises
    ValueError when less than gpu_memory_utilization x total is free (not checked when
    num_kv_blocks sizes the cache). What this process's allocator caches is given back first;
    an engine dropped without shutdown() holds its memory until a gc.collect()."""
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    if config.num_kv_blocks is None:
        check_free_at_start(free, total, config.gpu_memory_utilization)
    return free


def check_free_at_start(free: int, total: int, utilization: float) -> None:
    if free < utilization * total:
        raise ValueError(
            f"gpu_memory_utilization={utilization} asks for {utilization * total / GIB:.2f} GiB "
            f"of the GPU's {total / GIB:.2f}, but only {free / GIB:.2f} GiB are free (other "
            "engines in this process or other processes hold the rest); shut down the engines "
            "you no longer need, or lower gpu_memory_utilization"
        )


def kv_cache_budget(total: int, free: int, start: int | None, utilization: float,
                    peak_extra: int) -> float:
    """Bytes for the KV cache (the module docstring's formula); `start`: free_at_start."""
    used = (total if start is None else start) - free
    return utilization * total - used - peak_extra


def no_kv_memory_message(total: int, free: int, start: int | None, utilization: float,
                         peak_extra: int) -> str:
    used = (total if start is None else start) - free
    whose = "everything on the GPU" if start is None else "this engine's weights and buffers"
    return (
        f"no GPU memory left for the KV cache: gpu_memory_utilization={utilization} allows "
        f"{utilization * total / GIB:.2f} GiB of the GPU's {total / GIB:.2f}, {used / GIB:.2f} "
        f"GiB are in use ({whose}), a forward step needs {peak_extra / GIB:.2f} GiB more, and "
        f"{free / GIB:.2f} GiB are free; raise gpu_memory_utilization, or lower "
        "max_num_batched_tokens"
    )
