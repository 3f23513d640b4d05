"""gpu_memory_utilization as vLLM reads it (worker/gpu_memory.py): this engine's share of the GPU,
whatever other engines hold. Pure arithmetic on GiB figures; the H200 probe is in RESULTS.md."""

from __future__ import annotations

import pytest
import torch

from tinypaged.config import EngineConfig
from tinypaged.worker.gpu_memory import (
    GIB,
    check_free_at_start,
    free_at_start,
    kv_cache_budget,
    no_kv_memory_message,
)

TOTAL = 140 * GIB


def test_one_engine_gets_its_share_minus_weights_and_peak():
    # 1 GiB in use before (a CUDA context), 16 GiB of weights, a 2 GiB profile peak
    start = TOTAL - 1 * GIB
    free = start - 16 * GIB
    assert kv_cache_budget(TOTAL, free, start, 0.9, 2 * GIB) == 0.9 * TOTAL - 18 * GIB


def test_a_second_engine_in_the_same_gpu_gets_the_same_share():
    first_holds = int(0.45 * TOTAL)  # the first engine, KV cache included
    start = TOTAL - first_holds
    free = start - 16 * GIB
    assert kv_cache_budget(TOTAL, free, start, 0.45, 2 * GIB) == 0.45 * TOTAL - 18 * GIB
    # without the start figure everything in use counts: nothing would be left
    assert kv_cache_budget(TOTAL, free, None, 0.45, 2 * GIB) < 0


def test_the_budget_never_exceeds_what_is_free_now():
    for start, free in ((TOTAL - 1 * GIB, 100 * GIB), (TOTAL - 1 * GIB, 10 * GIB),
                        (0.5 * TOTAL, 0.5 * TOTAL - 16 * GIB)):
        check_free_at_start(start, TOTAL, 0.5)
        assert kv_cache_budget(TOTAL, free, start, 0.5, 2 * GIB) + 2 * GIB <= free
    # another process took 90 GiB while the weights loaded: it counts against this engine
    assert kv_cache_budget(TOTAL, 10 * GIB, TOTAL - 1 * GIB, 0.9, 2 * GIB) < 0


def test_too_little_free_memory_stops_the_engine_at_start():
    check_free_at_start(70 * GIB, TOTAL, 0.5)
    with pytest.raises(ValueError, match=r"asks for 70.00 GiB of the GPU's 140.00, but only "
                                         r"69.00 GiB are free"):
        check_free_at_start(69 * GIB, TOTAL, 0.5)
    assert free_at_start(EngineConfig(), torch.device("cpu")) is None


def test_the_start_check_on_a_busy_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 * GIB, TOTAL))
    cuda = torch.device("cuda", 0)
    with pytest.raises(ValueError, match="only 10.00 GiB are free"):
        free_at_start(EngineConfig(), cuda)
    assert free_at_start(EngineConfig(gpu_memory_utilization=0.05), cuda) == 10 * GIB
    assert free_at_start(EngineConfig(num_kv_blocks=64), cuda) == 10 * GIB  # sized by hand


def test_the_message_gives_every_figure():
    message = no_kv_memory_message(TOTAL, 30 * GIB, 50 * GIB, 0.1, 1 * GIB)
    assert "allows 14.00 GiB of the GPU's 140.00, 20.00 GiB are in use (this engine's" in message
    assert "needs 1.00 GiB more, and 30.00 GiB are free" in message
