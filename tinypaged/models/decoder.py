"""The decoder-only transformer every supported architecture is an instance of.

    h = embed(input_ids) (Gemma: * sqrt(hidden))           # [T, hidden]
    per layer:  a = attention(rms_norm(h)); (Glm4, Gemma: a = rms_norm(a))
                h = h + a
                m = down(act(gate(x)) * up(x)), x = rms_norm(h); (Glm4, Gemma: m = rms_norm(m))
                (MoE layers: m = the sparse mixture-of-experts block of models/moe.py)
                h = h + m
    out = rms_norm(h)                                      # logits = out[rows] @ lm_head^T
                                          (Gemma 2: logits = cap * tanh(logits / cap))

act is SiLU (SwiGLU) or GELU-tanh (Gemma's GeGLU); Gemma's RMSNorms scale by (1 + w), stored
here as weights w + 1 at load time.

attention(x): q, k, v = x Wqkv (+ bias) split by heads; (Qwen3, Gemma 3: rms_norm per head on q
and k); rotary on the first rotary_dim dims of q and k (halves or adjacent pairs); paged
attention over the KV cache, full or over a sliding window per layer (Mistral, Gemma's local
layers, which in Gemma 3 have their own rotary base), with optional logit soft-capping;
output projection.

Architectures differ only in the data of a `DecoderSpec` (sizes, biases, q/k norm, extra norms,
rotary style, windows) and in their checkpoint's tensor names; the model files (llama.py,
qwen.py, glm.py, gemma.py, phi3.py) declare those. Residual adds are fused into the next
RMSNorm (`rms_norm(x, w, eps, r)` returns the normalized sum and the sum), and before an FP8
W8A8 qkv or gate-up GEMM so is the activations' quantization (fp8_norm_linear). `load_weights`
fuses QKV and gate-up at load time and refuses any missing, unexpected or mis-shaped tensor.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from tinypaged import kernels
from tinypaged.models import pipeline as stages
from tinypaged.models.attention_metadata import AttentionMetadata
from tinypaged.models.kv_scales import load_kv_scale
from tinypaged.models.layers import (
    Attention,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    default_weight_loader,
)
from tinypaged.models.moe import MoESpec, SparseMoeBlock, expert_checkpoint_name, expert_shard
from tinypaged.models.rope import RopeSpec, read_rope
from tinypaged.quantization.fp8 import fp8_norm_linear, fp8_silu_and_mul_down


@dataclass(frozen=True)
class DecoderSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2, GLM
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before rotary
    sandwich_norms: bool = False  # Glm4, Gemma: RMSNorm on the attention and MLP outputs too
    hidden_act: str = "silu"  # or "gelu_pytorch_tanh" (GeGLU)
    layer_windows: tuple[int | None, ...] = ()  # sliding window of each layer; () = all full
    local_rope: RopeSpec | None = None  # Gemma 3: the rotary of the sliding-window layers
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    attn_logit_softcap: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: the same on the logits
    norm_offset: float = 0.0  # Gemma: RMSNorm multiplies by (offset + w)
    embed_scale: float | None = None  # Gemma: the embeddings times sqrt(hidden)
    moe: MoESpec | None = None  # mixture-of-experts MLP in the layers it lists (models/moe.py)


ACTIVATIONS = {"silu": kernels.silu_and_mul, "gelu_pytorch_tanh": kernels.gelu_tanh_and_mul}


def read_layer_windows(hf_config) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers applies it: `layer_types` names the
    "sliding_attention" layers (5.x configs); else Gemma 3's `sliding_window_pattern` (every
    pattern-th layer global); else a set `sliding_window` applies to every layer unless
    `use_sliding_window` is false (Qwen2). () when no layer slides."""
    window = getattr(hf_config, "sliding_window", None)
    num_layers = hf_config.num_hidden_layers
    layer_types = getattr(hf_config, "layer_types", None)
    if window is None or getattr(hf_config, "use_sliding_window", True) is False:
        return ()
    if layer_types:
        if len(layer_types) != num_layers:
            raise ValueError(
                f"layer_types in config.json has {len(layer_types)} entries for "
                f"{num_layers} layers (num_hidden_layers); give one per layer"
            )
        windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    elif getattr(hf_config, "sliding_window_pattern", None):
        pattern = hf_config.sliding_window_pattern
        windows = tuple(None if (i + 1) % pattern == 0 else window for i in range(num_layers))
    else:
        windows = (window,) * num_layers
    return windows if any(w is not None for w in windows) else ()


def spec_from_hf_config(hf_config, *, interleaved_rope: bool = False,
                        default_partial_rotary: float = 1.0, **flags) -> DecoderSpec:
    """The spec of a transformers-style config (LlamaConfig, Qwen2Config, GlmConfig, ...);
    `flags` are the architecture's DecoderSpec switches (qkv_bias, qk_norm, ..., and `rope`
    where the model reads its own)."""
    act = flags.get("hidden_act") or getattr(hf_config, "hidden_act", None) or "silu"
    if act not in ACTIVATIONS:
        raise ValueError(
            f"hidden_act {act!r} in config.json is not supported; supported: "
            f"{', '.join(ACTIVATIONS)}"
        )
    flags["hidden_act"] = act
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    return DecoderSpec(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=hf_config.rms_norm_eps,
        rope=flags.pop("rope", None)
        or read_rope(hf_config, head_dim, interleaved_rope, default_partial_rotary),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        **flags,
    )


class SelfAttention(nn.Module):
    def __init__(self, spec: DecoderSpec, rotary_emb: RotaryEmbedding, quant_config=None,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(spec.hidden_size, spec.head_dim, spec.num_heads,
                                          spec.num_kv_heads, spec.qkv_bias, quant_config)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = spec.head_dim
        self.o_proj = RowParallelLinear(spec.num_heads * spec.head_dim, spec.hidden_size,
                                        spec.o_bias, quant_config)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, spec.norm_offset)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, spec.norm_offset)
        self.qk_norm = spec.qk_norm
        self.attn = Attention(self.num_heads, self.num_kv_heads, spec.head_dim,
                              scale=spec.attn_scale or spec.head_dim**-0.5,
                              rotary_emb=rotary_emb, sliding_window=sliding_window,
                              logits_soft_cap=spec.attn_logit_softcap)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        q = self.project_qkv(positions, x, attn_metadata.slot_mapping)
        return self.project_out(self.attn.attend(q, attn_metadata))

    def project_qkv(self, positions: torch.Tensor, x: torch.Tensor,
                    slot_mapping: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> the rotated q [T, num_heads, head_dim]; k and v go to the cache."""
        return self.store_qkv(positions, self.qkv_proj(x), slot_mapping)

    def store_qkv(self, positions: torch.Tensor, qkv: torch.Tensor,
                  slot_mapping: torch.Tensor) -> torch.Tensor:
        """qkv [T, (num_heads + 2 num_kv_heads) * head_dim] -> the rotated q
        [T, num_heads, head_dim]; k and v go to the cache."""
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)  # [T, num_heads, head_dim]
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)  # [T, num_kv_heads, head_dim]
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        # q/k norm, rotary and the KV store: one kernel
        norms = (self.q_norm, self.k_norm) if self.qk_norm else (None, None)
        return self.attn.store_kv(positions, q, k, v, slot_mapping, *norms)

    def project_out(self, attn_out: torch.Tensor) -> torch.Tensor:
        """attn_out [T, num_heads, head_dim] -> [T, hidden]"""
        return self.o_proj(attn_out.reshape(attn_out.shape[0], -1))


class MLP(nn.Module):
    """SwiGLU / GeGLU: down(act(x W_gate) * (x W_up)), gate and up in one GEMM."""

    def __init__(self, spec: DecoderSpec, quant_config=None) -> None:
        super().__init__()
        inter = spec.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(spec.hidden_size, [inter, inter],
                                                       spec.mlp_bias, quant_config)
        self.down_proj = RowParallelLinear(inter, spec.hidden_size, spec.mlp_bias, quant_config)
        self.act_and_mul = ACTIVATIONS[spec.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up_proj(x))

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2 * intermediate] -> down(act(gate) * up) [T, hidden]"""
        if self.act_and_mul is kernels.silu_and_mul:  # FP8 W8A8: fused with the quantization
            y = fp8_silu_and_mul_down(self.down_proj, gate_up)
            if y is not None:
                return y
        return self.down_proj(self.act_and_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, rotary_emb: RotaryEmbedding, quant_config=None,
                 layer_idx: int = 0, sliding_window: int | None = None) -> None:
        super().__init__()
        eps, offset = spec.rms_norm_eps, spec.norm_offset
        self.input_layernorm = RMSNorm(spec.hidden_size, eps, offset)
        self.self_attn = SelfAttention(spec, rotary_emb, quant_config, sliding_window)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps, offset)
        if spec.moe is not None and layer_idx in spec.moe.sparse_layers:
            self.mlp = SparseMoeBlock(spec.hidden_size, spec.moe, quant_config)
        else:
            self.mlp = MLP(spec, quant_config)
        self.sandwich_norms = spec.sandwich_norms
        if spec.sandwich_norms:
            self.post_self_attn_layernorm = RMSNorm(spec.hidden_size, eps, offset)
            self.post_mlp_layernorm = RMSNorm(spec.hidden_size, eps, offset)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, attn_metadata: AttentionMetadata):
        # `residual` is the running sum h; `hidden` the last block's output not yet added to it.
        q, residual = self.pre_attention(positions, hidden, residual, attn_metadata.slot_mapping)
        return self.post_attention(self.self_attn.attn.attend(q, attn_metadata), residual)

    def pre_attention(self, positions: torch.Tensor, hidden: torch.Tensor,
                      residual: torch.Tensor | None, slot_mapping: torch.Tensor):
        """Token-wise work up to attention: (the add and) the input norm, QKV, rotary, KV store.
        Returns the rotated q [T, num_heads, head_dim] and the running sum h [T, hidden]."""
        # FP8 W8A8: the norm quantizes x for the QKV GEMM in its own pass
        fused = fp8_norm_linear(self.input_layernorm, self.self_attn.qkv_proj, hidden, residual)
        if fused is not None:
            qkv, residual = fused
            return self.self_attn.store_qkv(positions, qkv, slot_mapping), residual
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        return self.self_attn.project_qkv(positions, hidden, slot_mapping), residual

    def post_attention(self, attn_out: torch.Tensor, residual: torch.Tensor):
        """Token-wise work after attention: o_proj, the add and norm, the MLP. Returns the
        MLP's output and the running sum, each [T, hidden]."""
        hidden = self.self_attn.project_out(attn_out)
        if self.sandwich_norms:
            hidden = self.post_self_attn_layernorm(hidden)
        # FP8 W8A8: the add and norm quantize x for the gate-up GEMM in their own pass
        fused = fp8_norm_linear(self.post_attention_layernorm, self.mlp.gate_up_proj, hidden,
                                residual) if isinstance(self.mlp, MLP) else None
        if fused is not None:
            gate_up, residual = fused
            hidden = self.mlp.down(gate_up)
        else:
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            hidden = self.mlp(hidden)
        if self.sandwich_norms:
            hidden = self.post_mlp_layernorm(hidden)
        return hidden, residual


def _rotary_embedding(rope: RopeSpec) -> RotaryEmbedding:
    return RotaryEmbedding(rope.cos_sin_cache(), rope.rotary_dim, rope.interleaved)


class DecoderModel(nn.Module):
    def __init__(self, spec: DecoderSpec, quant_config=None) -> None:
        super().__init__()
        # Pipeline parallelism: this stage's modules only, the others MissingLayer (pipeline.py)
        start, end = stages.stage_layers(spec.num_layers)
        embed = stages.is_first_stage() or (stages.is_last_stage() and spec.tie_word_embeddings)
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size) if (
            embed) else stages.MissingLayer()
        # Gemma scales by sqrt(hidden) rounded to the model dtype, as transformers does
        self.embed_scale = None if spec.embed_scale is None else float(
            torch.tensor(spec.embed_scale, dtype=torch.get_default_dtype(), device="cpu"))
        rotary_emb = _rotary_embedding(spec.rope)
        local_rotary_emb = rotary_emb if spec.local_rope is None else _rotary_embedding(
            spec.local_rope)
        windows = spec.layer_windows or (None,) * spec.num_layers
        self.layers = nn.ModuleList(
            DecoderLayer(spec, rotary_emb if window is None else local_rotary_emb, quant_config,
                         i, window) if start <= i < end else stages.MissingLayer()
            for i, window in enumerate(windows)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm_offset) if (
            stages.is_last_stage()) else stages.MissingLayer()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        return hidden if self.embed_scale is None else hidden * self.embed_scale

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.embed(input_ids), None  # [T, hidden]
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, attn_metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def forward_keeping(self, input_ids: torch.Tensor, positions: torch.Tensor,
                        attn_metadata: AttentionMetadata, layers: tuple[int, ...]):
        """`forward`, also returning the hidden states of `layers` side by side
        [T, len(layers) * hidden] (speculative decoding's EAGLE / MTP heads read them): for
        i < num_layers the residual stream entering layer i (0: the embeddings), for
        i = num_layers the final normed output."""
        hidden, residual, kept = self.embed(input_ids), None, []
        for i, layer in enumerate(self.layers):
            if i in layers:
                kept.append(hidden if residual is None else hidden + residual)
            hidden, residual = layer(positions, hidden, residual, attn_metadata)
        hidden, _ = self.norm(hidden, residual)
        if len(self.layers) in layers:
            kept.append(hidden)
        return hidden, torch.cat(kept, dim=-1)

    def piece(self, i: int, x: torch.Tensor, residual: torch.Tensor | None,
              positions: torch.Tensor, slot_mapping: torch.Tensor):
        """Piece i (0..num_layers) of the forward cut at every attention: all of it token-wise,
        so it can be captured once per token count (worker/piecewise_graphs.py).

            piece 0:       x = input_ids [T] -> embed, layer 0 up to attention
            piece i:       x = layer i-1's attention output [T, heads, head_dim] -> its o_proj
                           and MLP, then layer i up to attention
            piece L:       the last o_proj and MLP, the final norm

        Pieces 0..L-1 return (layer i's rotated q [T, heads, head_dim], running sum
        [T, hidden]); piece L returns (hidden [T, hidden], None). Between pieces i and i+1 the
        caller runs layer i's attention on q."""
        if i == 0:
            hidden = self.embed(x)
        else:
            hidden, residual = self.layers[i - 1].post_attention(x, residual)
        if i == len(self.layers):
            return self.norm(hidden, residual)[0], None
        return self.layers[i].pre_attention(positions, hidden, residual, slot_mapping)


class DecoderForCausalLM(nn.Module):
    """Base of every model class: `cls(hf_config, quant_config)` -> subclasses build the spec."""

    # Checkpoint modules packed into one of our fused GEMMs: name -> (fused module, shard id).
    packed_modules: ClassVar[dict[str, tuple[str, object]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, spec: DecoderSpec, quant_config=None) -> None:
        super().__init__()
        self.spec = spec
        self.model = DecoderModel(spec, quant_config)
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size) if (
            stages.is_last_stage()) else stages.MissingLayer()
        if spec.tie_word_embeddings and stages.is_last_stage():
            self.lm_head.weight = self.model.embed_tokens.weight
        first = self.model.layers[stages.stage_layers(spec.num_layers)[0]].self_attn
        self.num_layers = spec.num_layers
        self.num_kv_heads = first.num_kv_heads  # on this tensor-parallel rank
        self.head_dim = spec.head_dim
        # Speculative decoding's EAGLE / MTP heads (spec_decode/heads.py) set the layers whose
        # hidden states each forward keeps in `aux_hidden_states` (DecoderModel.forward_keeping);
        # () keeps nothing and costs nothing.
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden_states: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        if self.aux_layers:
            hidden, self.aux_hidden_states = self.model.forward_keeping(
                input_ids, positions, attn_metadata, self.aux_layers)
            return hidden
        return self.model(input_ids, positions, attn_metadata)  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)  # [N, vocab] in the model's dtype
        cap = self.spec.final_logit_softcap
        return logits if cap is None else torch.tanh(logits.float() / cap) * cap

    def map_name(self, checkpoint_name: str) -> str | None:
        """Checkpoint tensor name -> our parameter name (before QKV / gate-up packing), or None
        for tensors to skip. Subclasses with other naming schemes override this."""
        if checkpoint_name.endswith("rotary_emb.inv_freq"):  # recomputed, not a weight
            return None
        if self.spec.tie_word_embeddings and checkpoint_name == "lm_head.weight":
            return None  # a tied checkpoint may still carry the copy
        return checkpoint_name

    def checkpoint_name(self, name: str) -> str:
        """Inverse of `map_name`, for naming a missing tensor the way the checkpoint would."""
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: dict[str, set] = {name: set() for name in params}
        for checkpoint_name, tensor in weights:
            name = self.map_name(checkpoint_name)
            if name is None:
                continue
            if load_kv_scale(self, name, tensor):  # FP8 KV-cache scales (kv_scales.py)
                continue
            name, shard_id = self.pack_name(name)
            param = params.get(name)
            if param is None and stages.held_elsewhere(self, name):  # another pipeline stage's
                continue
            if param is None:
                raise ValueError(
                    f"unexpected tensor {checkpoint_name!r} in the checkpoint: "
                    f"{type(self).__name__} has no parameter {name!r}; check that config.json "
                    "belongs to these weights"
                )
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {checkpoint_name!r}: {e}") from None
            shard_ids = getattr(param, "shard_ids", (None,))
            loaded[name].update(shard_ids if shard_id is None else (shard_id,))
        missing = list(dict.fromkeys(
            self._missing_name(name, shard)
            for name, param in params.items()
            for shard in getattr(param, "shard_ids", (None,))
            if shard not in loaded[name]
        ))
        if missing:
            shown = ", ".join(missing[:8])
            raise ValueError(
                f"{len(missing)} tensor(s) missing from the checkpoint for "
                f"{type(self).__name__}: {shown}{' ...' if len(missing) > 8 else ''}"
            )

    def pack_name(self, name: str) -> tuple[str, object]:
        """Our parameter name -> (the fused parameter holding it, shard id): q/k/v into
        qkv_proj, gate/up into gate_up_proj, each expert into the stacked experts."""
        stacked = expert_shard(name)
        if stacked is not None:
            return stacked
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in self.packed_modules:
            parts[-2], shard_id = self.packed_modules[parts[-2]]
            return ".".join(parts), shard_id
        return name, None

    def _missing_name(self, name: str, shard_id) -> str:
        expert = expert_checkpoint_name(name, shard_id)
        if expert is not None:
            return self.checkpoint_name(expert)
        parts = name.split(".")
        for source, (fused, sid) in self.packed_modules.items():
            if len(parts) >= 2 and parts[-2] == fused and sid == shard_id:
                parts[-2] = source
                break
        return self.checkpoint_name(".".join(parts))
