"""The overlapped LoRA path (TINYPAGED_LORA_OVERLAP, lora/side_stream.py) on the CPU: which path
a layer takes, the order of its calls (fork, shrink on the side stream, base matmul, join,
expand; at decode sizes the expand's product inside the fork and only the add after the join)
and that its output equals the plain path's. The CPU has no streams, so a fake side
stream stands in; that the fork and join make parallel branches of a captured CUDA graph, and
that graphs equal eager with the overlap on, only the GPU can show (benchmarks/lora_bench.py
--check)."""

import contextlib

import numpy as np
import pytest
import torch

from tinypaged.kernels import dense_gemv
from tinypaged.kernels._triton import kernel_choice
from tinypaged.lora import layers as lora_layers
from tinypaged.lora.layers import LoRABatch, LoRALinear
from tinypaged.lora.side_stream import overlap_stream
from tinypaged.models.layers import MergedColumnParallelLinear

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")


class FakeSide:
    """Logs the fork (entered, left) and the join instead of touching CUDA streams."""

    def __init__(self, log):
        self.log = log

    @contextlib.contextmanager
    def fork(self):
        self.log.append("fork")
        yield
        self.log.append("forked")

    def join(self):
        self.log.append("join")


def adapted_layer(token_slots):
    """A gate-up-like layer (2 shards of 24, 32 inputs) with LoRA in 2 slots of rank 4."""
    g = torch.Generator().manual_seed(0)
    layer = MergedColumnParallelLinear(32, [24, 24])
    layer.weight.data = torch.randn(48, 32, generator=g)
    batch = LoRABatch(num_slots=2, max_tokens=8, device=torch.device("cpu"))
    layer.lora = LoRALinear(layer, batch, max_rank=4, dtype=torch.float32,
                            device=torch.device("cpu"))
    layer.lora.lora_a.copy_(torch.randn(layer.lora.lora_a.shape, generator=g))
    layer.lora.lora_b.copy_(torch.randn(layer.lora.lora_b.shape, generator=g))
    batch.prepare(token_slots)
    x = torch.randn(len(token_slots if token_slots is not None else [0] * 6), 32, generator=g)
    return layer, x


class Calls:
    """Logs the base matmul and both LoRA kernels into `log`; `side` (None: the plain path) is
    the side stream every layer gets."""

    def __init__(self, monkeypatch):
        self.log, self.side = [], None
        for module, name, tag in ((dense_gemv, "dense_linear", "base"),
                                  (lora_layers, "lora_shrink", "shrink"),
                                  (lora_layers, "lora_expand", "expand"),
                                  (lora_layers, "lora_add", "add")):
            monkeypatch.setattr(module, name, self.logging(getattr(module, name), tag))
        monkeypatch.setattr(lora_layers, "overlap_stream", lambda x: self.side)

    def logging(self, real, tag):
        def wrapper(*args, **kwargs):
            self.log.append(tag)
            return real(*args, **kwargs)
        return wrapper

    def run(self, layer, x, side=None):
        """(layer(x), the calls it made)."""
        self.log = []
        self.side = side and side(self.log)
        return layer(x), self.log


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_overlapped_order_and_output_equal_the_plain_path(monkeypatch, kernels):
    slots = np.array([1, -1, 0, 1, 0, -1], dtype=np.int32)
    layer, x = adapted_layer(slots)
    calls = Calls(monkeypatch)
    with kernel_choice(kernels):
        base = torch.nn.functional.linear(x, layer.weight)
        plain, plain_log = calls.run(layer, x)
        overlapped, side_log = calls.run(layer, x, FakeSide)
    assert plain_log == ["base", "shrink", "expand"]
    # 6 rows (decode): the shrink and the expand's product are queued inside the fork, before
    # the base matmul; only the add waits for the join
    assert side_log == ["fork", "shrink", "expand", "forked", "base", "join", "add"]
    assert torch.equal(plain, overlapped)
    assert not torch.allclose(plain, base)  # the adapters did add something
    # the tokens of no adapter keep the base output
    torch.testing.assert_close(plain[slots < 0], base[slots < 0])


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_past_split_max_tokens_the_expand_follows_the_join(monkeypatch, kernels):
    slots = np.array([1, -1, 0, 1, 0, -1], dtype=np.int32)
    layer, x = adapted_layer(slots)
    monkeypatch.setattr(lora_layers, "SPLIT_MAX_TOKENS", 4)
    calls = Calls(monkeypatch)
    with kernel_choice(kernels):
        plain, _ = calls.run(layer, x)
        overlapped, side_log = calls.run(layer, x, FakeSide)
    assert side_log == ["fork", "shrink", "forked", "base", "join", "expand"]
    assert torch.equal(plain, overlapped)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the NaN rows
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_split_delta_is_reused_across_layers_and_steps(monkeypatch, kernels):
    """Two layers share one batch's delta buffer, and each later step (another size, other
    slots: a token of no adapter where one had an adapter) reads nothing a step before left."""
    layer, _ = adapted_layer(np.array([1, -1, 0, 1, 0, -1], dtype=np.int32))
    batch = layer.lora.batch
    other = MergedColumnParallelLinear(32, [24, 24])
    other.weight.data = layer.weight.data.flip(0).contiguous()
    other.lora = LoRALinear(other, batch, max_rank=4, dtype=torch.float32,
                            device=torch.device("cpu"))
    other.lora.lora_a.copy_(layer.lora.lora_a.flip(2))
    other.lora.lora_b.copy_(layer.lora.lora_b.flip(1))
    calls = Calls(monkeypatch)
    batch.deltas.fill_(float("nan"))  # rows that no token writes hold anything
    with kernel_choice(kernels):
        for step, slots in enumerate(([1, -1, 0, 1, 0, -1], [-1, 0, 1, 1], [0, 0, -1, 1, -1])):
            batch.prepare(np.array(slots, dtype=np.int32))
            x = torch.randn(len(slots), 32, generator=torch.Generator().manual_seed(step))
            got = [calls.run(m, x, FakeSide)[0] for m in (layer, other)]
            want = [calls.run(m, x)[0] for m in (layer, other)]
            for g, w in zip(got, want):
                assert torch.equal(g, w)
            assert calls.log == ["base", "shrink", "expand"]  # the plain path, the last run


def test_apply_is_shrink_then_expand():
    layer, x = adapted_layer(np.array([0, 1, -1, 1], dtype=np.int32))
    y = torch.nn.functional.linear(x, layer.weight)
    by_parts = layer.lora.expand(y.clone(), layer.lora.shrink(x))
    assert torch.equal(layer.lora.apply(x, y.clone()), by_parts)


def test_no_adapter_on_the_cpu_launches_nothing(monkeypatch):
    layer, x = adapted_layer(None)
    y, log = Calls(monkeypatch).run(layer, x, FakeSide)
    assert torch.equal(y, torch.nn.functional.linear(x, layer.weight))
    assert log == ["base"]  # no fork, no kernel: the CPU has no graph that needs them


@pytest.mark.parametrize("setting", ["0", "1"])
def test_the_cpu_takes_the_plain_path(monkeypatch, setting):
    monkeypatch.setenv("TINYPAGED_LORA_OVERLAP", setting)
    layer, x = adapted_layer(np.array([0, 1], dtype=np.int32))
    assert overlap_stream(x) is None
    assert layer.lora.shrink_beside(x) is None
