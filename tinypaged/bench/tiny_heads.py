"""Tiny draft-head checkpoints in the on-disk formats vLLM loads, so that tinypaged's loader is
what the tests (tests/spec_decode/test_spec_heads.py) and the GPU check
(benchmarks/spec_decode_check.py --heads-only) exercise:

- `save_eagle3(path, target, ...)`: an EAGLE-3 head, either the HF layout of the original
  EAGLE-3 releases (a Llama config.json with `draft_vocab_size`, tensors `midlayer.*`, `fc`,
  `norm`, `lm_head`, `d2t`, `t2d`) or the `speculators` layout (`speculators_model_type`,
  `transformer_layer_config`, tensors `layers.0.*`);
- `save_eagle(path, target, ...)`: an EAGLE (EAGLE-1) head (`fc.weight` + `fc.bias`,
  `layers.0.*` without an input norm); `copy=True` makes it the target's own next-token
  prediction for a target made a bigram model by `make_bigram` (every draft accepted);
- `save_glm_mtp(path, ...)`: a tiny GLM-4.5 (Glm4MoeForCausalLM) checkpoint with one MTP layer
  (`model.layers.{L}.{enorm,hnorm,eh_proj,shared_head.norm,shared_head.head}` and its MoE
  decoder layer), `num_nextn_predict_layers: 1`; `copy=True` as for EAGLE.

`make_bigram(hf_model)`: zero every attention output and MLP down projection and set the final
norm to ones, so that the next token depends on the current token alone (argmax is unchanged by
RMSNorm's positive scale), which a one-layer head can compute exactly.
"""

from __future__ import annotations

import json
import tempfile

import torch
from safetensors.torch import save_file

from tinypaged.bench.tiny_models import TINY, tiny_hf_model


def _rand(gen, *shape, scale=0.1):
    return torch.randn(*shape, generator=gen) * scale


def _layer(gen, prefix: str, h: int, qkv_in: int, heads: int, kv_heads: int, hd: int,
           inter: int, input_norm: bool = True, hidden_norm: bool = False) -> dict:
    w = {
        f"{prefix}self_attn.q_proj.weight": _rand(gen, heads * hd, qkv_in),
        f"{prefix}self_attn.k_proj.weight": _rand(gen, kv_heads * hd, qkv_in),
        f"{prefix}self_attn.v_proj.weight": _rand(gen, kv_heads * hd, qkv_in),
        f"{prefix}self_attn.o_proj.weight": _rand(gen, h, heads * hd),
        f"{prefix}mlp.gate_proj.weight": _rand(gen, inter, h),
        f"{prefix}mlp.up_proj.weight": _rand(gen, inter, h),
        f"{prefix}mlp.down_proj.weight": _rand(gen, h, inter),
        f"{prefix}post_attention_layernorm.weight": torch.rand(h, generator=gen) + 0.5,
    }
    if input_norm:
        w[f"{prefix}input_layernorm.weight"] = torch.rand(h, generator=gen) + 0.5
    if hidden_norm:
        w[f"{prefix}hidden_norm.weight"] = torch.rand(h, generator=gen) + 0.5
    return w


def _llama_layer_config(**extra) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **TINY,
            "num_hidden_layers": 1, "head_dim": 16, "rope_theta": 10000.0,
            "tie_word_embeddings": False, **extra}


def save_eagle3(path, target_config, *, fmt: str = "hf", seed: int = 0,
                aux_layers=(1, 2, 3), draft_vocab: int | None = None,
                embed: bool = False) -> None:
    gen = torch.Generator().manual_seed(seed)
    h, vocab = TINY["hidden_size"], TINY["vocab_size"]
    dv = draft_vocab or vocab
    heads, kv, hd = TINY["num_attention_heads"], TINY["num_key_value_heads"], 16
    layer_prefix = "midlayer." if fmt == "hf" else "layers.0."
    w = _layer(gen, layer_prefix, h, 2 * h, heads, kv, hd, TINY["intermediate_size"],
               hidden_norm=True)
    w["fc.weight"] = _rand(gen, h, 3 * target_config.hidden_size)
    w["norm.weight"] = torch.rand(h, generator=gen) + 0.5
    w["lm_head.weight"] = _rand(gen, dv, h)
    ids = torch.sort(torch.randperm(vocab, generator=gen)[:dv]).values  # draft id -> target id
    w["d2t"] = ids - torch.arange(dv)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    w["t2d"] = t2d
    if embed:
        w["embed_tokens.weight"] = _rand(gen, vocab, h)
    layer = _llama_layer_config(draft_vocab_size=dv)
    if fmt == "hf":
        config = {**layer, "architectures": ["LlamaForCausalLMEagle3"],
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layers)}}
    else:
        config = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                  "transformer_layer_config": layer, "draft_vocab_size": dv,
                  "norm_before_residual": True, "eagle_aux_hidden_state_layer_ids":
                  list(aux_layers),
                  "speculators_config": {"algorithm": "eagle3", "proposal_methods": [
                      {"proposal_type": "greedy", "speculative_tokens": 3}],
                      "verifier": {"name_or_path": "tiny-llama", "architectures":
                                   ["LlamaForCausalLM"]}}}
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"))


def make_bigram(model, leak: float = 0.0) -> None:
    """The next token of `model` (a transformers decoder) depends on the current token only;
    `leak` > 0 keeps that fraction of the attention and MLP outputs, so the context sometimes
    changes the token (a copying head's drafts are then partly rejected)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "o_proj.bias")):
                p.mul_(leak)
            if ".mlp.gate.weight" in name or ".experts." in name:
                p.mul_(leak)
        model.model.norm.weight.fill_(1.0)


def save_eagle(path, *, seed: int = 0, copy: bool = False) -> None:
    """An EAGLE head for a target of TINY's sizes; `copy`: x = embed(token) through a layer whose
    attention and MLP add nothing, so its logits (the target's LM head, no norm) are the bigram
    target's."""
    gen = torch.Generator().manual_seed(seed)
    h = TINY["hidden_size"]
    w = _layer(gen, "layers.0.", h, h, TINY["num_attention_heads"], TINY["num_key_value_heads"],
               16, TINY["intermediate_size"], input_norm=False)
    w["fc.weight"] = _rand(gen, h, 2 * h)
    w["fc.bias"] = _rand(gen, h)
    if copy:
        w["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
        w["fc.bias"].zero_()
        w["layers.0.self_attn.o_proj.weight"].zero_()
        w["layers.0.mlp.down_proj.weight"].zero_()
    (path / "config.json").write_text(json.dumps(_llama_layer_config()))
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"))


def save_glm_mtp(path, *, seed: int = 3, copy: bool = False, bigram: bool = False):
    """A tiny GLM-4.5 with an MTP layer; returns the transformers model (without the layer)."""
    hf = tiny_hf_model("glm4_moe", seed=seed)
    if bigram:
        make_bigram(hf)
    hf.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    c = hf.config
    big = tiny_hf_model("glm4_moe", seed=seed + 1, num_hidden_layers=c.num_hidden_layers + 1)
    L, h = c.num_hidden_layers, c.hidden_size
    src = f"model.layers.{L}."
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:  # the checkpoint layout: one tensor per expert
        big.save_pretrained(tmp)
        w = {k: v for k, v in load_file(f"{tmp}/model.safetensors").items() if k.startswith(src)}
    gen = torch.Generator().manual_seed(seed)
    w[src + "enorm.weight"] = torch.rand(h, generator=gen) + 0.5
    w[src + "hnorm.weight"] = torch.rand(h, generator=gen) + 0.5
    w[src + "eh_proj.weight"] = _rand(gen, h, 2 * h)
    w[src + "shared_head.norm.weight"] = torch.rand(h, generator=gen) + 0.5
    w[src + "shared_head.head.weight"] = _rand(gen, c.vocab_size, h)
    if copy:  # the MTP layer computes the bigram target's next token
        w[src + "enorm.weight"].fill_(1.0)
        w[src + "eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
        for k in list(w):
            if k.endswith(("o_proj.weight", "down_proj.weight")) or ".experts." in k:
                w[k].zero_()
        w[src + "shared_head.norm.weight"] = hf.model.norm.weight.detach().clone()
        w[src + "shared_head.head.weight"] = hf.lm_head.weight.detach().clone()
    weights = load_file(str(path / "model.safetensors"))  # one file, as save_pretrained wrote
    weights.update(w)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    return hf
