"""The piecewise forward (piecewise_graphs.py) against the eager one, on the CPU.

Graph capture needs CUDA (benchmarks/piecewise_check.py checks it on the GPU); what is checked
here is the loop a replay runs, with each piece run eagerly on the same padded static buffers:
a mixed step (a decode, a chunk over a cached prefix, a fresh prompt) of T = bucket, bucket - 1
and bucket + 1 tokens must give the eager forward's hidden states and leave the same KV cache,
with the attention buffer's padding rows full of NaN so that any leak from them shows.
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import (
    PagedRunner,
    build_flat_batch,
    build_model,
    checkpoint_weights,
    single_thread,  # noqa: F401 - autouse fixture
    tiny_hf_model,
)

from tinypaged.config import EngineConfig
from tinypaged.models.layers import Attention
from tinypaged.piecewise_graphs import PiecewiseGraphs, supports_piecewise, token_buckets

BUCKETS = [8, 16, 32]
BLOCK_SIZE = 8


def test_token_buckets():
    assert token_buckets(8192)[:3] == [16, 32, 48]
    assert token_buckets(8192)[15:18] == [256, 288, 320]
    assert token_buckets(8192)[-1] == 512
    assert token_buckets(100) == [16, 32, 48, 64, 80, 96]
    assert token_buckets(8) == []


def test_cudagraph_mode_is_validated():
    assert EngineConfig(cudagraph_mode="FULL_AND_PIECEWISE").cudagraph_mode == "FULL_AND_PIECEWISE"
    with pytest.raises(ValueError, match="cudagraph_mode must be one of.*'PIECEWISE_ONLY'"):
        EngineConfig(cudagraph_mode="PIECEWISE_ONLY")


def test_moe_models_stay_eager():
    hf = tiny_hf_model("qwen3_moe", seed=1)
    assert not supports_piecewise(build_model(hf.config, checkpoint_weights(hf)))


def _caches(model) -> list[torch.Tensor]:
    return [t for m in model.modules() if isinstance(m, Attention) for t in (m.k_cache, m.v_cache)]


@torch.no_grad()
@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma2", "phi3"])  # q/k norm; windows
@pytest.mark.parametrize("num_tokens", [15, 16, 17])  # and soft-caps; partial rotary
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
    for s, toks in new.items():
        while len(runner.block_tables[s]) * BLOCK_SIZE < runner.num_cached[s] + len(toks):
            runner.block_tables[s].append(runner.free_blocks.pop())
    ids, positions, md = build_flat_batch(
        list(new.values()), [runner.num_cached[s] for s in new],
        [runner.block_tables[s] for s in new], BLOCK_SIZE)
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
