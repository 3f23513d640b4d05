"""Shared test utilities: tiny random transformers models, and the flat paged batch the engine runs.

- `tiny_hf_model(kind)`: a 2-layer random transformers model (fp32, eager attention) of one of
  `HF_KINDS`, with every parameter (biases and norm weights too) drawn at random, so that a
  mis-loaded tensor cannot hide behind a zero bias or a unit norm.
- `checkpoint_weights(hf_model)`: the tensors `save_pretrained` writes (for MoE models one tensor
  per expert and projection, not transformers' in-memory stacked experts).
- `chatglm_checkpoint(glm_model)`: the same GLM weights renamed into the original chatglm layout,
  with a chatglm-style config.
- `greedy_reference(hf_model, prompt, steps)`: transformers' greedy continuation and its
  full-sequence logits.
- `PagedRunner`: what the engine does for a batch, on a small scale: a paged KV cache per layer,
  blocks handed out from a random permutation, and `step({seq: new_tokens})` building the flat
  batch (`build_flat_batch`) and returning the logits of every new token.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from tinypaged.models.attention_metadata import AttentionMetadata
from tinypaged.models.layers import Attention
from tinypaged.models.registry import get_model_class

TINY = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
}

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}

_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0,  # 8 frequencies of head_dim 16
             "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
             "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.5, 11.5, 15.0],
             "original_max_position_embeddings": 64}

HF_KINDS = {
    # kind: (config class, extra config fields)
    "llama": ("LlamaConfig", {"tie_word_embeddings": True}),
    "llama3_scaling": ("LlamaConfig", {"tie_word_embeddings": True, "rope_scaling": _LLAMA3_ROPE}),
    "llama_untied": ("LlamaConfig", {"tie_word_embeddings": False, "rope_theta": 1000.0}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}),
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": True, "head_dim": 32}),
    "glm": ("GlmConfig", {"head_dim": 16, "pad_token_id": 0, "eos_token_id": 1}),
    "glm4": ("Glm4Config", {"head_dim": 16, "pad_token_id": 0, "eos_token_id": 1}),
    # mixture of experts: layer 0 sparse (with a shared expert) and layer 1 dense
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 8, "num_experts_per_tok": 3,
                                     "moe_intermediate_size": 32, "norm_topk_prob": False,
                                     "shared_expert_intermediate_size": 48,
                                     "mlp_only_layers": [1]}),
    # every layer sparse, renormalized top-k, q/k norm
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "norm_topk_prob": True,
                                     "head_dim": 32}),
    # first layer dense, then grouped sigmoid routing with a bias, scaling, 2 shared experts
    "glm4_moe": ("Glm4MoeConfig", {"head_dim": 32, "n_routed_experts": 8,
                                   "num_experts_per_tok": 3, "moe_intermediate_size": 32,
                                   "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
                                   "n_shared_experts": 2, "routed_scaling_factor": 2.5,
                                   "use_qk_norm": True, "attention_bias": True,
                                   "pad_token_id": 0, "eos_token_id": 1}),
    # sliding windows (8 tokens) shorter than the prompts; soft-caps low enough to bite
    "mistral": ("MistralConfig", {"sliding_window": 8, "head_dim": 16}),
    "qwen2_sliding": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 8,
                                      "max_window_layers": 1}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "sliding_window": 8, "pad_token_id": 0,
                                "attn_logit_softcapping": 0.5, "final_logit_softcapping": 1.5}),
    "gemma3": ("Gemma3TextConfig", {
        "head_dim": 16, "sliding_window": 8, "pad_token_id": 0, "query_pre_attn_scalar": 32,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}}),
    "phi3": ("Phi3Config", {"pad_token_id": 0, "eos_token_id": 1, "sliding_window": 8,
                            "partial_rotary_factor": 0.5}),
    # rope scaling computed by transformers.modeling_rope_utils
    "qwen3_yarn": ("Qwen3Config", {"head_dim": 32, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 32}}),
    "llama_dynamic": ("LlamaConfig", {"rope_parameters": {
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}),
    "phi3_longrope": ("Phi3Config", {"pad_token_id": 0, "eos_token_id": 1,
                                     "original_max_position_embeddings": 64,
                                     "rope_parameters": _LONGROPE}),
}


def save_byte_tokenizer(path) -> None:
    """A byte-level tokenizer with no merges (256 ids, one per byte): needs no training data."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(path))


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Import into a test module to run it on one torch thread: for tiny matmuls on a shared
    2-core machine the thread pool costs ten times what it saves."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def randomize_(model: nn.Module, seed: int) -> nn.Module:
    """Every parameter random: norm weights in [0.5, 1.5], MoE router weights N(0, 1) (wide
    gaps between expert scores, so that bf16 rounding seldom flips a choice), all others
    N(0, 0.1^2); and the MoE routers' score-correction biases (buffers) too."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        biases = [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
        for name, p in [*model.named_parameters(), *zip(["bias"] * len(biases), biases)]:
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def tiny_hf_model(kind: str, seed: int = 0, **overrides):
    """A random transformers model of `kind` (a key of HF_KINDS), fp32, eager attention."""
    import transformers  # imported here so that subprocess tests can use this file without it

    class_name, extra = HF_KINDS[kind]
    config = getattr(transformers, class_name)(**{**TINY, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    return randomize_(model, seed).eval()


def checkpoint_weights(hf_model) -> dict[str, torch.Tensor]:
    """What `hf_model.save_pretrained` writes, read back: the checkpoint layout users have."""
    import tempfile
    from pathlib import Path

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        hf_model.save_pretrained(tmp)
        weights = {}
        for file in sorted(Path(tmp).glob("*.safetensors")):
            weights.update(load_file(str(file)))
    return weights


def chatglm_checkpoint(glm):
    """(config, state dict) of `glm` (a GlmForCausalLM) in the original chatglm format."""
    import transformers

    c = glm.config
    rope = c.rope_parameters
    config = transformers.PretrainedConfig(
        architectures=["ChatGLMModel"], model_type="chatglm",
        num_layers=c.num_hidden_layers, padded_vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        ffn_hidden_size=c.intermediate_size, kv_channels=c.head_dim,
        num_attention_heads=c.num_attention_heads, multi_query_attention=True,
        multi_query_group_num=c.num_key_value_heads, layernorm_epsilon=c.rms_norm_eps,
        add_qkv_bias=True, add_bias_linear=False, rope_ratio=rope["rope_theta"] / 10000.0,
        seq_length=c.max_position_embeddings, rmsnorm=True,
        apply_residual_connection_post_layernorm=False, post_layer_norm=True, original_rope=True,
        tie_word_embeddings=False,
    )
    sd = glm.state_dict()
    out = {
        "transformer.embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
        "transformer.encoder.final_layernorm.weight": sd["model.norm.weight"],
        "transformer.output_layer.weight": sd["lm_head.weight"],
        "transformer.rotary_pos_emb.inv_freq": torch.ones(c.head_dim // 4),
    }
    for i in range(c.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"transformer.encoder.layers.{i}."
        attn = src + "self_attn."
        for kind in ("weight", "bias"):
            out[dst + f"self_attention.query_key_value.{kind}"] = torch.cat(
                [sd[attn + f"{p}_proj.{kind}"] for p in "qkv"]
            )
        out[dst + "self_attention.dense.weight"] = sd[attn + "o_proj.weight"]
        out[dst + "mlp.dense_h_to_4h.weight"] = sd[src + "mlp.gate_up_proj.weight"]
        out[dst + "mlp.dense_4h_to_h.weight"] = sd[src + "mlp.down_proj.weight"]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[dst + f"{norm}.weight"] = sd[src + f"{norm}.weight"]
    return config, out


def build_model(hf_config, weights: dict[str, torch.Tensor], dtype=torch.float32,
                device: str = "cpu") -> nn.Module:
    """What the loader does, from in-memory tensors: pick the class, build it, load the weights."""
    cls = get_model_class(hf_config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(hf_config)
    finally:
        torch.set_default_dtype(previous)
    model.load_weights(weights.items())
    return model.eval()


@torch.no_grad()
def greedy_reference(hf_model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation (`steps` tokens) and the logits [len + steps, vocab] of
    one full forward over prompt + continuation."""
    ids = list(prompt)
    for _ in range(steps):
        logits = hf_model(torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):], hf_model(torch.tensor([ids])).logits[0].float()


def build_flat_batch(new_tokens: list[list[int]], num_cached: list[int],
                     block_tables: list[list[int]], block_size: int, device="cpu"):
    """(input_ids [T], positions [T], AttentionMetadata) for B sequences whose first
    `num_cached[b]` tokens are already in the cache and `new_tokens[b]` follow."""
    ids, positions, slots, starts, seq_lens = [], [], [], [0], []
    for toks, cached, table in zip(new_tokens, num_cached, block_tables):
        total = cached + len(toks)
        if len(table) < math.ceil(total / block_size):
            raise ValueError(f"block table {table} too short for {total} tokens")
        for p in range(cached, total):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        ids += toks
        starts.append(starts[-1] + len(toks))
        seq_lens.append(total)
    width = max(len(t) for t in block_tables)
    tables = [t + [0] * (width - len(t)) for t in block_tables]
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        max_query_len=max(len(t) for t in new_tokens),
        max_seq_len=max(seq_lens),
    )
    ids_t = torch.tensor(ids, dtype=torch.int64, device=device)
    return ids_t, torch.tensor(positions, dtype=torch.int64, device=device), md


def allocate_kv_cache(model: nn.Module, num_blocks: int, block_size: int, dtype=None,
                      device=None, fill: float = float("nan")) -> int:
    """Give every Attention layer its k_cache / v_cache; returns the number of layers. Unused
    slots hold `fill` (NaN by default) so that reading a slot never written shows up."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for attn in layers:
        shape = (num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
        like = next(model.parameters())
        kw = {"dtype": dtype or like.dtype, "device": device or like.device}
        attn.k_cache = torch.full(shape, fill, **kw)
        attn.v_cache = torch.full(shape, fill, **kw)
    return len(layers)


class PagedRunner:
    """Runs a model over sequences the way the engine does: blocks from a random permutation,
    one flat batch per step, any mix of prefill, chunked prefill and decode."""

    def __init__(self, model: nn.Module, block_size: int = 16, num_blocks: int = 64,
                 seed: int = 0) -> None:
        self.model, self.block_size = model, block_size
        allocate_kv_cache(model, num_blocks, block_size)
        gen = torch.Generator().manual_seed(seed)
        self.free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
        self.num_cached: list[int] = []
        self.block_tables: list[list[int]] = []

    def add_sequence(self) -> int:
        self.num_cached.append(0)
        self.block_tables.append([])
        return len(self.num_cached) - 1

    @torch.no_grad()
    def step(self, new_tokens: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Run the new tokens of each listed sequence in one flat batch; returns each
        sequence's logits [num_new, vocab] (float32)."""
        seqs = list(new_tokens)
        for s in seqs:
            total = self.num_cached[s] + len(new_tokens[s])
            while len(self.block_tables[s]) * self.block_size < total:
                self.block_tables[s].append(self.free_blocks.pop())
        device = next(self.model.parameters()).device
        ids, positions, md = build_flat_batch(
            [new_tokens[s] for s in seqs], [self.num_cached[s] for s in seqs],
            [self.block_tables[s] for s in seqs], self.block_size, device,
        )
        logits = self.model.compute_logits(self.model(ids, positions, md))  # [T, vocab]
        out, start = {}, 0
        for s in seqs:
            n = len(new_tokens[s])
            out[s] = logits[start : start + n]
            start += n
            self.num_cached[s] += n
        return out


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-4,
                        what: str = "") -> None:
    """max |ours - ref| <= rtol * max |ref|."""
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    err = (ours.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert err <= rtol * scale, f"{what}: max abs error {err:.3g} > {rtol} * {scale:.3g}"


def check_prefill_then_decode(runner: PagedRunner, hf_model, prompts: list[list[int]],
                              steps: int, what: str = "") -> None:
    """All prompts prefilled in one flat batch, then `steps` batched decode steps fed with
    transformers' greedy tokens: every logit row must match transformers' full forward."""
    refs = [greedy_reference(hf_model, p, steps) for p in prompts]  # (tokens, logits)
    seqs = [runner.add_sequence() for _ in prompts]
    out = runner.step(dict(zip(seqs, prompts)))
    for s, p, (_, ref) in zip(seqs, prompts, refs):
        assert_logits_close(out[s], ref[: len(p)], what=f"{what} prefill of {len(p)} tokens")
    for i in range(steps):
        out = runner.step({s: [tokens[i]] for s, (tokens, _) in zip(seqs, refs)})
        for s, p, (_, ref) in zip(seqs, prompts, refs):
            assert_logits_close(out[s], ref[len(p) + i : len(p) + i + 1],
                                what=f"{what} decode step {i} of seq {s}")


def count_preemptions(scheduler) -> list[int]:
    """Wrap `scheduler.schedule` so that the returned one-element list counts the sequences it
    preempts: tests that mean to exercise preemption assert it happened."""
    schedule, preempted = scheduler.schedule, [0]

    def counting_schedule():
        out = schedule()
        preempted[0] += len(out.preempted)
        return out

    scheduler.schedule = counting_schedule
    return preempted


def generate_cli(model_dir, prompt: str, *flags: str) -> str:
    """stdout of `python -m tinypaged generate MODEL PROMPT --max-tokens 5` with the small engine
    the quantized-checkpoint tests use (64 KV blocks, 128 tokens), run from this checkout."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    cli = subprocess.run(
        [sys.executable, "-m", "tinypaged", "generate", str(model_dir), prompt, "--max-tokens", "5",
         "--num-kv-blocks", "64", "--max-model-len", "128", *flags],
        cwd=repo, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(repo)},
    )
    assert cli.returncode == 0, cli.stderr[-2000:]
    return cli.stdout


def save_tiny(kind: str, path) -> torch.nn.Module:
    """Write a tiny random model of `kind` to `path`; returns the transformers reference."""
    hf = tiny_hf_model("glm" if kind == "chatglm" else kind, seed=3)
    if kind == "chatglm":
        config, weights = chatglm_checkpoint(hf)
        (path / "config.json").write_text(json.dumps(config.to_dict()))
        save_file({k: v.contiguous() for k, v in weights.items()}, path / "model.safetensors")
    else:
        hf.save_pretrained(path)
    return hf


def prompts(n: int, seed: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 250) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
