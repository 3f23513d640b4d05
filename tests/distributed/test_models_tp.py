"""The layers' tensor-parallel slicing, checked in one process without torch.distributed.

Each rank's model is built with the TP rank/size set in tinypaged.distributed.parallel_state, loads
the full checkpoint (its weight loaders cut the rank's slices), and the ranks then run together in
threads whose `all_reduce` sums through a barrier. TP=2 must give transformers' logits: heads split,
KV heads split or replicated (1 KV head, 2 ranks), vocabulary split (with padding when it does not
divide), fused checkpoint tensors (GLM gate_up, chatglm query_key_value) sliced per shard,
mixture-of-experts blocks (every expert's intermediate dim split, shared experts, one all-reduce). A
fake packed (AWQ-like) parameter checks the slicing along packed output columns.
"""

from __future__ import annotations

import pytest
import torch
from helpers.models import (
    PagedRunner,
    assert_logits_close,
    build_model,
    chatglm_checkpoint,
    checkpoint_weights,
    greedy_reference,
    single_thread,  # noqa: F401 - autouse fixture
    tiny_hf_model,
)
from helpers.tp import ThreadAllReduce, run_ranks, set_tp  # noqa: F401
from torch import nn

from tinypaged.models import layers
from tinypaged.models import moe as moe_layers


@pytest.mark.parametrize("kind, overrides", [
    ("llama_untied", {}),
    ("qwen3", {"num_key_value_heads": 1, "vocab_size": 251}),
    ("glm", {}),
    ("chatglm", {}),
    ("qwen2_moe", {}),
    ("glm4_moe", {}),
    ("gemma2", {}),  # windows and soft-caps per rank
    ("phi3", {}),  # the checkpoint's fused qkv_proj / gate_up_proj cut per rank
])
def test_two_ranks_match_transformers(monkeypatch, kind, overrides):
    hf = tiny_hf_model("glm" if kind == "chatglm" else kind, seed=5, **overrides)
    config, weights = (chatglm_checkpoint(hf) if kind == "chatglm"
                       else (hf.config, checkpoint_weights(hf)))
    models = []
    for rank in range(2):
        set_tp(monkeypatch, rank, 2)
        models.append(build_model(config, weights))
    set_tp(monkeypatch, 0, 1)
    reduce = ThreadAllReduce(2)
    monkeypatch.setattr(layers, "all_reduce", reduce)
    monkeypatch.setattr(moe_layers, "all_reduce", reduce)
    monkeypatch.setattr(layers, "all_gather_columns", reduce.gather_columns)
    assert models[0].num_kv_heads == max(1, hf.config.num_key_value_heads // 2)

    prompts = [list(range(3, 14)), list(range(40, 60))]
    refs = [greedy_reference(hf, p, 2) for p in prompts]
    runners = [PagedRunner(m, block_size=8, num_blocks=16, seed=2) for m in models]
    for runner in runners:
        for _ in prompts:
            runner.add_sequence()
    steps = [dict(enumerate(prompts))] + [
        {s: [tokens[i]] for s, (tokens, _) in enumerate(refs)} for i in range(2)
    ]
    for i, batch in enumerate(steps):
        outs = run_ranks(reduce, [lambda r=r, b=batch: runners[r].step(b) for r in range(2)])
        for s, p in enumerate(prompts):
            rows = slice(0, len(p)) if i == 0 else slice(len(p) + i - 1, len(p) + i)
            for out in outs:  # every rank ends with the full logits
                assert_logits_close(out[s], refs[s][1][rows], what=f"{kind} TP=2 step {i}")


class PackedQuant:
    """A stand-in for AWQ's tensors: qweight [in, out / 8] int32, output_dim 1, packed 8."""

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype) -> None:
        layer.qweight = nn.Parameter(torch.empty(input_size, output_size // 8, dtype=torch.int32),
                                     requires_grad=False)
        layer.qweight.output_dim, layer.qweight.input_dim, layer.qweight.packed_factor = 1, 0, 8

    def apply(self, layer, x, bias):
        raise NotImplementedError


@pytest.mark.parametrize("rank, size", [(0, 1), (0, 2), (1, 2), (3, 4)])
def test_packed_qkv_and_row_slices(monkeypatch, rank, size):
    set_tp(monkeypatch, rank, size)
    head_dim, heads, kv_heads, hidden = 16, 8, 2, 32
    qkv = layers.QKVParallelLinear(hidden, head_dim, heads, kv_heads, quant_config=PackedQuant())
    # Checkpoint tensors whose entries name their own packed column.
    q = torch.arange(heads * head_dim // 8, dtype=torch.int32).repeat(hidden, 1)
    k = 1000 + torch.arange(kv_heads * head_dim // 8, dtype=torch.int32).repeat(hidden, 1)
    v = 2000 + k
    for shard, tensor in zip("qkv", (q, k, v)):
        qkv.qweight.weight_loader(qkv.qweight, tensor, shard)
    q_cols, kv_cols = heads * head_dim // 8 // size, max(1, kv_heads // size) * head_dim // 8
    kv_rank = rank // max(1, size // kv_heads)
    expected = torch.cat([q[:, rank * q_cols:(rank + 1) * q_cols],
                          k[:, kv_rank * kv_cols:(kv_rank + 1) * kv_cols],
                          v[:, kv_rank * kv_cols:(kv_rank + 1) * kv_cols]], dim=1)
    assert torch.equal(qkv.qweight, expected)

    row = layers.RowParallelLinear(64, hidden, quant_config=PackedQuant())
    full = torch.arange(64 * hidden // 8, dtype=torch.int32).view(64, hidden // 8)
    row.qweight.weight_loader(row.qweight, full)
    assert torch.equal(row.qweight, full.chunk(size, dim=0)[rank])
    with pytest.raises(ValueError, match="expected shape"):
        row.qweight.weight_loader(row.qweight, full[:, :-1])
