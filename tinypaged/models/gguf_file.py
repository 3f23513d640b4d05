"""GGUF file -> a small model directory (config, tokenizer) whose weights stay in the file.

A GGUF file (llama.cpp's format) holds metadata key/values, the tokenizer and chat template, and
tensors that are plain floats (F32, F16, BF16) or quantized in blocks along each row (Q8_0,
Q4_0, Q4_1, Q4_K, Q5_K, Q6_K: tinypaged/kernels/gguf_format.py has the layouts). Converted once
and cached: config.json from the metadata (with quantization_config {"quant_method": "gguf"}),
the tokenizer rebuilt by transformers (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`) and
saved with the chat template, and generation_config.json with the stop tokens. The weights are
not converted: `gguf_weights` streams them out of the file's memory map in their own block
format, and the model keeps them that way (quantization/gguf.py). Two things differ from the
HF layout besides names:

- Shapes: a GGUF shape lists the fastest-varying dimension first ([in, out]); the reader's numpy
  arrays are already row-major [out, in rows of bytes], HF's `nn.Linear.weight` layout.
- llama.cpp's converter permutes the rows of Q and K inside each head for the `llama` architecture
  (also Mistral's files; its rotary kernel pairs adjacent dims, HF pairs dim i with
  i + head_dim/2; GLM pairs adjacent dims itself, so `glm4` files are not permuted). We undo it:
  GGUF rows per head are ordered (head_dim/2, 2); HF rows are (2, head_dim/2). A row is whole
  blocks, so this moves rows of quantized bytes unchanged.
- MoE experts (qwen3moe) are stacked, one [E, out, in] tensor per layer and projection
  (`blk.N.ffn_gate_exps`, ...); HF names one per expert (`model.layers.N.mlp.experts.E.
  gate_proj.weight`), so they are yielded unstacked, and (the MoE layers taking float weights
  only) a MoE file's tensors are all dequantized to float32 at load: config.json then declares
  no quantization.

Everything is written to a temporary sibling directory and renamed into place at the end, so a
crash never leaves a half-written model where the cache expects a whole one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tinypaged.host.packages import require

# GGUF `general.architecture` -> (HF architecture, HF model_type, Q/K rows permuted by llama.cpp)
SUPPORTED_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe", False),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe", False),
    "phi3": ("Phi3ForCausalLM", "phi3", False),
    "gemma2": ("Gemma2ForCausalLM", "gemma2", False),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text", False),
    "glm4": ("Glm4ForCausalLM", "glm4", False),  # GLM-4-0414; llama.cpp pairs dims like GLM
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
    "attn_qkv": "self_attn.qkv_proj",  # fused [q; k; v] rows (phi3)
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",  # qwen2moe's shared expert and its gate
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# per architecture, GGUF names that mean another HF module: phi3's ffn_up is [gate; up]
_ARCH_LAYER_NAMES = {
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
    # Gemma's four norms a layer
    "gemma2": {"post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
_ARCH_LAYER_NAMES["gemma3"] = _ARCH_LAYER_NAMES["gemma2"]
# GLM-4-0414: [gate; up] fused in ffn_up; a norm after attention and one after the MLP
_ARCH_LAYER_NAMES["glm4"] = {"ffn_up": "mlp.gate_up_proj",
                             "post_attention_norm": "post_self_attn_layernorm",
                             "ffn_norm": "post_attention_layernorm",
                             "post_ffw_norm": "post_mlp_layernorm"}
# llama.cpp stores Gemma's RMSNorm weights w as 1 + w (its norms multiply by the weight)
_NORMS_PLUS_ONE = {"gemma2", "gemma3"}
# MoE experts, stacked in one GGUF tensor [E, out, in] per projection; HF names one per expert
_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")


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


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` for GGUF architecture
    `arch`; ValueError if unknown."""
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if match and match.group(2) in names:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{names[part]}.{kind}"
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
        "sliding_window": None,  # llama.cpp runs every architecture here with full attention
    }
    if arch == "gemma2":  # GeGLU, soft-capping, and local layers alternating with global ones
        config.update(
            hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh",
            sliding_window=_metadata(reader, f"{arch}.attention.sliding_window", 4096),
            attn_logit_softcapping=_metadata(reader, f"{arch}.attn_logit_softcapping", 50.0),
            final_logit_softcapping=_metadata(reader, f"{arch}.final_logit_softcapping", 30.0),
            # llama.cpp's attention scale: head_dim^-1/2, except (hidden / heads)^-1/2 for the
            # 46-layer Gemma-2-27B
            query_pre_attn_scalar=hidden // heads if config["num_hidden_layers"] == 46
            else config["head_dim"])
    if arch == "gemma3":  # every sixth layer global (llama.cpp's pattern), q/k norms
        layers = config["num_hidden_layers"]
        config.update(
            hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh",
            sliding_window=_metadata(reader, f"{arch}.attention.sliding_window", 1024),
            layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                         for i in range(layers)],
            # llama.cpp: head_dim^-1/2, except (hidden / heads)^-1/2 for the 62-layer 27B
            query_pre_attn_scalar=hidden // heads if layers == 62 else config["head_dim"],
            # local layers keep rotary base 10000; the file's base and scaling are the global's
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "default",
                                                "rope_theta": config.pop("rope_theta")}})
    rotary = _metadata(reader, f"{arch}.rope.dimension_count")
    if rotary and rotary < config["head_dim"]:  # partial rotary (Phi-4-mini)
        config["partial_rotary_factor"] = rotary / config["head_dim"]
    scaling = _metadata(reader, f"{arch}.rope.scaling.type")
    if scaling == "linear":
        factor = _metadata(reader, f"{arch}.rope.scaling.factor")
        if "rope_parameters" in config:  # gemma3: the global layers' rotary
            config["rope_parameters"]["full_attention"].update(rope_type="linear", factor=factor)
        else:
            config["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    elif scaling not in (None, "none"):
        raise ValueError(f"GGUF rope scaling type {scaling!r} is not supported (only linear)")
    num_experts = _metadata(reader, f"{arch}.expert_count")
    if num_experts:  # every layer sparse; Qwen3-MoE renormalizes the top-k weights
        moe_inter = _metadata(reader, f"{arch}.expert_feed_forward_length")
        config.update(num_experts=num_experts, moe_intermediate_size=moe_inter,
                      num_experts_per_tok=_metadata(reader, f"{arch}.expert_used_count"),
                      norm_topk_prob=arch == "qwen3moe", decoder_sparse_step=1,
                      mlp_only_layers=[])
        if arch == "qwen2moe":  # plus a shared expert, gated
            config["shared_expert_intermediate_size"] = _metadata(
                reader, f"{arch}.expert_shared_feed_forward_length")
        config["intermediate_size"] = config["intermediate_size"] or moe_inter
    for key in ("bos", "eos", "pad"):
        token_id = _metadata(reader, f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config[f"{key}_token_id"] = token_id
    return config


def _storage_dtype(reader) -> torch.dtype:
    """The activations' dtype hint: fp16/bf16 when every matrix is stored that way, else fp32
    (which "auto" runs as bf16 on the GPU and fp32 on the CPU)."""
    from gguf import GGMLQuantizationType as Q

    types = {t.tensor_type for t in reader.tensors if len(t.shape) > 1}
    if types == {Q.F16}:
        return torch.float16
    if types == {Q.BF16}:
        return torch.bfloat16
    return torch.float32


def _unpermute_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: per head (head_dim/2, 2) -> HF's (2, head_dim/2).
    Rows are whole (a row of blocks moves as one), so this works on quantized data too."""
    half = rows.shape[0] // num_heads // 2
    # [num_heads, head_dim/2, 2, row] -> [num_heads, 2, head_dim/2, row]
    return rows.reshape(num_heads, half, 2, -1).swapaxes(1, 2).reshape(rows.shape)


def _tensor_index(reader) -> list[list]:
    """[gguf name, GGML type, shape [out, in], byte offset in the file] per tensor, so that
    loads read the file through a memory map without parsing its metadata again (the gguf
    package's reader takes seconds on a 49k-token vocabulary). Unknown tensors fail here."""
    arch = _metadata(reader, "general.architecture")
    for tensor in reader.tensors:
        if not _EXPERTS.fullmatch(tensor.name):
            hf_tensor_name(tensor.name, arch)
    return [[t.name, int(t.tensor_type), [int(d) for d in reversed(t.shape)], int(t.data_offset)]
            for t in reader.tensors]  # GGUF lists the fastest-varying dimension first


def _dense(rows: np.ndarray, type_id: int, K: int) -> torch.Tensor:
    from tinypaged.kernels.gguf_format import gguf_dequantize_reference

    return gguf_dequantize_reference(torch.from_numpy(np.array(rows)), type_id, K)


def gguf_weights(model_dir: str | os.PathLike) -> Iterator[tuple[str, Any]]:
    """(HF name, weight) for every tensor of a converted directory's .gguf, read lazily from a
    memory map of the file: a `GGUFWeight` (the file's rows, still in their block format) for
    each matrix, a float32 tensor for each vector (norms, biases). A progress bar counts them."""
    from tqdm.auto import tqdm

    from tinypaged.kernels.gguf_format import DENSE_TYPES, row_bytes
    from tinypaged.quantization.gguf import GGUFWeight

    source = json.loads((Path(model_dir) / SOURCE_FILE).read_text())
    path = gguf_file_of(model_dir)
    if path.stat().st_size != source["size"]:
        raise ValueError(f"{path} changed since it was read ({source['size']} bytes then, "
                         f"{path.stat().st_size} now); load the .gguf file again")
    heads = {".self_attn.q_proj.": source["qk_heads"][0],
             ".self_attn.k_proj.": source["qk_heads"][1]} if source["qk_heads"] else {}
    file = np.memmap(path, dtype=np.uint8, mode="r")
    bar = tqdm(source["tensors"], desc=f"Loading {path.name}", unit="tensor", leave=False,
               file=sys.stderr)
    for gguf_name, type_id, shape, offset in bar:
        nbytes = int(np.prod(shape[:-1])) * row_bytes(type_id, shape[-1])
        raw = file[offset : offset + nbytes]
        experts = _EXPERTS.fullmatch(gguf_name)
        if experts:  # [E, out, in] -> one float32 tensor per expert (MoE layers are dense)
            layer, proj = experts.groups()
            for e, rows in enumerate(raw.reshape(shape[0], shape[1], -1)):
                yield (f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight",
                       _dense(rows, type_id, shape[-1]))
            continue
        # caches written before "arch" was recorded hold no architecture with names of its own
        name = hf_tensor_name(gguf_name, source.get("arch", "llama"))
        if len(shape) == 1:  # vectors are F32 (or F16 / BF16): plain floats
            if type_id not in DENSE_TYPES:
                raise ValueError(f"GGUF tensor {gguf_name!r} is a quantized vector")
            vector = torch.from_numpy(np.array(raw)).view(DENSE_TYPES[type_id]).float()
            if source.get("arch") in _NORMS_PLUS_ONE and name.endswith("norm.weight"):
                vector -= 1
            if name.endswith("shared_expert_gate.weight"):  # llama.cpp's [hidden]: HF's [1, hidden]
                vector = vector[None]
            yield name, vector
            continue
        rows = raw.reshape(shape[0], -1)  # [out, row_bytes]
        for part, num_heads in heads.items():
            if part in name:
                rows = _unpermute_rows(rows, num_heads)
        if source.get("dense"):  # a model whose layers take float weights only (MoE)
            yield name, _dense(rows, type_id, shape[-1])
        else:
            yield name, GGUFWeight(type_id, rows, (shape[0], shape[1]))
    bar.close()


def dense_state_dict(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a converted directory's .gguf under its HF name, dequantized to float32:
    the file as a transformers model would hold it (for `tinypaged quantize`)."""
    from tinypaged.kernels.gguf_format import gguf_dequantize_reference
    from tinypaged.quantization.gguf import GGUFWeight

    state = {}
    for name, w in gguf_weights(model_dir):
        if isinstance(w, GGUFWeight):
            w = gguf_dequantize_reference(torch.from_numpy(np.array(w.data)), w.type_id,
                                          w.shape[1])
        state[name] = w
    return state


def _write_tokenizer(gguf_path: Path, reader, out: Path) -> None:
    """tokenizer.json + tokenizer_config.json (+ chat template), rebuilt by transformers: by
    AutoTokenizer where transformers reads the architecture's GGUF files (it then picks the
    model's tokenizer class), else (glm4) by the generic fast tokenizer from the vocabulary."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    known = _metadata(reader, "general.architecture") in GGUF_SUPPORTED_ARCHITECTURES
    cls = AutoTokenizer if known else PreTrainedTokenizerFast
    tokenizer = cls.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
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


# Bump when the conversion's output changes: caches written by an older converter (e.g. the fp32
# safetensors copy of versions 1-2) are then converted again instead of reused.
CONVERTER_VERSION = 3
SOURCE_FILE = "tinypaged_source.json"


def is_current_conversion(model_dir: str | os.PathLike) -> bool:
    """True when model_dir holds a complete conversion made by this converter version."""
    try:
        source = json.loads((Path(model_dir) / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return source.get("converter_version") == CONVERTER_VERSION


def packed_weight_bytes(model_dir: str | os.PathLike) -> int | None:
    """Bytes of every tensor of a converted directory as the model keeps them: each row in its
    GGUF blocks (a Q4_K weight 4.5 bits, Q6_K 6.5625, ...). None for a directory that is not a
    GGUF conversion or whose model holds float copies (MoE files)."""
    from tinypaged.kernels.gguf_format import row_bytes

    try:
        source = json.loads((Path(model_dir) / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    if source.get("dense") or "tensors" not in source:
        return None
    return sum(int(np.prod(shape[:-1])) * row_bytes(type_id, shape[-1])
               for _, type_id, shape, _ in source["tensors"])


def gguf_file_of(model_dir: str | os.PathLike) -> Path | None:
    """The .gguf file whose weights a converted directory stands for (None: not a conversion).
    A file kept inside the directory (the default model) is named relative to it."""
    try:
        source = json.loads((Path(model_dir) / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    if "gguf_file" not in source:
        return None
    return Path(model_dir) / source["gguf_file"]


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike,
                 move_file: bool = False) -> Path:
    """Write the model directory for `gguf_path` at `out_dir` (atomically); return `out_dir`.

    The directory holds config.json (with quantization_config {"quant_method": "gguf"}),
    generation_config.json, the tokenizer with its chat template, and tinypaged_source.json,
    which names the .gguf that holds the weights: the file itself, moved into the directory,
    with `move_file`, else its absolute path. No weight is converted: they load from the file.
    If `out_dir` already exists (another process finished first) it is returned untouched.
    """
    GGUFReader = require("gguf").GGUFReader  # MissingPackageError names the install command
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {str(gguf_path)!r} does not exist")
    reader = GGUFReader(str(gguf_path))
    config = hf_config_from_gguf(reader)
    config["torch_dtype"] = str(_storage_dtype(reader)).removeprefix("torch.")
    dense = "num_experts" in config  # MoE layers take no quant method yet: float32 at load
    if not dense:
        config["quantization_config"] = {"quant_method": "gguf"}
    size = gguf_path.stat().st_size

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        generation = _generation_config(reader, config)
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
        permuted = SUPPORTED_ARCHITECTURES[_metadata(reader, "general.architecture")][2]
        source = {"gguf_file": str(gguf_path.resolve()), "size": size,
                  "converter_version": CONVERTER_VERSION,
                  "arch": _metadata(reader, "general.architecture"),
                  "qk_heads": [config["num_attention_heads"], config["num_key_value_heads"]]
                  if permuted else None,
                  "tensors": _tensor_index(reader), "dense": dense}
        _write_tokenizer(gguf_path, reader, tmp)
        if move_file:
            os.replace(gguf_path, tmp / gguf_path.name)
            source["gguf_file"] = gguf_path.name
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2))
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
