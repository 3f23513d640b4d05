"""GGUF file -> Hugging Face model directory, converted once so the normal loader can read it.

A GGUF file (llama.cpp's format) holds metadata key/values, the tokenizer and chat template, and
tensors that are either plain floats (F32, F16, BF16) or quantized in blocks along each row:

    Q8_0: 32 weights share one fp16 scale d:          w = d * q,      q int8
    Q4_0: 32 weights share one fp16 scale d:          w = d * (q - 8), q in [0, 16)
    Q4_1: 32 weights share an fp16 scale d and min m: w = d * q + m,  q in [0, 16)

The `gguf` package dequantizes every block type to float32 (`gguf.quants.dequantize`). We write the
result as plain float safetensors in the Hugging Face layout, so the rest of tinypaged (and
transformers) sees an ordinary checkpoint. Three things differ from the HF layout besides names:

- Shapes: a GGUF shape lists the fastest-varying dimension first ([in, out]); the reader's numpy
  arrays are already row-major [out, in], which is HF's `nn.Linear.weight` layout.
- MoE experts (qwen3moe) are stacked in llama.cpp, one [E, out, in] tensor per layer and
  projection (`blk.N.ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`); HF stores one tensor per
  expert (`model.layers.N.mlp.experts.E.gate_proj.weight`), so they are written unstacked.
- llama.cpp's converter permutes the rows of Q and K inside each head for the `llama` architecture
  (its rotary kernel pairs adjacent dims, HF pairs dim i with i + head_dim/2). We undo it:
  GGUF rows per head are ordered (head_dim/2, 2); HF rows are (2, head_dim/2).

The tokenizer is rebuilt by transformers (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`) and
saved as tokenizer.json with the chat template. Weights do not go through transformers: its GGUF
model loading needs `accelerate` and, in recent versions, keeps weights packed.

Everything is written to a temporary sibling directory and renamed into place at the end, so a
crash never leaves a half-written model where the cache expects a whole one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

# GGUF `general.architecture` -> (HF architecture, HF model_type, Q/K rows permuted by llama.cpp)
SUPPORTED_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe", False),
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # the MoE router
}
# MoE experts, stacked in one GGUF tensor [E, out, in] per projection; HF stores one per expert
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                 "ffn_down_exps": "down_proj"}
_MAX_SHARD_BYTES = 4 << 30


def _metadata(reader, key: str, default: Any = None) -> Any:
    """One scalar or string value of the file's metadata (default when the key is absent)."""
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.parts[field.data[0]]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(value).decode("utf-8")
    return value.tolist()[0]


def hf_tensor_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; ValueError if unknown."""
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    match = re.fullmatch(r"(\w+)\.(weight|bias)", gguf_name)
    if match and match.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[match.group(1)]}.{match.group(2)}"
    if gguf_name == "rope_freqs.weight":
        raise ValueError(
            "GGUF tensor 'rope_freqs.weight' (Llama-3.1-style rope scaling baked into the file) is "
            "not supported; load the model's Hugging Face checkpoint instead"
        )
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart we know of")


def hf_config_from_gguf(reader) -> dict[str, Any]:
    """config.json contents for the file's architecture, from its metadata."""
    arch = _metadata(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    hf_arch, model_type, _ = SUPPORTED_ARCHITECTURES[arch]
    hidden = _metadata(reader, f"{arch}.embedding_length")
    heads = _metadata(reader, f"{arch}.attention.head_count")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _metadata(reader, f"{arch}.vocab_size", len(tokens.data) if tokens else None)
    tensor_names = {t.name for t in reader.tensors}
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": _metadata(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _metadata(reader, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _metadata(reader, f"{arch}.attention.head_count_kv", heads),
        "head_dim": _metadata(reader, f"{arch}.attention.key_length", hidden // heads),
        "max_position_embeddings": _metadata(reader, f"{arch}.context_length", 4096),
        "rms_norm_eps": _metadata(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": _metadata(reader, f"{arch}.rope.freq_base", 10000.0),
        "vocab_size": vocab,
        "hidden_act": "silu",
        # llama.cpp stores no output.weight when the LM head is the embedding
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
    }
    scaling = _metadata(reader, f"{arch}.rope.scaling.type")
    if scaling == "linear":
        factor = _metadata(reader, f"{arch}.rope.scaling.factor")
        config["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    elif scaling not in (None, "none"):
        raise ValueError(f"GGUF rope scaling type {scaling!r} is not supported (only linear)")
    num_experts = _metadata(reader, f"{arch}.expert_count")
    if num_experts:  # Qwen3-MoE: every layer sparse, renormalized top-k
        moe_inter = _metadata(reader, f"{arch}.expert_feed_forward_length")
        config.update(num_experts=num_experts, moe_intermediate_size=moe_inter,
                      num_experts_per_tok=_metadata(reader, f"{arch}.expert_used_count"),
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        config["intermediate_size"] = config["intermediate_size"] or moe_inter
    for key in ("bos", "eos", "pad"):
        token_id = _metadata(reader, f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config[f"{key}_token_id"] = token_id
    return config


def _storage_dtype(reader) -> torch.dtype:
    """fp16/bf16 when every matrix is stored that way (lossless), float32 otherwise."""
    from gguf import GGMLQuantizationType as Q

    types = {t.tensor_type for t in reader.tensors if len(t.shape) > 1}
    if types == {Q.F16}:
        return torch.float16
    if types == {Q.BF16}:
        return torch.bfloat16
    return torch.float32


def _unpermute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: per head (head_dim/2, 2) -> HF's (2, head_dim/2)."""
    half = w.shape[0] // num_heads // 2
    # [num_heads, head_dim/2, 2, *rest] -> [num_heads, 2, head_dim/2, *rest]
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantized_tensors(reader, config: dict[str, Any], dtype: torch.dtype):
    """Yield (hf_name, tensor) for every tensor of the file, dequantized to `dtype`."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    permuted = SUPPORTED_ARCHITECTURES[_metadata(reader, "general.architecture")][2]
    for tensor in reader.tensors:
        experts = re.fullmatch(r"blk\.(\d+)\.(ffn_(?:gate|up|down)_exps)\.weight", tensor.name)
        name = None if experts else hf_tensor_name(tensor.name)
        if tensor.tensor_type == Q.BF16:
            # numpy has no bfloat16: take the raw 16-bit patterns into torch
            bits = np.ascontiguousarray(tensor.data).view(np.int16)
            w = torch.from_numpy(bits.copy()).view(torch.bfloat16).float()
        else:
            w = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), np.float32))
        # the reader's row-major view: numpy shape is the GGUF shape reversed
        w = w.reshape([int(d) for d in reversed(tensor.shape)])
        if experts:  # [E, out, in] -> one tensor per expert, as HF checkpoints store them
            layer, proj = experts.group(1), _EXPERT_NAMES[experts.group(2)]
            for e in range(w.shape[0]):
                yield f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight", w[e].to(dtype).clone()
            continue
        if permuted and ".self_attn.q_proj." in name:
            w = _unpermute_rows(w, config["num_attention_heads"])
        elif permuted and ".self_attn.k_proj." in name:
            w = _unpermute_rows(w, config["num_key_value_heads"])
        yield name, w.to(dtype).contiguous()


def _write_weights(reader, config: dict[str, Any], dtype: torch.dtype, out: Path) -> None:
    """model.safetensors, or shards plus model.safetensors.index.json past 4 GiB."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    files: list[str] = []

    def flush() -> None:
        files.append(f"shard-{len(files)}.safetensors")
        save_file(shards[-1], str(out / files[-1]), metadata={"format": "pt"})
        shards[-1] = {name: None for name in shards[-1]}  # keep the names, free the data

    for name, w in dequantized_tensors(reader, config, dtype):
        nbytes = w.numel() * w.element_size()
        if shards[-1] and shard_bytes + nbytes > _MAX_SHARD_BYTES:
            flush()
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = w
        shard_bytes += nbytes
    flush()
    if len(files) == 1:
        os.rename(out / files[0], out / "model.safetensors")
        return
    weight_map = {}
    for i, (file, shard) in enumerate(zip(files, shards)):
        final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        os.rename(out / file, out / final)
        weight_map.update({name: final for name in shard})
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_tokenizer(gguf_path: Path, reader, out: Path) -> None:
    """tokenizer.json + tokenizer_config.json (+ chat template), rebuilt by transformers."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    template = _metadata(reader, "tokenizer.chat_template")
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out))


def _generation_config(reader, config: dict[str, Any]) -> dict[str, Any]:
    """Stop on EOS and, where the file names one, the end-of-turn token too."""
    eos = [config["eos_token_id"]] if "eos_token_id" in config else []
    eot = _metadata(reader, "tokenizer.ggml.eot_token_id")
    if eot is not None and eot not in eos:
        eos.append(eot)
    generation = {"bos_token_id": config.get("bos_token_id")}
    if eos:
        generation["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return generation


# Bump when the conversion's output changes: caches written by an older converter (e.g. one that
# did not yet un-permute llama's Q/K rows) are then converted again instead of reused.
CONVERTER_VERSION = 2


def is_current_conversion(model_dir: str | os.PathLike) -> bool:
    """True when model_dir holds a complete conversion made by this converter version."""
    try:
        source = json.loads((Path(model_dir) / "tinypaged_source.json").read_text())
    except (OSError, ValueError):
        return False
    return source.get("converter_version") == CONVERTER_VERSION


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write an HF directory for `gguf_path` at `out_dir` (atomically); return `out_dir`.

    If `out_dir` already exists (another process finished first) it is returned untouched.
    """
    try:
        from gguf import GGUFReader
    except ImportError as error:
        raise ImportError(
            "reading GGUF files needs the 'gguf' package: pip install gguf "
            "(or pip install 'tinypaged[gguf]')"
        ) from error
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {str(gguf_path)!r} does not exist")
    reader = GGUFReader(str(gguf_path))
    config = hf_config_from_gguf(reader)
    dtype = _storage_dtype(reader)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        generation = _generation_config(reader, config)
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
        _write_tokenizer(gguf_path, reader, tmp)
        _write_weights(reader, config, dtype, tmp)
        source = {"gguf_file": gguf_path.name, "size": gguf_path.stat().st_size,
                  "converter_version": CONVERTER_VERSION}
        (tmp / "tinypaged_source.json").write_text(json.dumps(source, indent=2))
        for file in tmp.iterdir():  # mkdtemp makes the directory private; the cache need not be
            file.chmod(0o644)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not (out_dir / "config.json").is_file():
                raise
            shutil.rmtree(tmp)  # someone else published the same conversion first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
