"""Start the N engine processes of data parallelism, each an AsyncMPClient (engine/core_client.py).

    N x tensor_parallel_size GPUs visible   engine i gets GPUs [i*tp, (i+1)*tp) of them through
                                            CUDA_VISIBLE_DEVICES; they start at once
    fewer GPUs                              every engine shares the visible GPUs, each with its
                                            own gpu_memory_utilization (2 engines: 0.45 each);
                                            they start one after another, so that each one's
                                            memory profiling sees the others' memory as in use
    CPU                                     N processes, started at once
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading

from tinypaged.config import EngineConfig
from tinypaged.engine.core_client import AsyncMPClient

logger = logging.getLogger(__name__)


def engine_envs(num_engines: int, tp: int, device: str | None) -> list[dict[str, str]] | None:
    """Each engine's CUDA_VISIBLE_DEVICES when the GPUs can be sliced; None when the engines
    share the GPU(s) (and so must start one after another); [{}] * N off CUDA."""
    import torch

    if (device or "cuda").split(":")[0] != "cuda" or torch.cuda.device_count() == 0:
        return [{}] * num_engines
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = (visible.split(",") if visible else
           [str(i) for i in range(torch.cuda.device_count())])
    if len(ids) < num_engines * tp:
        return None
    return [{"CUDA_VISIBLE_DEVICES": ",".join(ids[i * tp : (i + 1) * tp])}
            for i in range(num_engines)]


def start_engines(config: EngineConfig) -> list[AsyncMPClient]:
    """Start config.data_parallel_size engine processes; each is ready when this returns. If
    one fails to start, the others are stopped and its error is raised."""
    n = config.data_parallel_size
    one = dataclasses.replace(config, data_parallel_size=1)
    envs = engine_envs(n, config.tensor_parallel_size * config.pipeline_parallel_size,
                       config.device)  # each engine: tp x pp GPUs
    clients: list[AsyncMPClient | None] = [None] * n
    errors: list[BaseException] = []

    def start(i: int, env: dict[str, str]) -> None:
        try:
            clients[i] = AsyncMPClient(one, env)
        except BaseException as exc:  # noqa: BLE001 - raised below, for engine i
            errors.append(RuntimeError(f"data-parallel engine {i} of {n} did not start: "
                                       f"{type(exc).__name__}: {exc}"))

    if envs is None:
        logger.info("data parallelism: %d engines share the GPU(s), each with "
                    "gpu_memory_utilization=%g", n, config.gpu_memory_utilization)
        for i in range(n):
            if not errors:
                start(i, {})
    else:
        if not config.skip_tokenizer_init:  # each client loads a tokenizer, in its thread:
            from transformers import AutoTokenizer  # noqa: F401 - lazy imports are not thread-safe
        threads = [threading.Thread(target=start, args=(i, env)) for i, env in enumerate(envs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        for client in clients:  # never started: nothing to drain
            if client is not None:
                client.proc.kill()
                client.proc.join()
        raise errors[0]
    return clients  # type: ignore[return-value]
