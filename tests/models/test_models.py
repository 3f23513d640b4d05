"""Every architecture against transformers, through the engine's flat paged-batch path (CPU, fp32).

A tiny random transformers model's weights are loaded into ours; a batch of three prompts of
different lengths (crossing block boundaries, blocks from a random permutation) is prefilled in
one flat batch, then 8 decode steps are fed transformers' greedy tokens. Every logit row of every
step must agree with transformers' full-sequence forward within 1e-4 relative.
"""

from __future__ import annotations

import pytest
import torch
from helpers.models import (
    HF_KINDS,
    PagedRunner,
    assert_logits_close,
    build_model,
    chatglm_checkpoint,
    check_prefill_then_decode,
    checkpoint_weights,
    greedy_reference,
    single_thread,  # noqa: F401 - autouse fixture
    tiny_hf_model,
)

PROMPT_LENS = (5, 19, 35)
DECODE_STEPS = 8


def random_prompt(length: int, seed: int, vocab: int = 256) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


def model_pair(kind: str):
    """(transformers model, our model with its weights)."""
    if kind == "chatglm":
        hf = tiny_hf_model("glm", seed=3)
        config, weights = chatglm_checkpoint(hf)
        return hf, build_model(config, weights)
    hf = tiny_hf_model(kind, seed=len(kind))
    return hf, build_model(hf.config, checkpoint_weights(hf))


@pytest.mark.parametrize("kind", [*HF_KINDS, "chatglm"])
def test_prefill_and_decode_match_transformers(kind):
    hf, model = model_pair(kind)
    block_size = 8 if kind in ("llama", "qwen3", "glm", "chatglm") else 16
    runner = PagedRunner(model, block_size=block_size, num_blocks=32, seed=len(kind))
    prompts = [random_prompt(n, seed=n) for n in PROMPT_LENS]
    check_prefill_then_decode(runner, hf, prompts, DECODE_STEPS, what=kind)


@pytest.mark.parametrize("kind", ["qwen3", "gemma2"])  # gemma2: windows of 8 tokens, soft-caps
def test_chunked_prefill_over_cached_prefix(kind):
    """A prompt prefilled in two chunks (the second attending to the cached first) in a mixed
    batch with another sequence's prefill and then decode, against transformers."""
    hf, model = model_pair(kind)
    runner = PagedRunner(model, block_size=8, num_blocks=16, seed=1)
    long_prompt, short_prompt = random_prompt(30, seed=7), random_prompt(9, seed=8)
    _, long_ref = greedy_reference(hf, long_prompt, 0)
    short_next, short_ref = greedy_reference(hf, short_prompt, 1)
    a, b = runner.add_sequence(), runner.add_sequence()

    out = runner.step({a: long_prompt[:13], b: short_prompt})
    assert_logits_close(out[a], long_ref[:13], what="first chunk")
    assert_logits_close(out[b], short_ref[:9], what="prefill beside the first chunk")
    out = runner.step({b: short_next, a: long_prompt[13:]})
    assert_logits_close(out[a], long_ref[13:30], what="second chunk over the cached prefix")
    assert_logits_close(out[b], short_ref[9:10], what="decode beside the second chunk")


def test_model_exposes_cache_geometry():
    _, model = model_pair("qwen3")
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (2, 2, 32)
    hidden = torch.randn(3, 64)
    assert model.compute_logits(hidden).dtype == torch.float32
    # A bf16 model's logits stay bf16 (the sampler upcasts only past a plain argmax).
    logits = model.to(torch.bfloat16).compute_logits(hidden.bfloat16())
    assert logits.dtype == torch.bfloat16 and logits.shape == (3, model.spec.vocab_size)


def test_layer_windows_from_every_config_style():
    from types import SimpleNamespace

    from tinypaged.models.decoder import read_layer_windows

    def config(**fields):
        return SimpleNamespace(num_hidden_layers=6, sliding_window=8, **fields)

    assert read_layer_windows(config()) == (8,) * 6  # Mistral: every layer
    assert read_layer_windows(config(sliding_window_pattern=3)) == (8, 8, None) * 2  # Gemma 3 4.x
    types = ["sliding_attention", "full_attention"] * 3
    assert read_layer_windows(config(layer_types=types)) == (8, None) * 3
    assert read_layer_windows(config(use_sliding_window=False)) == ()  # Qwen2 4.x
    assert read_layer_windows(config(layer_types=["full_attention"] * 6)) == ()
    assert read_layer_windows(SimpleNamespace(num_hidden_layers=2, sliding_window=None)) == ()

