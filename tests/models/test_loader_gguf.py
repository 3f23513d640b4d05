"""GGUF files load with their weights still in GGUF blocks, on tiny files written with
gguf.GGUFWriter from random transformers models.

The reference is independent of tinypaged: transformers' own GGUF reader (`load_gguf_checkpoint`)
dequantizes and un-permutes the same file. Three type mixes: "legacy" (Q4_0, Q4_1, Q8_0, F16
quantized from the model's weights, so the originals bound the error and pin the direction of
the Q/K permutation), "q8_0", and "q4_k_m" (Q4_K / Q5_K / Q6_K blocks of random bytes with
finite scales, as a Q4_K_M file mixes them: q and k in Q4_K beside v in Q6_K in one fused QKV).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import quantize
from helpers.gguf import random_blocks
from helpers.models import (
    PagedRunner,
    assert_logits_close,
    checkpoint_weights,
    greedy_reference,
    tiny_hf_model,
)
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from tinypaged.config import EngineConfig
from tinypaged.kernels.gguf_format import gguf_dequantize_reference
from tinypaged.models import gguf_file as tp_gguf
from tinypaged.models import loader
from tinypaged.quantization import gguf as gguf_layers
from tinypaged.sampling.generation_config import load_generation_config

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
TOKENS = SPECIALS + list(bytes_to_unicode().values()) + ["Ġt", "he", "Ġthe"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# per type mix and tensor kind (blk.N.<kind> or a global name): the GGUF type it is stored in
MIXES = {
    "legacy": {"token_embd": Q.Q8_0, "output": Q.Q8_0, "attn_q": Q.Q4_0, "attn_k": Q.Q4_1,
               "attn_v": Q.F16, "attn_output": Q.Q8_0, "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_0,
               "ffn_down": Q.F16, "ffn_gate_exps": Q.Q8_0, "ffn_up_exps": Q.Q4_1,
               "ffn_down_exps": Q.F16},
    "q8_0": {"token_embd": Q.Q8_0, "output": Q.Q8_0, "attn_q": Q.Q8_0, "attn_k": Q.Q8_0,
             "attn_v": Q.Q8_0, "attn_output": Q.Q8_0, "ffn_gate": Q.Q8_0, "ffn_up": Q.Q8_0,
             "ffn_down": Q.Q8_0},
    "q4_k_m": {"token_embd": Q.Q4_K, "output": Q.Q6_K, "attn_q": Q.Q4_K, "attn_k": Q.Q4_K,
               "attn_v": Q.Q6_K, "attn_output": Q.Q4_K, "ffn_gate": Q.Q4_K, "ffn_up": Q.Q5_K,
               "ffn_down": Q.Q6_K, "attn_qkv": Q.Q4_K},
}
RANDOM_TYPES = {Q.Q4_K, Q.Q5_K, Q.Q6_K}  # written as random blocks: gguf cannot quantize them
# fp16 scale bound of the random blocks, so that weights come out at ~0.05 (as in the models)
RANDOM_SCALE = {Q.Q4_K: 4e-4, Q.Q5_K: 2e-4, Q.Q6_K: 6e-5}
# max |dequantized - original| over max |original|, per type (4-bit: 1/15 of a block's range)
TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.Q8_0: 1e-2, Q.Q4_0: 0.2, Q.Q4_1: 0.2}
GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
              "q_norm": "attn_q_norm", "k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
              "post_attention_layernorm": "ffn_norm", "gate": "ffn_gate_inp",
              "qkv_proj": "attn_qkv", "gate_up_proj": "ffn_up"}  # phi3's fused projections
SIZES = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}  # rows of whole 256-blocks


# Gemma's four norms a layer (its post_attention_layernorm is not llama's ffn_norm)
GEMMA_NAMES = {"post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}


# GLM-4-0414's norms after attention and after the MLP (its post_attention_layernorm is ffn_norm)
GLM4_NAMES = {"post_self_attn_layernorm": "post_attention_norm",
              "post_attention_layernorm": "ffn_norm", "post_mlp_layernorm": "post_ffw_norm"}


def _gguf_name(hf_name: str, arch: str = "llama") -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    parts = hf_name.split(".")  # model.layers.N.(self_attn|mlp).X.weight or model.layers.N.X.weight
    if parts[-2] == "shared_expert_gate":  # qwen2moe's shared expert and its gate
        return f"blk.{parts[2]}.ffn_gate_inp_shexp.weight"
    if parts[-3] == "shared_expert":
        return f"blk.{parts[2]}.ffn_{parts[-2].removesuffix('_proj')}_shexp.weight"
    names = {**GGUF_NAMES, **GEMMA_NAMES} if arch.startswith("gemma") else \
        {**GGUF_NAMES, **GLM4_NAMES} if arch == "glm4" else GGUF_NAMES
    return f"blk.{parts[2]}.{names[parts[-2]]}.{parts[-1]}"


def _gguf_tensors(hf_model, arch: str = "llama") -> list[tuple[list[str], str, np.ndarray]]:
    """(HF names, GGUF name, array) of every checkpoint tensor; MoE experts stacked into one
    [E, out, in] tensor per layer and projection, as llama.cpp stores them."""
    weights = checkpoint_weights(hf_model)
    experts: dict[tuple[str, str], list] = {}
    for name in list(weights):
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)_proj\.weight", name)
        if m:
            experts.setdefault((m[1], m[3]), []).append((int(m[2]), name, weights.pop(name)))
    out = [([name], _gguf_name(name, arch), t.float().numpy()) for name, t in weights.items()]
    for (layer, proj), items in experts.items():
        items.sort(key=lambda item: item[0])
        stacked = torch.stack([t for _, _, t in items]).float().numpy()
        out.append(([n for _, n, _ in items], f"blk.{layer}.ffn_{proj}_exps.weight", stacked))
    return out


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter order for Q/K rows: per head, interleave the two rotary halves."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def write_tiny_gguf(path, hf_model, arch: str, mix: str = "legacy",
                    name: str = "tiny test model") -> dict[str, Q]:
    """Write `hf_model` as a GGUF of architecture `arch` in the types of MIXES[mix]; returns
    each HF tensor's GGUF type."""
    c = hf_model.config
    writer = GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(_head_dim(c))
    writer.add_value_length(_head_dim(c))
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)  # gemma3: per layer type
    writer.add_rope_freq_base(rope["rope_theta"])
    if "partial_rotary_factor" in rope:
        writer.add_rope_dimension_count(int(_head_dim(c) * rope["partial_rotary_factor"]))
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    if getattr(c, "num_experts", None):
        writer.add_expert_count(c.num_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    if getattr(c, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(0)
    writer.add_chat_template(TEMPLATE)
    types = {}
    if arch.startswith("gemma"):
        writer.add_sliding_window(c.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    for names, gname, w in _gguf_tensors(hf_model, arch):
        if arch.startswith("gemma") and gname.endswith("norm.weight"):
            w = w + 1  # llama.cpp's converter stores Gemma's norms as 1 + w
        if names == ["lm_head.weight"] and c.tie_word_embeddings:
            continue
        if arch == "llama" and ".attn_q." in gname:
            w = _llama_cpp_permute(w, c.num_attention_heads)
        elif arch == "llama" and ".attn_k." in gname:
            w = _llama_cpp_permute(w, c.num_key_value_heads)
        qtype = MIXES[mix].get(gname.split(".")[-2], Q.F32) if w.ndim >= 2 else Q.F32
        types.update(dict.fromkeys(names, qtype))
        if qtype == Q.F32:
            writer.add_tensor(gname, w)
        elif qtype == Q.F16:
            writer.add_tensor(gname, w.astype(np.float16))
        elif qtype in RANDOM_TYPES:
            seed = len(types)
            blocks = random_blocks(qtype, w.shape[0], w.shape[-1], seed, RANDOM_SCALE[qtype])
            writer.add_tensor(gname, blocks, raw_dtype=qtype)
        else:
            writer.add_tensor(gname, quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


def transformers_reference(gguf_path, head_dim: int) -> torch.nn.Module:
    """transformers' own reading of the GGUF: its config, its dequantized, un-permuted weights.
    (Its config mapping ignores `attention.key_length`, so head_dim is passed in.)"""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    config.head_dim = head_dim
    if (config.pad_token_id or 0) >= config.vocab_size:  # phi3's default 32000: no tiny vocab
        config.pad_token_id = None
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                             dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    model.load_state_dict(tensors["tensors"], strict=False)
    return model.eval()


# (GGUF arch, model kind, type mix)
CASES = [("llama", "llama_untied", "legacy"), ("llama", "llama_untied", "q4_k_m"),
         ("llama", "llama_untied", "q8_0"), ("qwen2", "qwen2", "q4_k_m"),
         ("qwen3", "qwen3", "q4_k_m"), ("qwen3", "qwen3", "q8_0")]


def _write_case(tmp_path, arch: str, kind: str, mix: str):
    hf_model = tiny_hf_model(kind, vocab_size=len(TOKENS), **SIZES)
    path = tmp_path / f"tiny-{arch}-{mix}.gguf"
    types = write_tiny_gguf(path, hf_model, arch, mix)
    return path, hf_model, types


@pytest.fixture(params=CASES, ids=["-".join(c[::2]) for c in CASES])
def tiny_gguf(request, tmp_path):
    arch, kind, mix = request.param
    return (arch, mix, *_write_case(tmp_path, arch, kind, mix))


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYPAGED_CACHE", str(tmp_path / "cache"))


def test_weights_stay_in_their_blocks_and_match_transformers(tiny_gguf, tmp_path):
    arch, mix, path, hf_model, types = tiny_gguf
    out = tp_gguf.convert_gguf(path, tmp_path / "converted")
    assert not list(out.glob("*.safetensors"))  # no float copy of the weights
    assert json.loads((out / "config.json").read_text())["quantization_config"] == {
        "quant_method": "gguf"}
    reference = transformers_reference(path, _head_dim(hf_model.config)).state_dict()
    originals = hf_model.state_dict()
    seen = set()
    for name, w in tp_gguf.gguf_weights(out):
        seen.add(name)
        if isinstance(w, gguf_layers.GGUFWeight):
            assert w.type_id == types[name] and w.data.dtype == np.uint8, name
            w = gguf_dequantize_reference(torch.from_numpy(np.array(w.data)), w.type_id,
                                          w.shape[1])
        assert torch.equal(w, reference[name]), f"{name}: differs from transformers' reading"
        if types[name] in TOLERANCE:
            scale = originals[name].abs().max()
            err = (w - originals[name]).abs().max()
            assert err <= TOLERANCE[types[name]] * scale, f"{name} ({types[name].name}): {err}"
    assert seen == types.keys()
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [tp_gguf.SUPPORTED_ARCHITECTURES[arch][0]]
    assert config["tie_word_embeddings"] == hf_model.config.tie_word_embeddings
    assert config["head_dim"] == _head_dim(hf_model.config)


def test_tokenizer_chat_template_and_stop_tokens(tmp_path):
    path, _, _ = _write_case(tmp_path, "llama", "llama", "legacy")
    out = tp_gguf.convert_gguf(path, tmp_path / "converted")
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "the"}],
                                        add_generation_prompt=True, tokenize=False)
    assert ids == "<|im_start|>user\nthe<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.encode("<|im_end|> the", add_special_tokens=False) == [2, len(TOKENS) - 1]
    assert tokenizer.decode([TOKENS.index("Ġt"), TOKENS.index("he")]) == " the"
    assert load_generation_config(out)["eos_token_id"] == [2, 0]
    assert not list((tmp_path).glob(".converted.tmp-*"))  # the temp dir was renamed, not left


def _quantized_on_cpu(monkeypatch) -> None:
    """Keep the blocks on the CPU too (per-call dequantization), as on the GPU."""
    monkeypatch.setattr(gguf_layers.GGUFConfig, "from_config",
                        classmethod(lambda cls, q: cls(cpu_dequantize=False)))


def _check_greedy(model, reference, prompt: list[int], steps: int) -> None:
    """Prefill and `steps` greedy decode steps: the tokens equal transformers' greedy ones."""
    tokens, ref_logits = greedy_reference(reference, prompt, steps)
    runner = PagedRunner(model, block_size=4, num_blocks=16)
    seq = runner.add_sequence()
    logits = runner.step({seq: prompt})[seq]
    assert_logits_close(logits, ref_logits[: len(prompt)], rtol=1e-3, what="prefill")
    ours = [int(logits[-1].argmax())]
    for step in range(steps - 1):
        logits = runner.step({seq: [ours[-1]]})[seq][0]
        assert_logits_close(logits, ref_logits[len(prompt) + step], rtol=1e-3,
                            what=f"decode step {step}")
        ours.append(int(logits.argmax()))
    assert ours == tokens


PROMPT = [1, 5, 77, 200, 31, 9, 140, 3, 60, 61, 62]


def _check_prefill(model, converted, weights: dict, tmp_path, what: str) -> None:
    """Prefill logits of PROMPT against transformers on `weights` (a dense state dict, saved as
    a checkpoint beside the converted config.json: from_pretrained maps the per-expert names
    onto its fused experts)."""
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text((converted / "config.json").read_text())
    save_file(weights, str(hf_dir / "model.safetensors"))
    reference = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                     attn_implementation="eager")
    runner = PagedRunner(model, block_size=4, num_blocks=8)
    logits = runner.step({runner.add_sequence(): PROMPT})[0]
    with torch.no_grad():
        assert_logits_close(logits, reference.eval()(torch.tensor([PROMPT])).logits[0],
                            what=what)


def test_loads_quantized_and_decodes_like_transformers(tiny_gguf, monkeypatch):
    _, mix, path, hf_model, types = tiny_gguf
    _quantized_on_cpu(monkeypatch)
    model, _, model_dir = loader.load_model(EngineConfig(model=str(path)), "cpu")
    qkv = model.model.layers[0].self_attn.qkv_proj.gguf_parts
    # legacy: q (Q4_0), k (Q4_1) and v (F16, a dense part) stay three parts; else one
    assert [t for t, _ in qkv] == ([2, 3, gguf_layers.DENSE] if mix == "legacy"
                                   else [types["model.layers.0.self_attn.q_proj.weight"]]
                                   if mix == "q8_0" else [12, 14])
    embed_type, table = model.model.embed_tokens.gguf_parts[0]
    assert embed_type == types["model.embed_tokens.weight"] and table.dtype == torch.uint8
    reference = transformers_reference(path, _head_dim(hf_model.config))
    _check_greedy(model, reference, PROMPT, steps=4)

    def no_second_conversion(*args, **kwargs):
        raise AssertionError("converted again although the cache holds the file")

    monkeypatch.setattr(tp_gguf, "convert_gguf", no_second_conversion)
    assert loader.resolve_model(str(path)) == model_dir


def test_cpu_dequantizes_once_by_default(tmp_path):
    path, hf_model, _ = _write_case(tmp_path, "qwen3", "qwen3", "q4_k_m")
    model, _, _ = loader.load_model(EngineConfig(model=str(path)), "cpu")
    parts = model.model.layers[1].mlp.gate_up_proj.gguf_parts
    # gate (Q4_K) and up (Q5_K) both become fp32 at load, so they merge into one dense part
    assert [(t, w.dtype, tuple(w.shape)) for t, w in parts] == [
        (gguf_layers.DENSE, torch.float32, (2 * SIZES["intermediate_size"], SIZES["hidden_size"]))]
    reference = transformers_reference(path, _head_dim(hf_model.config))
    _check_greedy(model, reference, PROMPT, steps=3)


def test_triton_kernels_run_the_model(tmp_path, monkeypatch):
    """The GPU path under the interpreter: the prefill dequantizes (13 rows > GEMV_MAX_M),
    the decode steps run the GEMV, on Q4_K / Q5_K / Q6_K weights."""
    path, hf_model, _ = _write_case(tmp_path, "llama", "llama", "q4_k_m")
    _quantized_on_cpu(monkeypatch)
    model, _, _ = loader.load_model(EngineConfig(model=str(path)), "cpu")
    reference = transformers_reference(path, _head_dim(hf_model.config))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _check_greedy(model, reference, PROMPT + [7, 8], steps=2)


def test_qwen3moe_experts_are_unstacked_and_run(tmp_path):
    """llama.cpp's stacked expert tensors become HF's per-expert ones, dequantized at load (the
    MoE layers take float weights only); transformers on the same weights is the reference."""
    hf_model = tiny_hf_model("qwen3_moe", vocab_size=len(TOKENS))
    path = tmp_path / "tiny-qwen3moe.gguf"
    types = write_tiny_gguf(path, hf_model, "qwen3moe")
    out = tp_gguf.convert_gguf(path, tmp_path / "converted")
    ours, originals = tp_gguf.dense_state_dict(out), checkpoint_weights(hf_model)
    assert ours.keys() == originals.keys() == types.keys()
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in ours
    assert types["model.layers.0.mlp.experts.3.up_proj.weight"] == Q.Q4_1  # quantized, 3-D
    for name, w in ours.items():
        err = (w - originals[name]).abs().max()
        assert err <= TOLERANCE[types[name]] * originals[name].abs().max(), name
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["num_experts"], config["num_experts_per_tok"],
            config["moe_intermediate_size"], config["norm_topk_prob"]) == (8, 2, 32, True)

    model, _, _ = loader.load_model(EngineConfig(model=str(path)), "cpu")
    _check_prefill(model, out, ours, tmp_path, "prefill logits of the converted Qwen3-MoE GGUF")


def test_a_changed_file_is_converted_again(tmp_path):
    hf_model = tiny_hf_model("llama", vocab_size=len(TOKENS))
    path = tmp_path / "model.gguf"
    write_tiny_gguf(path, hf_model, "llama")
    first = loader.resolve_model(str(path))
    write_tiny_gguf(path, tiny_hf_model("llama", seed=1, vocab_size=len(TOKENS)), "llama")
    second = loader.resolve_model(str(path))
    assert first != second and first.is_dir() and second.is_dir()


def test_unsupported_architecture_leaves_nothing_behind(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'gpt2' is not supported.*llama"):
        tp_gguf.convert_gguf(path, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2.gguf"]


def test_unknown_tensor_fails_and_cleans_up(tmp_path):
    hf_model = tiny_hf_model("llama", vocab_size=len(TOKENS))
    path = tmp_path / "model.gguf"
    write_tiny_gguf(path, hf_model, "llama")
    original = tp_gguf.hf_tensor_name

    def rename(name, arch="llama"):
        if name == "blk.1.ffn_up.weight":
            raise ValueError(f"GGUF tensor {name!r} has no Hugging Face counterpart we know of")
        return original(name, arch)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tp_gguf, "hf_tensor_name", rename)
        with pytest.raises(ValueError, match="blk.1.ffn_up.weight"):
            tp_gguf.convert_gguf(path, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]
    with pytest.raises(ValueError, match="rope_freqs"):
        tp_gguf.hf_tensor_name("rope_freqs.weight")


def test_phi3_fused_projections_load_whole(tmp_path, monkeypatch):
    """phi3 files hold fused attn_qkv ([q; k; v]) and ffn_up ([gate; up]) matrices: each
    becomes one part of our fused layer, and greedy decoding matches transformers."""
    hf_model = tiny_hf_model("phi3", vocab_size=len(TOKENS), partial_rotary_factor=1.0,
                             **SIZES)
    path = tmp_path / "tiny-phi3.gguf"
    write_tiny_gguf(path, hf_model, "phi3", "q4_k_m")
    _quantized_on_cpu(monkeypatch)
    model, _, model_dir = loader.load_model(EngineConfig(model=str(path)), "cpu")
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == [
        "Phi3ForCausalLM"]
    layer = model.model.layers[0]
    assert [t for t, _ in layer.self_attn.qkv_proj.gguf_parts] == [12]  # attn_qkv: Q4_K
    assert [t for t, _ in layer.mlp.gate_up_proj.gguf_parts] == [13]  # ffn_up: Q5_K
    reference = transformers_reference(path, _head_dim(hf_model.config))
    _check_greedy(model, reference, PROMPT, steps=4)


def test_gemma2_norms_windows_and_softcaps(tmp_path, monkeypatch):
    """gemma2 files: four norms a layer stored as 1 + w, local layers (window 8, shorter than
    the prompt) alternating with global ones, soft-capped logits; greedy decoding matches
    transformers reading the same file (head_dim 256: transformers takes the default
    query_pre_attn_scalar, 256, and llama.cpp's scale is head_dim^-1/2)."""
    hf_model = tiny_hf_model("gemma2", vocab_size=len(TOKENS), hidden_size=256,
                             intermediate_size=512, head_dim=256, query_pre_attn_scalar=256,
                             attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    path = tmp_path / "tiny-gemma2.gguf"
    write_tiny_gguf(path, hf_model, "gemma2", "q4_k_m")
    _quantized_on_cpu(monkeypatch)
    model, _, model_dir = loader.load_model(EngineConfig(model=str(path)), "cpu")
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["sliding_window"], config["query_pre_attn_scalar"]) == (8, 256)
    reference = transformers_reference(path, 256)
    _check_greedy(model, reference, PROMPT, steps=4)


def test_gemma3_qk_norms_and_local_layers(tmp_path, monkeypatch):
    """gemma3 files: q/k norms (also stored as 1 + w), local layers with rotary base 10000
    beside the file's global base; greedy decoding matches transformers reading the file."""
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6}}
    hf_model = tiny_hf_model("gemma3", vocab_size=len(TOKENS), hidden_size=256,
                             intermediate_size=512, head_dim=256, query_pre_attn_scalar=256,
                             rope_parameters=rope,
                             layer_types=["sliding_attention", "sliding_attention"])
    path = tmp_path / "tiny-gemma3.gguf"
    write_tiny_gguf(path, hf_model, "gemma3", "q4_k_m")
    _quantized_on_cpu(monkeypatch)
    model, _, model_dir = loader.load_model(EngineConfig(model=str(path)), "cpu")
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["layer_types"] == ["sliding_attention", "sliding_attention"]
    reference = transformers_reference(path, 256)
    _check_greedy(model, reference, PROMPT, steps=4)


def test_qwen2moe_shared_expert(tmp_path):
    """qwen2moe files: stacked experts plus a shared expert and its gate (ffn_*_shexp), every
    layer sparse, top-k weights not renormalized; prefill logits match transformers on the
    same (dequantized) weights."""
    hf_model = tiny_hf_model("qwen2_moe", vocab_size=len(TOKENS), mlp_only_layers=[])
    path = tmp_path / "tiny-qwen2moe.gguf"
    types = write_tiny_gguf(path, hf_model, "qwen2moe")
    out = tp_gguf.convert_gguf(path, tmp_path / "converted")
    ours, originals = tp_gguf.dense_state_dict(out), checkpoint_weights(hf_model)
    assert ours.keys() == originals.keys() == types.keys()
    assert ours["model.layers.1.mlp.shared_expert_gate.weight"].shape == (1, 64)
    config = json.loads((out / "config.json").read_text())
    assert (config["shared_expert_intermediate_size"], config["norm_topk_prob"]) == (48, False)
    model, _, _ = loader.load_model(EngineConfig(model=str(path)), "cpu")
    _check_prefill(model, out, ours, tmp_path, "prefill logits of the converted Qwen2-MoE GGUF")


def test_glm4_sandwich_norms_and_fused_gate_up(tmp_path, monkeypatch):
    """glm4 files (GLM-4-0414): q/k/v biases, [gate; up] fused in ffn_up, norms after attention
    and after the MLP, half the head rotating with adjacent dims paired (no Q/K permutation);
    transformers reads no glm4 GGUF, so its Glm4ForCausalLM runs on the same weights
    dequantized, and greedy decoding of the blocks (kept quantized) matches it."""
    hf_model = tiny_hf_model("glm4", vocab_size=len(TOKENS), **SIZES)
    path = tmp_path / "tiny-glm4.gguf"
    types = write_tiny_gguf(path, hf_model, "glm4", "q4_k_m")
    assert types["model.layers.0.mlp.gate_up_proj.weight"] == Q.Q5_K
    out = tp_gguf.convert_gguf(path, tmp_path / "converted")
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["partial_rotary_factor"],
            config["attention_bias"]) == (["Glm4ForCausalLM"], 0.5, True)
    ours = tp_gguf.dense_state_dict(out)
    assert ours.keys() == checkpoint_weights(hf_model).keys() == types.keys()
    tokenizer = AutoTokenizer.from_pretrained(str(out))  # built from the file's vocabulary
    assert tokenizer.encode("<|im_end|> the", add_special_tokens=False) == [2, len(TOKENS) - 1]
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "the"}], add_generation_prompt=True, tokenize=False)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    hf_config = {k: v for k, v in config.items() if k != "quantization_config"}
    (hf_dir / "config.json").write_text(json.dumps({**hf_config, "pad_token_id": 0}))
    save_file(ours, str(hf_dir / "model.safetensors"))
    reference = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    _quantized_on_cpu(monkeypatch)
    model, _, _ = loader.load_model(EngineConfig(model=str(path)), "cpu")
    assert [t for t, _ in model.model.layers[0].mlp.gate_up_proj.gguf_parts] == [13]
    _check_greedy(model, reference, PROMPT, steps=4)


def test_mistral_files_load_as_llama(tmp_path, monkeypatch):
    """llama.cpp writes Mistral models (no sliding window: v0.3 and later) under the llama
    architecture, Q/K rows permuted; we load them as the llama they are. The weights come back
    within Q8_0's rounding of the Mistral model's (un-permuted), and its MistralForCausalLM on
    them decodes greedily as we do (transformers' own reader fails on such a file:
    "Unknown gguf model_type: mistral")."""
    hf_model = tiny_hf_model("mistral", vocab_size=len(TOKENS), sliding_window=None, **SIZES)
    path = tmp_path / "tiny-mistral.gguf"
    write_tiny_gguf(path, hf_model, "llama", "q8_0")
    _quantized_on_cpu(monkeypatch)
    model, _, model_dir = loader.load_model(EngineConfig(model=str(path)), "cpu")
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["architectures"], config["sliding_window"]) == (["LlamaForCausalLM"], None)
    ours, originals = tp_gguf.dense_state_dict(model_dir), checkpoint_weights(hf_model)
    for name, w in ours.items():
        assert (w - originals[name]).abs().max() <= 1e-2 * originals[name].abs().max(), name
    hf_model.load_state_dict(ours)
    _check_greedy(model, hf_model, PROMPT, steps=4)


def test_bench_counts_the_packed_bytes(tmp_path):
    """`bench latency` GB/s of a GGUF model counts the bytes its blocks take (the file's
    tensor data), not 2 bytes a weight."""
    from gguf import GGUFReader

    from tinypaged.bench.offline import weight_bytes

    path, _, _ = _write_case(tmp_path, "llama", "llama_untied", "q4_k_m")
    out = tp_gguf.convert_gguf(path, tmp_path / "converted")
    cfg = json.loads((out / "config.json").read_text())
    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)
    assert weight_bytes(cfg, 1, None, str(out)) == file_bytes
    assert file_bytes < 0.5 * weight_bytes(cfg, 1)  # Q4_K / Q5_K / Q6_K: under a byte a weight
    assert weight_bytes(cfg, 1, None, str(tmp_path)) == weight_bytes(cfg, 1)  # not a GGUF dir
