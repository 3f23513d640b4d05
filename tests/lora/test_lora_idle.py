"""With enable_lora, a step in which no sequence has an adapter runs no LoRA op (lora/idle.py):
eagerly, and in CUDA graphs, each captured with and without the LoRA kernels and replayed by
the step's flag. The CPU has no graphs, so a stand-in replays what its capture ran: the call
made during the capture, again, with the LoRA kernels on or off as they were then (whatever
the current step asks), written into the captured outputs. Its tokens must equal the LoRA-off
engine's without adapters and the eager engine's with them. That the real graphs do the
same, and the time it saves, the GPU shows (benchmarks/lora_bench.py --idle)."""

from __future__ import annotations

import pytest
import torch
from helpers.graphs import fake_cuda_graphs
from helpers.lora import save_peft_adapter
from helpers.models import greedy_reference, prompts, single_thread  # noqa: F401 (autouse)

from tinypaged import LLM, LoRARequest, SamplingParams
from tinypaged.bench.tiny_models import save_tiny
from tinypaged.lora import layers as lora_layers
from tinypaged.lora.idle import capturing, graph_variants
from tinypaged.lora.layers import LoRABatch
from tinypaged.worker.cuda_graphs import DecodeGraphs
from tinypaged.worker.piecewise_graphs import PiecewiseGraphs

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")

STEPS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-idle")
    hf = save_tiny("llama", root / "base")
    merged = save_peft_adapter(hf, root / "a0", 8, 16, seed=4)
    batch = prompts(3, seed=5, lo=3, hi=6)  # one prompt step of <= 16 tokens: a piecewise bucket
    base = LLM(str(root / "base"), skip_tokenizer_init=True, num_kv_blocks=64, max_num_seqs=4)
    base_tokens = run(base, batch, None)  # LoRA off
    assert base_tokens == [greedy_reference(hf, p, STEPS)[0] for p in batch]
    mixed_tokens = [greedy_reference(merged, batch[0], STEPS)[0], *base_tokens[1:]]
    return root, LoRARequest("a0", 1, str(root / "a0")), batch, base_tokens, mixed_tokens


def run(llm, batch, loras):
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False,
                        lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


def lora_llm(root):
    return LLM(str(root / "base"), skip_tokenizer_init=True, num_kv_blocks=64, max_num_seqs=4,
               enable_lora=True, max_loras=1, max_lora_rank=8)


def spy_lora_ops(monkeypatch) -> list[str]:
    """Every LoRA kernel launch (shrink, expand, add) is logged into the returned list."""
    log = []
    for name in ("lora_shrink", "lora_expand", "lora_add"):
        real = getattr(lora_layers, name)
        monkeypatch.setattr(lora_layers, name,
                            lambda *a, _real=real, _name=name, **k: log.append(_name)
                            or _real(*a, **k))
    return log


def test_graph_variants():
    batch = LoRABatch(num_slots=1, max_tokens=4, device=torch.device("cpu"))
    assert graph_variants(None) == (False,)
    assert graph_variants(batch) == (True, False)
    with capturing(batch, True):  # a capture's forwards, whatever the last step had
        assert batch.run_lora
    assert not batch.run_lora  # the step's own flag back
    batch.always_run = True  # CUDA with TINYPAGED_LORA_SKIP_IDLE=0: one set, with the kernels
    assert graph_variants(batch) == (True,)


def test_warm_up_runs_the_lora_kernels_and_leaves_no_segments(setup, monkeypatch):
    """The warm-up steps (and the profiling forward) put every token on slot 0, so that the LoRA
    kernels compile before serving; the graphs are then captured over no segments."""
    root = setup[0]
    runner = lora_llm(root).engine.runner
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    ops = spy_lora_ops(monkeypatch)
    runner._warm_up()
    assert ops.count("lora_shrink") > 0
    lora_batch = runner.lora.batch
    assert not lora_batch.run_lora and not lora_batch.any_adapter
    assert lora_batch.seg_len.count_nonzero() == lora_batch.has_adapter.count_nonzero() == 0


@pytest.mark.parametrize("skip_idle", ["1", "0"])
def test_eager_steps_without_adapters_run_no_lora_op(setup, monkeypatch, skip_idle):
    """Base-only steps with LoRA on: no LoRA op and the LoRA-off tokens; a step with an adapter
    runs them. TINYPAGED_LORA_SKIP_IDLE=0 on CUDA (always_run, set here by hand) runs them in
    every step, the old behaviour, with the same tokens."""
    root, request, batch, base_tokens, mixed_tokens = setup
    monkeypatch.setenv("TINYPAGED_LORA_SKIP_IDLE", skip_idle)
    llm = lora_llm(root)
    lora_batch = llm.engine.runner.lora.batch
    lora_batch.always_run = lora_batch.run_lora = skip_idle == "0"  # as on CUDA
    ops = spy_lora_ops(monkeypatch)
    assert run(llm, batch, None) == base_tokens
    assert (ops == []) == (skip_idle == "1")
    assert run(llm, batch, [request, None, None]) == mixed_tokens
    assert ops.count("lora_shrink") > 0
    ops.clear()
    assert run(llm, batch, None) == base_tokens  # after steps with an adapter, none again
    assert (ops == []) == (skip_idle == "1")


class FakeGraph:
    """torch.cuda.CUDAGraph on the CPU (see the module docstring); `replays` logs the LoRA
    flag of every graph replayed."""

    capturing: FakeGraph | None = None
    replays: list[bool] = []

    def pool(self) -> str:
        return "pool"

    def replay(self) -> None:
        FakeGraph.replays.append(self.run_lora)
        with capturing(self.batch, self.run_lora):  # what the capture ran, not what the step asks
            new = self.call()
        for out, value in zip(self.outputs, new):
            if out is not None:
                out.copy_(value)


def recorded(fn, batch, as_tuple):
    """fn, which under a FakeGraph capture also records itself as that graph's work."""
    def wrapper(*args):
        out, graph = fn(*args), FakeGraph.capturing
        if graph is not None:
            FakeGraph.capturing = None
            graph.call = lambda: as_tuple(fn(*args))
            graph.outputs, graph.batch, graph.run_lora = as_tuple(out), batch, batch.run_lora
        return out
    return wrapper


@pytest.fixture
def fake_graphs(monkeypatch):
    fake_cuda_graphs(monkeypatch, FakeGraph)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: t)
    monkeypatch.setattr(FakeGraph, "replays", [])


def install_graphs(llm, monkeypatch):
    """Decode graphs (buckets 1, 2, 4) and piecewise graphs (8 and 16 tokens), captured into
    FakeGraphs, in the engine's runner."""
    runner = llm.engine.runner
    batch = runner.lora.batch
    monkeypatch.setattr(DecodeGraphs, "_forward",
                        recorded(DecodeGraphs._forward, batch, lambda t: (t,)))
    monkeypatch.setattr(runner.model.model, "piece",
                        recorded(runner.model.model.piece, batch, tuple))
    runner.graphs = DecodeGraphs(runner)
    runner.piecewise = PiecewiseGraphs(runner.model, [8, 16], runner.device, runner.dtype,
                                       lora_batch=batch)
    return runner.graphs, runner.piecewise


@pytest.mark.parametrize("skip_idle", ["1", "0"])
def test_graph_replays_without_adapters_run_no_lora_op(setup, monkeypatch, fake_graphs,
                                                       skip_idle):
    """Each graph is captured with and without the LoRA kernels; base-only steps replay the
    ones without (no LoRA op, the LoRA-off tokens), steps with an adapter the ones with (the
    eager tokens). TINYPAGED_LORA_SKIP_IDLE=0 on CUDA: one set, with the kernels, for all."""
    root, request, batch, base_tokens, mixed_tokens = setup
    monkeypatch.setenv("TINYPAGED_LORA_SKIP_IDLE", skip_idle)
    llm = lora_llm(root)
    lora_batch = llm.engine.runner.lora.batch
    lora_batch.always_run = lora_batch.run_lora = skip_idle == "0"  # as on CUDA
    decode, pieces = install_graphs(llm, monkeypatch)
    variants = (True, False) if skip_idle == "1" else (True,)
    assert set(decode.graphs) == {(bs, v) for bs in (1, 2, 4) for v in variants}
    num_pieces = len(pieces.attns) + 1
    assert len(pieces.graphs) == 2 * num_pieces * len(variants)
    ops = spy_lora_ops(monkeypatch)

    assert run(llm, batch, None) == base_tokens
    assert len(FakeGraph.replays) > num_pieces  # the prompt step's pieces and the decodes
    assert set(FakeGraph.replays) == {skip_idle == "0"}
    assert (ops == []) == (skip_idle == "1")

    FakeGraph.replays.clear()
    assert run(llm, batch, [request, None, None]) == mixed_tokens
    assert set(FakeGraph.replays) == {True} and ops.count("lora_shrink") > 0

    FakeGraph.replays.clear()
    ops.clear()
    assert run(llm, batch, None) == base_tokens
    assert set(FakeGraph.replays) == {skip_idle == "0"}
    assert (ops == []) == (skip_idle == "1")
