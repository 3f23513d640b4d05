"""The split-K workspace (kernels/split_k.py): one per device, grown on demand, and an outgrown
one kept alive, since CUDA graphs captured before (a target's, when a draft model with wider
layers warms up after them) still read and re-zero it."""

import gc
import weakref

import torch

from tinypaged.kernels.split_k import split_k_workspace


def test_outgrown_workspace_stays_alive_for_earlier_graphs():
    device = torch.device("cpu")
    partial, count = split_k_workspace(device, 16, 8)
    assert not partial.any() and not count.any()
    assert split_k_workspace(device, 16, 8)[0] is partial  # reused while it fits
    old = weakref.ref(partial)
    grown, grown_count = split_k_workspace(device, partial.numel() + 1, count.numel() + 1)
    assert grown.numel() > partial.numel() and grown_count.numel() > count.numel()
    assert split_k_workspace(device, 16, 8)[0] is grown
    del partial, count
    gc.collect()
    assert old() is not None
