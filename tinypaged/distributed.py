"""Tensor-parallel state. With one GPU (the default) every call here is a no-op.

The tensor-parallel issue fills this in (worker processes, torch.distributed); layers only ever
ask `get_tp_rank()`, `get_tp_size()` and call `all_reduce`, so they work unchanged at size 1.
"""

from __future__ import annotations

import torch

_TP_RANK = 0
_TP_SIZE = 1


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel group in place (identity at size 1)."""
    if _TP_SIZE > 1:
        torch.distributed.all_reduce(x)
    return x
