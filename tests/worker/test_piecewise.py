"""The piecewise forward (worker/piecewise_graphs.py) against the eager one, on the CPU.

Graph capture needs CUDA (benchmarks/piecewise_check.py checks it on the GPU); what is checked
here is the loop a replay runs, with each piece run eagerly on the same padded static buffers:
a mixed step (a decode, a chunk over a cached prefix, a fresh prompt) of T = bucket, bucket - 1
and bucket + 1 tokens must give the eager forward's hidden states and leave the same KV cache,
with the attention buffer's padding rows full of NaN so that any leak from them shows.
"""

from __future__ import annotations

import pytest
import torch
from helpers.models import (
    PagedRunner,
    build_flat_batch,
    build_model,
    checkpoint_weights,
    single_thread,  # noqa: F401 - autouse fixture
    tiny_hf_model,
)

from tinypaged.config import EngineConfig
from tinypaged.models.layers import Attention
from tinypaged.worker.piecewise_graphs import (
    PiecewiseGraphs,
    piecewise_unsupported,
    token_buckets,
    weak_view,
)

BUCKETS = [8, 16, 32]
BLOCK_SIZE = 8


def test_token_buckets():
    assert token_buckets(8192)[:3] == [16, 32, 48]
    assert token_buckets(8192)[15:18] == [256, 288, 320]
    assert token_buckets(8192)[-1] == 512
    assert token_buckets(100) == [16, 32, 48, 64, 80, 96]
    assert token_buckets(8) == []


def test_weak_view_aliases_without_owning():
    qkv = torch.arange(24.0).reshape(4, 6)
    q = qkv[:, :4].reshape(4, 2, 2)  # a strided view at offset 0, as the rotated q is
    k = qkv[1:, 4:]  # a view at an offset
    owners = torch._C._storage_Use_Count(qkv.untyped_storage()._cdata)
    for t in (q, k):
        weak = weak_view(t)
        assert weak.data_ptr() == t.data_ptr() and weak.stride() == t.stride()
        assert torch.equal(weak, t)
    # a plain view would hold the storage; the weak ones do not
    assert torch._C._storage_Use_Count(qkv.untyped_storage()._cdata) == owners
    qkv[1, 4] = -1.0
    assert weak_view(k)[0, 0] == -1.0


def test_cudagraph_mode_is_validated():
    assert EngineConfig(cudagraph_mode="FULL_AND_PIECEWISE").cudagraph_mode == "FULL_AND_PIECEWISE"
    with pytest.raises(ValueError, match="cudagraph_mode must be one of.*'PIECEWISE_ONLY'"):
        EngineConfig(cudagraph_mode="PIECEWISE_ONLY")


def test_moe_models_are_captured():
    hf = tiny_hf_model("qwen3_moe", seed=1)
    assert piecewise_unsupported(build_model(hf.config, checkpoint_weights(hf))) is None


def test_quantized_models_are_captured(tmp_path):
    from helpers.quantize import quantized_pair

    from tinypaged.models.loader import load_model

    awq_dir, _ = quantized_pair("llama", tmp_path)
    model, _, _ = load_model(EngineConfig(model=str(awq_dir)), "cpu")
    assert not all(t.dtype.is_floating_point for t in model.parameters())  # int4 weights
    assert piecewise_unsupported(model) is None


def test_dense_models_are_captured_by_default_except_under_tensor_parallelism(monkeypatch):
    from tinypaged.distributed import parallel_state as distributed

    assert EngineConfig().cudagraph_mode == "FULL_AND_PIECEWISE"
    hf = tiny_hf_model("llama", seed=1)
    model = build_model(hf.config, checkpoint_weights(hf))
    assert piecewise_unsupported(model) is None
    with distributed.build_as(0, 2):
        assert piecewise_unsupported(model) == "tensor parallelism"
        monkeypatch.setenv("TINYPAGED_PIECEWISE_UNCHECKED", "1")  # the GPU check's override
        assert piecewise_unsupported(model) is None


def flat_step(runner, new: dict) -> tuple:
    """(ids, positions, metadata) of one step that brings `new[seq]` tokens to each sequence,
    blocks reserved first (nothing is run)."""
    for s, toks in new.items():
        while len(runner.block_tables[s]) * BLOCK_SIZE < runner.num_cached[s] + len(toks):
            runner.block_tables[s].append(runner.free_blocks.pop())
    return build_flat_batch(list(new.values()), [runner.num_cached[s] for s in new],
                            [runner.block_tables[s] for s in new], BLOCK_SIZE)


def _caches(model) -> list[torch.Tensor]:
    return [t for m in model.modules() if isinstance(m, Attention) for t in (m.k_cache, m.v_cache)]


@torch.no_grad()
# q/k norm; windows and soft-caps; partial rotary; routed and shared experts
@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma2", "phi3", "qwen2_moe"])
@pytest.mark.parametrize("num_tokens", [15, 16, 17])
def test_piecewise_forward_matches_eager(kind, num_tokens):
    hf = tiny_hf_model(kind, seed=len(kind))
    model = build_model(hf.config, checkpoint_weights(hf))
    gen = torch.Generator().manual_seed(num_tokens)
    runner = PagedRunner(model, block_size=BLOCK_SIZE, num_blocks=24, seed=3)
    decode, chunked, fresh = (runner.add_sequence() for _ in range(3))
    runner.step({decode: torch.randint(0, 256, (11,), generator=gen).tolist(),
                 chunked: torch.randint(0, 256, (9,), generator=gen).tolist()})
    # the mixed step: 1 decode token, 6 more of the chunked prompt, the rest a fresh prompt
    new = {decode: [5], chunked: torch.randint(0, 256, (6,), generator=gen).tolist(),
           fresh: torch.randint(0, 256, (num_tokens - 7,), generator=gen).tolist()}
    ids, positions, md = flat_step(runner, new)
    before = [t.clone() for t in _caches(model)]

    eager = model(ids, positions, md)  # [T, hidden]
    eager_caches = [t.clone() for t in _caches(model)]
    for t, saved in zip(_caches(model), before):
        t.copy_(saved)

    pieces = PiecewiseGraphs(model, BUCKETS, torch.device("cpu"), torch.float32, capture=False)
    pieces.attn_out.fill_(float("nan"))
    pieces.slot_mapping.fill_(7)  # stale slots from an earlier step: padding must reset them
    piecewise = pieces.run(ids, positions, md)

    assert piecewise.shape == eager.shape
    torch.testing.assert_close(piecewise, eager, rtol=1e-5, atol=1e-5)
    for ours, ref in zip(_caches(model), eager_caches):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5, equal_nan=True)
    bs = min(b for b in BUCKETS if b >= num_tokens)
    assert pieces.attn_out[num_tokens:bs].isnan().all()  # padding rows never attended


@torch.no_grad()
@pytest.mark.parametrize("kind", ["llama", "qwen2_moe"])
def test_piecewise_forward_matches_eager_under_tensor_parallelism(monkeypatch, kind):
    """Two ranks in threads (test_models_tp's summing barrier for the all-reduces): the pieces,
    whose row-parallel layers all-reduce inside them, give each rank the eager forward's hidden
    states and KV cache (what capturing them at TP=2 on GPUs would need; not yet done)."""
    from helpers.tp import ThreadAllReduce, run_ranks, set_tp

    from tinypaged.models import layers
    from tinypaged.models import moe as moe_layers

    hf = tiny_hf_model(kind, seed=7)
    weights = checkpoint_weights(hf)
    models = []
    for rank in range(2):
        set_tp(monkeypatch, rank, 2)
        models.append(build_model(hf.config, weights))
    set_tp(monkeypatch, 0, 1)  # each layer keeps the slices it was built with
    reduce = ThreadAllReduce(2)
    monkeypatch.setattr(layers, "all_reduce", reduce)
    monkeypatch.setattr(moe_layers, "all_reduce", reduce)
    monkeypatch.setattr(layers, "all_gather_columns", reduce.gather_columns)
    gen = torch.Generator().manual_seed(11)
    first = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (11, 9)]
    mixed = [[5], torch.randint(0, 256, (6,), generator=gen).tolist(),
             torch.randint(0, 256, (10,), generator=gen).tolist()]  # 17 tokens: bucket 32

    def rank_run(rank: int):
        model = models[rank]
        runner = PagedRunner(model, block_size=BLOCK_SIZE, num_blocks=24, seed=3)
        seqs = [runner.add_sequence() for _ in range(3)]
        runner.step(dict(zip(seqs, first)))
        ids, positions, md = flat_step(runner, dict(zip(seqs, mixed)))
        before = [t.clone() for t in _caches(model)]
        eager = model(ids, positions, md)
        eager_caches = [t.clone() for t in _caches(model)]
        for t, saved in zip(_caches(model), before):
            t.copy_(saved)
        pieces = PiecewiseGraphs(model, BUCKETS, torch.device("cpu"), torch.float32,
                                 capture=False)
        return eager, eager_caches, pieces.run(ids, positions, md), _caches(model)

    for eager, eager_caches, piecewise, caches in run_ranks(reduce, [
            lambda r=r: rank_run(r) for r in range(2)]):
        torch.testing.assert_close(piecewise, eager, rtol=1e-5, atol=1e-5)
        for ours, ref in zip(caches, eager_caches):
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_runner_takes_the_piecewise_path_for_steps_that_fit(tmp_path):
    """The runner's wiring: steps with prompt tokens of at most the largest bucket go through
    the pieces (run eagerly here), larger ones and pure decodes do not; tokens are unchanged."""
    import json

    from tinypaged import LLM, SamplingParams

    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64,
                  intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
                  rms_norm_eps=1e-5, torch_dtype="float32", bos_token_id=1, eos_token_id=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True, dtype="float32",
              device="cpu", enable_prefix_caching=False, max_num_seqs=8,
              max_num_batched_tokens=32, max_model_len=256)
    runner = llm.engine.runner
    pieces = PiecewiseGraphs(runner.model, [8, 16], torch.device("cpu"), torch.float32,
                             capture=False)
    sizes, steps, run, execute = [], [], pieces.run, runner.execute

    def counted(input_ids, positions, md):
        sizes.append((input_ids.shape[0], md.max_query_len))
        return run(input_ids, positions, md)

    def counted_step(step):
        steps.append(len(step.input_ids))
        return execute(step)

    pieces.run, runner.execute = counted, counted_step
    gen = torch.Generator().manual_seed(2)
    batches = [[{"prompt_token_ids": torch.randint(3, 512, (n,), generator=gen).tolist()}
                for n in lengths] for lengths in ((3, 50, 17, 9, 31, 44), (5, 9))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def generate():
        return [o.outputs[0].token_ids for prompts in batches
                for o in llm.generate(prompts, params, use_tqdm=False)]

    eager = generate()
    runner.piecewise = pieces
    assert generate() == eager
    ours_steps = steps[len(steps) // 2:]
    assert [n for n, _ in sizes] == [n for n in ours_steps if n <= 16]
    assert any(q > 1 for _, q in sizes)  # steps with prompt tokens took it
    assert any(n > 16 for n in ours_steps)  # and larger ones ran eagerly


class _RecordedGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU with a graph's contract: replay reruns the
    captured call on the captured inputs and writes into the captured outputs' memory."""

    capturing = None

    def __init__(self) -> None:
        self.call, self.outputs = None, None

    def pool(self) -> str:
        return "pool"

    def replay(self) -> None:
        for out, new in zip(self.outputs, self.call()):
            if out is not None:
                out.copy_(new)


@torch.inference_mode()
def test_capture_and_replay_wiring(monkeypatch):
    """`_capture` then `run` in graph mode: each replay's outputs are the tensors the next
    piece and the attention read (graphs emulated; weak views off, as the CPU frees at once)."""
    from helpers.graphs import fake_cuda_graphs


    fake_cuda_graphs(monkeypatch, _RecordedGraph)
    hf = tiny_hf_model("qwen3", seed=6)
    model = build_model(hf.config, checkpoint_weights(hf))
    piece = model.model.piece

    def recorded_piece(*args):
        outs, graph = piece(*args), _RecordedGraph.capturing
        if graph is not None:
            graph.call, graph.outputs, _RecordedGraph.capturing = lambda: piece(*args), outs, None
        return outs

    monkeypatch.setattr(model.model, "piece", recorded_piece)
    runner = PagedRunner(model, block_size=BLOCK_SIZE, num_blocks=24, seed=3)
    cached, fresh = runner.add_sequence(), runner.add_sequence()
    runner.step({cached: list(range(11))})
    graphs = PiecewiseGraphs(model, [16, 32], torch.device("cpu"), torch.float32)
    assert len(graphs.graphs) == 2 * (len(graphs.attns) + 1)
    for n in (13, 16, 20):
        new = {cached: [5], fresh: list(range(3, 2 + n))}
        ids, positions, md = flat_step(runner, new)
        torch.testing.assert_close(graphs.run(ids, positions, md), model(ids, positions, md),
                                   rtol=1e-5, atol=1e-5)
