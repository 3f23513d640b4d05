"""Draft heads fed the target's hidden states: EAGLE-3, EAGLE (EAGLE-1) and MTP.

Each head is a one-layer (or few-layer) decoder that reads, beside the embedding of a token,
a hidden state of the target; head_proposer.py runs it k steps per target step on its own
paged KV cache. At position i the head's input is (f_i, token_{i+1}), where f_i is the target's
feature at i (the state that predicted token_{i+1}); its output predicts token_{i+2}. After the
first step the head feeds its own output hidden state back as f (the target has not seen the
drafts yet).

    EAGLE-3 (`method: "eagle3"`; vLLM's Eagle3LlamaForCausalLM)
        f  = fc(concat(h_low, h_mid, h_high))          the target's residual stream entering
                                                       its layers `eagle_aux_hidden_state_layer_ids`
                                                       (default (2, L // 2, L - 3))
        x  = concat(input_layernorm(embed(t)), hidden_norm(f))            [T, 2 * hidden]
        r  = f  (norm_before_residual: hidden_norm(f))
        layer 0: attention with q/k/v projected from x (2 * hidden inputs), then the usual
                 add + norm + MLP; further layers are plain decoder layers
        out, prenorm = norm(mlp_out, r)                 logits = lm_head(out) over the draft
                                                        vocabulary; target id = id + d2t[id]
        f' = prenorm                                    (the next step's f)
    EAGLE (`method: "eagle"`; vLLM's EagleLlamaForCausalLM)
        f  = the target's final normed hidden state
        x  = fc(concat(embed(t), f)) (+ bias)           layer 0 has no input norm
        f' = mlp_out + residual of the last layer       logits = the target's lm_head(f')
    MTP (`method: "mtp"`: GLM-4.5's layer num_hidden_layers, vLLM's Glm4MoeMTP)
        f  = the target's final normed hidden state
        x  = eh_proj(concat(enorm(embed(t)), hnorm(f)))  (embed(t) = 0 at position 0)
        f' = mlp_out + residual of the decoder layer
        logits = shared_head.head(shared_head.norm(f'))

Checkpoints load as vLLM loads them: an EAGLE-3 head in the HF layout (config.json of a Llama
layer with `draft_vocab_size`, tensors `midlayer.*` or `layers.0.*`, `fc`, `norm`, `lm_head`,
`d2t`; `t2d` unused) or the `speculators` layout (`speculators_model_type: "eagle3"`,
`transformer_layer_config`, `norm_before_residual` defaulting to true); an EAGLE head in the HF
layout (`fc.weight` (+ `fc.bias`), `layers.N.*`); the MTP layer from the target's own checkpoint
(`model.layers.{L}.{enorm,hnorm,eh_proj,shared_head.*}` and its decoder layer). A head without
`embed_tokens` (or `lm_head`) uses the target's. Names and shapes are checked strictly
(DecoderForCausalLM.load_weights).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from tinypaged.models.attention_metadata import AttentionMetadata
from tinypaged.models.decoder import (
    DecoderForCausalLM,
    DecoderLayer,
    DecoderSpec,
    spec_from_hf_config,
)
from tinypaged.models.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    VocabParallelEmbedding,
)
from tinypaged.spec_decode.head_config import HeadConfig


def _rotary_embedding(spec: DecoderSpec) -> RotaryEmbedding:
    rope = spec.rope
    return RotaryEmbedding(rope.cos_sin_cache(), rope.rotary_dim, rope.interleaved)


def _layer_spec(layer: dict) -> DecoderSpec:
    from transformers import LlamaConfig

    fields = {k: v for k, v in layer.items() if k not in ("architectures", "model_type")}
    return spec_from_hf_config(LlamaConfig(**fields),
                               qkv_bias=bool(layer.get("attention_bias", False)),
                               o_bias=bool(layer.get("attention_bias", False)),
                               mlp_bias=bool(layer.get("mlp_bias", False)))


class DraftHead(DecoderForCausalLM):
    """Base of the heads. `forward(input_ids, positions, md, features)` -> (logits of the rows
    `rows` [S, vocab], the next step's features of those rows [S, hidden]); `combine(aux)`
    turns the target's kept hidden states into the first step's features. Loads through
    DecoderForCausalLM.load_weights (strict names and shapes) after `map_name`."""

    shares: tuple[str, ...] = ()  # modules taken from the target when the checkpoint lacks them

    def __init__(self, spec: DecoderSpec) -> None:
        nn.Module.__init__(self)
        self.spec = spec
        self.num_kv_heads, self.head_dim = spec.num_kv_heads, spec.head_dim

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        return aux

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    def target_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """logits [N, draft_vocab] laid out over the target's ids [N, >= vocab_size] (what a
        grammar's mask covers); ids outside the draft vocabulary are -inf."""
        return logits

    def share_from(self, target: DecoderForCausalLM) -> None:
        """Take the target's embedding / LM head where this head has none of its own."""
        for name in self.shares:
            if getattr(self, name, None) is None:
                setattr(self, name, target.model.embed_tokens if name == "embed_tokens"
                        else target.lm_head)

    def _layers(self, hidden, residual, positions, md):
        for layer in self.layers[1:]:
            hidden, residual = layer(positions, hidden, residual, md)
        return hidden, residual


def _first_layer(spec: DecoderSpec, rotary, qkv_input: int, layer_idx: int = 0) -> DecoderLayer:
    layer = DecoderLayer(spec, rotary, None, layer_idx)
    attn = layer.self_attn
    attn.qkv_proj = QKVParallelLinear(qkv_input, spec.head_dim, spec.num_heads, spec.num_kv_heads,
                                      spec.qkv_bias)
    return layer


class Eagle3Head(DraftHead):
    shares = ("embed_tokens", "lm_head")

    def __init__(self, config: HeadConfig, target_spec: DecoderSpec) -> None:
        spec = _layer_spec(config.layer)
        super().__init__(spec)
        h, names = spec.hidden_size, config.names
        rotary = _rotary_embedding(spec)
        self.embed_tokens = (VocabParallelEmbedding(spec.vocab_size, h)
                             if "embed_tokens.weight" in names else None)
        target_h = config.target_hidden_size or target_spec.hidden_size
        self.fc = ColumnParallelLinear(3 * target_h, h, bias=False)
        self.layers = nn.ModuleList([_first_layer(spec, rotary, 2 * h)] + [
            DecoderLayer(spec, rotary, None, i) for i in range(1, spec.num_layers)])
        self.layers[0].hidden_norm = RMSNorm(h, spec.rms_norm_eps)
        self.norm = RMSNorm(h, spec.rms_norm_eps)
        self.draft_vocab = config.draft_vocab_size or spec.vocab_size
        self.lm_head = ParallelLMHead(self.draft_vocab, h) if "lm_head.weight" in names else None
        self.norm_before_residual = config.norm_before_residual
        if "d2t" in names:
            self.d2t = nn.Parameter(torch.zeros(self.draft_vocab, dtype=torch.int64),
                                    requires_grad=False)
        else:
            self.d2t = None
            if self.draft_vocab != target_spec.vocab_size:
                raise ValueError(f"{config.path}: draft_vocab_size {self.draft_vocab} differs "
                                 "from the target's vocabulary but the checkpoint has no d2t")

    def map_name(self, name: str) -> str | None:
        if name == "t2d" or name.endswith("rotary_emb.inv_freq"):
            return None  # t2d: the target -> draft mask, unused when drafting
        return name.replace("midlayer.", "layers.0.", 1)

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        return self.fc(aux)  # [T, 3 * target_hidden] -> [T, hidden]

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.d2t is None else ids + self.d2t[ids]

    def target_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        if self.d2t is None:
            return logits
        width = max(vocab_size, self.embed_tokens.num_embeddings)  # the target's vocabulary
        full = logits.new_full((logits.shape[0], width), float("-inf"))
        ids = self.to_target_ids(torch.arange(self.draft_vocab, device=logits.device))
        return full.index_copy_(1, ids, logits)

    def forward(self, input_ids, positions, md: AttentionMetadata, features, rows):
        first = self.layers[0]
        embeds = first.input_layernorm(self.embed_tokens(input_ids))
        normed = first.hidden_norm(features)
        residual = normed if self.norm_before_residual else features
        x = torch.cat([embeds, normed], dim=-1)  # [T, 2 * hidden]
        q = first.self_attn.project_qkv(positions, x, md.slot_mapping)
        hidden, residual = first.post_attention(first.self_attn.attn.attend(q, md), residual)
        hidden, residual = self._layers(hidden, residual, positions, md)
        out, prenorm = self.norm(hidden[rows], residual[rows])
        return self.lm_head(out), prenorm


class EagleHead(DraftHead):
    shares = ("embed_tokens", "lm_head")

    def __init__(self, config: HeadConfig, target_spec: DecoderSpec) -> None:
        spec = _layer_spec(config.layer)
        super().__init__(spec)
        h, rotary = spec.hidden_size, _rotary_embedding(spec)
        self.embed_tokens = None  # vLLM: EAGLE always shares the target's embedding
        self.lm_head = None  # ... and its LM head
        self.fc = ColumnParallelLinear(2 * h, h, bias="fc.bias" in config.names)
        self.layers = nn.ModuleList(DecoderLayer(spec, rotary, None, i)
                                    for i in range(spec.num_layers))
        del self.layers[0].input_layernorm  # EAGLE's first layer takes fc's output as it is

    def map_name(self, name: str) -> str | None:
        skip = name.startswith(("embed_tokens.", "lm_head.")) or name.endswith("inv_freq")
        return None if skip else name

    def forward(self, input_ids, positions, md: AttentionMetadata, features, rows):
        x = self.fc(torch.cat([self.embed_tokens(input_ids), features], dim=-1))
        first = self.layers[0]
        q = first.self_attn.project_qkv(positions, x, md.slot_mapping)
        hidden, residual = first.post_attention(first.self_attn.attn.attend(q, md), x)
        hidden, residual = self._layers(hidden, residual, positions, md)
        out = (hidden + residual)[rows]
        return self.lm_head(out), out


class MtpHead(DraftHead):
    """GLM-4.5's MTP layer: its decoder layer is a layer of the target's own architecture (MoE),
    index num_hidden_layers; checkpoint names `model.layers.{L}.*`."""

    shares = ("embed_tokens", "lm_head")

    def __init__(self, config: HeadConfig, target_spec: DecoderSpec) -> None:
        index = target_spec.num_layers
        spec = target_spec
        if spec.moe is not None:  # the MTP layer is sparse like the layers before it
            spec = dataclasses.replace(spec, moe=dataclasses.replace(
                spec.moe, sparse_layers=(*spec.moe.sparse_layers, index)))
        super().__init__(spec)
        self.prefix = f"model.layers.{index}."
        h, eps, names = spec.hidden_size, spec.rms_norm_eps, config.names
        self.enorm, self.hnorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.eh_proj = ColumnParallelLinear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(spec, _rotary_embedding(spec), None,
                                                  index)])
        self.shared_norm = RMSNorm(h, eps)
        self.embed_tokens = (VocabParallelEmbedding(spec.vocab_size, h)
                             if self.prefix + "embed_tokens.weight" in names else None)
        self.lm_head = (ParallelLMHead(spec.vocab_size, h)
                        if self.prefix + "shared_head.head.weight" in names else None)

    def map_name(self, name: str) -> str | None:
        if not name.startswith(self.prefix):
            return None  # the target's own tensors
        name = name[len(self.prefix):].replace("mlp.shared_experts.", "mlp.shared_expert.", 1)
        renamed = {"shared_head.norm.weight": "shared_norm.weight",
                   "shared_head.head.weight": "lm_head.weight"}
        if name in renamed or name.startswith(("enorm.", "hnorm.", "eh_proj.", "embed_tokens.")):
            return renamed.get(name, name)
        return "layers.0." + name

    def checkpoint_name(self, name: str) -> str:
        name = name.replace("mlp.shared_expert.", "mlp.shared_experts.", 1)
        return self.prefix + name.replace("layers.0.", "", 1)

    def forward(self, input_ids, positions, md: AttentionMetadata, features, rows):
        embeds = self.embed_tokens(input_ids).masked_fill((positions == 0)[:, None], 0.0)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(features)], dim=-1))
        hidden, residual = self.layers[0](positions, x, None, md)
        out = (hidden + residual)[rows]
        return self.lm_head(self.shared_norm(out)), out


HEADS = {"eagle3": Eagle3Head, "eagle": EagleHead, "mtp": MtpHead}


def _head_weights(config: HeadConfig):
    from safetensors import safe_open

    from tinypaged.models.loader import safetensors_files

    for file in safetensors_files(config.path):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118
                if name in config.names:  # MTP: only the MTP layer's tensors are read
                    yield name, handle.get_tensor(name)


def load_head(config: HeadConfig, target: Any, device: torch.device,
              dtype: torch.dtype) -> DraftHead:
    """Build the head in the target's dtype on `device`, load it, share the target's modules."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            head = HEADS[config.method](config, target.spec)
    finally:
        torch.set_default_dtype(previous)
    head.requires_grad_(False)
    with torch.no_grad():
        head.load_weights(_head_weights(config))
    head.share_from(target)
    vocab = head.embed_tokens.num_embeddings
    if vocab != target.spec.vocab_size:
        raise ValueError(f"{config.path}: the head's vocabulary ({vocab}) is not the target's "
                         f"({target.spec.vocab_size}); a head shares the target's tokenizer")
    return head.eval()

