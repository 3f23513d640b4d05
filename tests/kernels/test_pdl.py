"""Which launches chain by programmatic dependent launch (kernels/pdl.py): CUDA tensors of at most
PDL_MAX_TOKENS rows on a device that has it, unless TINYPAGED_PDL=0. (What a chained kernel
compiles to is checked in test_kernels_compile.py.)"""

from types import SimpleNamespace

import torch

from tinypaged.kernels import pdl


def rows(n: int, cuda: bool = True) -> SimpleNamespace:
    # the attributes pdl_enabled reads, without a GPU
    return SimpleNamespace(is_cuda=cuda, shape=(n, 4096), device=torch.device("cuda", 0))


def test_decode_sized_cuda_launches_chain(monkeypatch):
    monkeypatch.setattr(pdl, "pdl_device", lambda index: True)
    assert pdl.pdl_enabled(rows(1)) and pdl.pdl_enabled(rows(pdl.PDL_MAX_TOKENS))
    assert not pdl.pdl_enabled(rows(pdl.PDL_MAX_TOKENS + 1))  # prefill, large batches
    assert not pdl.pdl_enabled(rows(1, cuda=False))  # the interpreter: no grid dependencies
    monkeypatch.setenv("TINYPAGED_PDL", "0")  # the A/B switch
    assert not pdl.pdl_enabled(rows(1))


def test_devices_before_hopper_do_not_chain(monkeypatch):
    monkeypatch.setattr(pdl, "pdl_device", lambda index: False)
    assert not pdl.pdl_enabled(rows(1))


def test_launch_keyword():
    assert pdl.launch_kwargs(True) == {"launch_pdl": True} and pdl.launch_kwargs(False) == {}


def test_a_cpu_launch_is_unchanged():
    # On the CPU nothing chains: the kernels run in the interpreter as before
    assert not pdl.pdl_enabled(torch.zeros(4, 8))
