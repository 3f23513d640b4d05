"""Named model shapes: the config.json of real models, to run on random weights (benchmarks).

    shape_dir("llama3-8b")                   a folder with only config.json (token ids in/out)
    shape_dir("llama3-8b", tokenizer=True)   ... plus a word-level tokenizer of the same vocabulary
    shape_dir("llama3-8b", "awq")            ... declaring an AutoAWQ int4 g128 checkpoint

With `load_format="dummy"` (vLLM's name) the engine fills the weights with small random numbers,
so no download is needed: `tinypaged serve --model-shape llama3-8b`, `tinypaged bench ...
--model-shape llama3-8b`, and `vllm serve DIR --load-format dummy` on the same folder.

The tokenizer (`tokenizer=True`) is made up, since the real ones cannot be fetched offline: one
word per id ("<unk>" 0, "<s>" 1, "</s>" 2, then "t3", "t4", ... up to vocab_size - 1), split on
whitespace and decoded with spaces between words. Every id the model can sample decodes, every
prompt of such words encodes to exactly one id per word, and the files are the standard
tokenizer.json + tokenizer_config.json that transformers, tinypaged and vLLM all load.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

SHAPES = {
    # Qwen3-0.6B: 28 layers, hidden 1024, 16/8 heads, head_dim 128, vocab 151936, tied.
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024,
        intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
    ),
    # Llama-3-8B: 32 layers, hidden 4096, 32/8 heads, head_dim 128, vocab 128256.
    "llama3-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
    ),
    # Llama-3-70B: 80 layers, hidden 8192, 64/8 heads, head_dim 128, vocab 128256 (TP >= 2).
    "llama3-70b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=8192,
        intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
    ),
    # Qwen3-30B-A3B: 48 layers, hidden 2048, 32/4 heads, head_dim 128, every layer 128 experts
    # top-8 of moe_intermediate 768 (30.5B parameters, 3.3B active per token).
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0,
    ),
}

# The formats a named shape can declare with dummy integer weights (int4, group size 128): the
# ones whose linears the loader can fill with random packed values.
DUMMY_QUANT_CONFIGS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
            "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
             "sym": True, "checkpoint_format": "gptq"},
}


def shape_dir(shape: str, quantization: str | None = None, tokenizer: bool = False) -> Path:
    """A new model folder for a named shape (see the module's docstring)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; choose from {', '.join(SHAPES)}")
    path = Path(tempfile.mkdtemp(prefix=f"tinypaged-{shape}-"))
    config = {**SHAPES[shape], "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
    if quantization in DUMMY_QUANT_CONFIGS:
        config["quantization_config"] = DUMMY_QUANT_CONFIGS[quantization]
    (path / "config.json").write_text(json.dumps(config))
    if tokenizer:
        write_word_tokenizer(path, config["vocab_size"], config["max_position_embeddings"])
    return path


def write_word_tokenizer(path: Path, vocab_size: int, max_length: int) -> None:
    """tokenizer.json and tokenizer_config.json of a one-word-per-id tokenizer (~1 s for 128k)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    special = ["<unk>", "<s>", "</s>"]
    vocab = {word: i for i, word in enumerate(special)}
    vocab.update({f"t{i}": i for i in range(len(special), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # words joined by spaces
    tok.add_special_tokens([AddedToken(word, special=True) for word in special])
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>",
              "bos_token": "<s>", "eos_token": "</s>", "model_max_length": max_length}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
