"""Shared test utilities: tiny random transformers models, and the flat paged batch the engine runs.

- `tiny_hf_model(kind)`, `chatglm_checkpoint`, `save_tiny`: tinypaged/bench/tiny_models.py's
  tiny random models of every architecture (shared with the GPU checks in benchmarks/).
- `checkpoint_weights(hf_model)`: the tensors `save_pretrained` writes (for MoE models one tensor
  per expert and projection, not transformers' in-memory stacked experts).
- `greedy_reference(hf_model, prompt, steps)`: transformers' greedy continuation and its
  full-sequence logits; `check_llm_greedy(llm, hf_model, prompts)`: LLM's greedy tokens are it.
- `write_dummy_llama(path)`: a tiny Llama checkpoint with no weights (load_format="dummy"), for
  the tests that start whole engines (engine processes, data parallelism).
- `saved_tiny_model(tmp_path_factory, kind, ...)` a tiny random checkpoint in a new folder, and
  `run_engine(model_dir, run, **engine_args)`: run(llm) on an LLM that is shut down after (the
  reference tokens of the multi-process tests' module fixtures).
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
from torch import nn

from tinypaged.bench.model_shapes import write_word_tokenizer
from tinypaged.bench.tiny_models import (  # noqa: F401  (the tests import them from here)
    HF_KINDS,
    TINY,
    chatglm_checkpoint,
    randomize_,
    save_tiny,
    tiny_hf_model,
)
from tinypaged.models.attention_metadata import AttentionMetadata
from tinypaged.models.layers import Attention
from tinypaged.models.registry import get_model_class
from tinypaged.sampling.params import SamplingParams


def saved_tiny_model(tmp_path_factory, kind: str, seed: int, **overrides) -> str:
    """A tiny random `kind` checkpoint (tiny_hf_model) saved in a new temporary folder."""
    path = tmp_path_factory.mktemp(kind)
    tiny_hf_model(kind, seed=seed, **overrides).save_pretrained(path)
    return str(path)


def run_engine(model_dir: str, run, **engine_args):
    """run(llm) on a new LLM over model_dir; the LLM (and its worker processes) is shut down
    after, whatever run does."""
    from tinypaged import LLM

    llm = LLM(model_dir, **engine_args)
    try:
        return run(llm)
    finally:
        llm.shutdown()


def save_byte_tokenizer(path) -> None:
    """A byte-level tokenizer with no merges (256 ids, one per byte): needs no training data.
    Byte b gets id b, in every process (ByteLevel.alphabet() itself comes in a new order in
    each one, which made tests depend on the run): ids 0-31 are control bytes, so an eos id
    there is never a character of the text a grammar asks for."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # GPT-2's byte -> character map: printable bytes as they are, the others from chr(256) up
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    rest = iter(chr(256 + n) for n in range(256 - len(keep)))
    alphabet = [chr(b) if b in keep else next(rest) for b in range(256)]
    vocab = {ch: i for i, ch in enumerate(alphabet)}
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


def check_llm_greedy(llm, hf_model, prompts: list[list[int]], steps: int = 6) -> None:
    """LLM.generate's greedy tokens for each token-id prompt equal transformers'."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == greedy_reference(hf_model, p, steps)[0]


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


def paged_logits(model: nn.Module, prompts: list[list[int]], steps: int,
                 kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The logits of all prompts prefilled in one flat batch, then `steps` decode steps (token
    40 + t for every sequence), all rows concatenated; a fresh 32 x 4-token-block cache of
    `kv_dtype` (the model's dtype when None), unused slots 0."""
    runner = PagedRunner(model, block_size=4, num_blocks=32)
    allocate_kv_cache(model, 32, 4, dtype=kv_dtype, fill=0.0)
    seqs = [runner.add_sequence() for _ in prompts]
    out = [runner.step(dict(zip(seqs, prompts)))]
    for t in range(steps):
        out.append(runner.step({s: [t + 40] for s in seqs}))
    return torch.cat([torch.cat([o[s] for s in seqs]) for o in out])


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


def prompts(n: int, seed: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 250) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def write_dummy_llama(path, vocab_size: int = 512) -> str:
    """A tiny Llama's config.json and a word tokenizer in `path`, no weights: engines load it
    with load_format="dummy". Returns the path as a string."""
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64,
                  intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=256,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="float32",
                  bos_token_id=1, eos_token_id=2)
    (path / "config.json").write_text(json.dumps(config))
    write_word_tokenizer(path, vocab_size, 256)
    return str(path)
