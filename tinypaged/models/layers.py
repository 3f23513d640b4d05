"""Shared layers every model is built from, tensor-parallel (TP) aware from the start.

With TP size N each rank holds a slice of every big weight (at N = 1 nothing is split and no
collective runs):

    ColumnParallelLinear   y = x W^T, W [out, in] split by rows: rank r computes y[:, r-th slice]
    RowParallelLinear      y = x W^T, W [out, in] split by columns: rank r gets x's r-th slice,
                           computes a partial y and the ranks sum the partials (all_reduce)
    MergedColumnParallelLinear   several column linears in one GEMM (gate and up: [gate_r; up_r])
    QKVParallelLinear      q, k and v in one GEMM; each rank owns whole heads ([q_r; k_r; v_r]),
                           KV heads are replicated when there are fewer KV heads than ranks
    VocabParallelEmbedding / ParallelLMHead   the vocabulary split in contiguous ranges

Every parameter carries `weight_loader(param, loaded, shard_id=None)`, which takes the full
checkpoint tensor, cuts this rank's slice and copies it into its place (for a fused layer:
into the `shard_id` part; `shard_id=None` means the checkpoint already holds the fused tensor).
Parameters name the axes to slice: `output_dim`, `input_dim`, and `packed_factor` when several
values share one stored element along `output_dim` (AWQ packs 8 int4 values per int32), so the
same loaders slice dense `weight [out, in]` (output_dim 0, input_dim 1) and AWQ tensors
(`qweight [in, out/8]`, `qzeros [in/g, out/8]`, `scales [in/g, out]`: output_dim 1, input_dim 0).

A quantization format plugs in through `quant_config`, a QuantizationMethod
(quantization/base.py): `create_weights(layer, input_size, output_size_per_partition,
params_dtype)` registers its parameters on the layer (with those attributes) and
`apply(layer, x, bias)` computes the output; the layer adds the weight loaders.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tinypaged import kernels
from tinypaged.distributed.parallel_state import (
    all_gather_columns,
    all_reduce,
    get_tp_rank,
    get_tp_size,
)
from tinypaged.kernels import dense_gemv
from tinypaged.models.attention_metadata import AttentionMetadata
from tinypaged.quantization.base import QuantizationMethod


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator}); "
            "choose a tensor_parallel_size that divides it"
        )
    return numerator // denominator


def _check_shape(loaded: torch.Tensor, expected: list[int] | torch.Size) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"expected shape {tuple(expected)}, got {tuple(loaded.shape)}")


def load_rank_slice(param: nn.Parameter, loaded: torch.Tensor, dim: int | None, rank: int,
                    size: int) -> None:
    """Copy rank's slice of the full checkpoint tensor along `dim` (None: the whole tensor)."""
    if dim is not None:
        full = list(param.shape)
        full[dim] *= size
        _check_shape(loaded, full)
        loaded = loaded.narrow(dim, rank * param.shape[dim], param.shape[dim])
    _check_shape(loaded, param.shape)
    param.data.copy_(loaded)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """Replicated parameter: every rank takes the whole tensor."""
    _check_shape(loaded, param.shape)
    param.data.copy_(loaded)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim; with `residual`, first
    r = x + residual and return (norm(r), r): the add and the norm in one kernel pass.
    `offset`: the checkpoint stores w and the norm scales by (offset + w) (Gemma: 1), so the
    weight is loaded as offset + w (summed in fp32)."""

    def __init__(self, hidden_size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        if offset:
            self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, loaded.float() + self.offset)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return kernels.rms_norm(x, self.weight, self.eps, residual)


class LinearBase(nn.Module):
    """y = x W^T + b for this rank's slice: dense weight or the quant_config's tensors.
    With LoRA (lora/layers.py) `lora` adds each token's adapter delta after the base matmul
    (its shrink may run beside the base matmul: lora/side_stream.py), in the steps where a token
    has an adapter (lora/idle.py)."""

    lora = None

    def __init__(self, input_size: int, output_size: int, bias: bool,
                 quant_config: QuantizationMethod | None = None) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size  # this rank's sizes
        self.quant_config = quant_config
        if quant_config is None:
            self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
            self.weight.output_dim, self.weight.input_dim = 0, 1
        else:
            quant_config.create_weights(self, input_size, output_size, torch.get_default_dtype())
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.output_dim = 0
        else:
            self.register_parameter("bias", None)
        for param in self.parameters(recurse=False):
            if not hasattr(param, "weight_loader"):  # a quant method may bring its own
                param.weight_loader = self.weight_loader

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        lora = self.lora
        if lora is not None and not lora.active:  # no adapter in this step: the base alone
            lora = None
        # overlapped LoRA (TINYPAGED_LORA_OVERLAP, on CUDA): the shrink starts first, on a side
        # stream, and runs beside the base matmul; otherwise None and `apply` runs it after
        shrunk = None if lora is None else lora.shrink_beside(x)
        if self.quant_config is None:
            # F.linear, or at decode batch sizes on CUDA the split-K GEMV where it beats cuBLAS
            y = dense_gemv.dense_linear(x, self.weight, bias)
        else:
            y = self.quant_config.apply(self, x, bias)
        if lora is None:
            return y
        return lora.apply(x, y) if shrunk is None else lora.expand(y, shrunk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; the output stays split (no communication)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_config=None) -> None:
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        super().__init__(input_size, self.partition_size(output_size), bias, quant_config)

    def partition_size(self, output_size: int) -> int:
        return divide(output_size, self.tp_size, "output size")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        load_rank_slice(param, loaded, getattr(param, "output_dim", None), self.tp_rank,
                        self.tp_size)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column linears of sizes `output_sizes` stacked into one GEMM; shard i = the i-th one.
    Each rank holds [shard_0 slice; shard_1 slice; ...], so the halves of gate-up stay paired."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 quant_config=None) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, quant_config)
        for param in self.parameters(recurse=False):
            param.shard_ids = self.shard_ids()

    def shard_ids(self) -> tuple:
        return tuple(range(len(self.output_sizes)))

    def shard_layout(self, shard_id) -> tuple[int, int, int, int]:
        """(offset in this rank's output, size on this rank, full size, index of this rank's
        slice in the checkpoint tensor), in unpacked output features."""
        index = self.shard_ids().index(shard_id)
        per_rank = [divide(s, self.tp_size, "output size") for s in self.output_sizes]
        return sum(per_rank[:index]), per_rank[index], self.output_sizes[index], self.tp_rank

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        dim = getattr(param, "output_dim", None)
        if dim is None:  # replicated (e.g. a per-layer scalar): every shard holds the same
            default_weight_loader(param, loaded)
            return
        packed = getattr(param, "packed_factor", 1)
        if shard_id is None:  # the checkpoint holds the fused tensor: load it piece by piece
            full_sizes = [self.shard_layout(s)[2] // packed for s in self.shard_ids()]
            expected = list(param.shape)
            expected[dim] = sum(full_sizes)
            _check_shape(loaded, expected)
            for sid, piece in zip(self.shard_ids(), loaded.split(full_sizes, dim=dim)):
                self.weight_loader(param, piece, sid)
            return
        offset, size, full, slot = self.shard_layout(shard_id)
        offset, size, full = offset // packed, size // packed, full // packed
        expected = list(param.shape)
        expected[dim] = full
        _check_shape(loaded, expected)
        param.data.narrow(dim, offset, size).copy_(loaded.narrow(dim, slot * size, size))


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k, v projections in one GEMM, split by heads: shards "q", "k", "v"."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False, quant_config=None) -> None:
        tp_size = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        if total_num_kv_heads >= tp_size:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, "num_key_value_heads")
            self.kv_replicas = 1
        else:  # fewer KV heads than ranks: ranks r with equal r // kv_replicas share a KV head
            if tp_size % total_num_kv_heads:
                raise ValueError(
                    f"tensor-parallel size {tp_size} is not a multiple of num_key_value_heads "
                    f"({total_num_kv_heads}); choose a size that is"
                )
            self.num_kv_heads = 1
            self.kv_replicas = tp_size // total_num_kv_heads
        self.q_size = self.num_heads * head_dim  # this rank's q features
        self.kv_size = self.num_kv_heads * head_dim  # this rank's k (and v) features
        kv_total = total_num_kv_heads * head_dim
        super().__init__(hidden_size, [total_num_heads * head_dim, kv_total, kv_total], bias,
                         quant_config)

    def partition_size(self, output_size: int) -> int:
        return self.q_size + 2 * self.kv_size

    def shard_ids(self) -> tuple:
        return ("q", "k", "v")

    def shard_layout(self, shard_id) -> tuple[int, int, int, int]:
        if shard_id == "q":
            return 0, self.q_size, self.output_sizes[0], self.tp_rank
        offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
        return offset, self.kv_size, self.output_sizes[1], self.tp_rank // self.kv_replicas


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial outputs are summed over ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_config=None) -> None:
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        per_rank = divide(input_size, self.tp_size, "input size")
        super().__init__(per_rank, output_size, bias, quant_config)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        load_rank_slice(param, loaded, getattr(param, "input_dim", None), self.tp_rank,
                        self.tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(self.matmul(x, None))
        return y if self.bias is None else y + self.bias  # the bias once, not once per rank


class VocabParallelEmbedding(nn.Module):
    """Token embedding; rank r holds rows [r * per_rank, (r + 1) * per_rank) of the table
    (the last rank's range padded with zero rows when the vocabulary does not divide)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_size = get_tp_size()
        self.per_rank = -(-num_embeddings // self.tp_size)
        self.start = get_tp_rank() * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _check_shape(loaded, (self.num_embeddings, self.embedding_dim))
        rows = loaded[self.start : self.start + self.per_rank]
        param.data[: rows.shape[0]].copy_(rows)
        param.data[rows.shape[0] :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)  # [T, hidden]
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill_(outside[:, None], 0.0))


class ParallelLMHead(VocabParallelEmbedding):
    """logits = hidden @ E^T for the rows the runner samples only, in the model's dtype: a
    greedy step's argmax reads them as they are (the same token as over their float32 copy),
    and the sampler makes the float32 copy only when it computes more than an argmax (a
    [batch, vocab] float32 copy every decode step is pure memory traffic)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = dense_gemv.dense_linear(hidden, self.weight)  # [N, per_rank]
        if self.tp_size > 1:  # rank r holds vocabulary columns [r * per_rank, (r + 1) * per_rank)
            logits = all_gather_columns(logits)  # [N, tp * per_rank]
        return logits[:, : self.num_embeddings]  # [N, vocab]


class RotaryEmbedding(nn.Module):
    """The rotary settings shared by all layers: which of each head's dims rotate
    (`rotary_dim`), the pairing (`interleaved`: adjacent dims, else halves) and the cos/sin
    table `[max_position, rotary_dim]`. The table is float32 whatever the model dtype (bf16
    angles lose positions past a few hundred); it is a plain attribute, not a buffer, so that
    `model.to(dtype)` cannot cast it. `Attention` applies the rotation, fused with its KV store."""

    def __init__(self, cos_sin_cache: torch.Tensor, rotary_dim: int, interleaved: bool) -> None:
        super().__init__()
        self.cos_sin_cache = cos_sin_cache.float()
        self.rotary_dim, self.interleaved = rotary_dim, interleaved


class Attention(nn.Module):
    """Paged attention of this rank's heads. One fused kernel takes the step's q, k, v as the
    QKV projection made them: (Qwen3, Gemma 3: RMSNorm over each head of q and k,) rotary on q and
    k, the rotated k and v into their cache slots; then each new token attends to its whole
    context through the block table. The runner assigns `k_cache` / `v_cache`
    `[num_blocks, block_size, num_kv_heads, head_dim]` before running. `sliding_window`: this
    layer's window (None: full causal attention); `logits_soft_cap`: scores become
    cap * tanh(scores / cap) (Gemma 2)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 rotary_emb: RotaryEmbedding, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.rotary_emb = rotary_emb
        self.sliding_window, self.logits_soft_cap = sliding_window, logits_soft_cap
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.k_scale = self.v_scale = 1.0  # an FP8 cache's per-tensor scales (kv_scales.py)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, attn_metadata: AttentionMetadata,
                q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None) -> torch.Tensor:
        # q [T, num_heads, head_dim]; k, v [T, num_kv_heads, head_dim]; q is rotated in place
        q = self.store_kv(positions, q, k, v, attn_metadata.slot_mapping, q_norm, k_norm)
        return self.attend(q, attn_metadata)  # [T, num_heads, head_dim]

    def store_kv(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, slot_mapping: torch.Tensor, q_norm: RMSNorm | None = None,
                 k_norm: RMSNorm | None = None) -> torch.Tensor:
        """The token-wise half: q/k norm, rotary, k and v into their slots (slot -1: not
        stored); returns the rotated q. Piecewise CUDA graphs capture this half."""
        if self.k_cache.numel() == 0:
            raise RuntimeError(
                "Attention.k_cache / v_cache are not assigned: allocate the KV cache "
                "[num_blocks, block_size, num_kv_heads, head_dim] for every layer before forward"
            )
        rope = self.rotary_emb
        return kernels.rotary_store_kv(
            positions, q, k, v, self.k_cache, self.v_cache, slot_mapping,
            rope.cos_sin_cache, rope.rotary_dim, rope.interleaved,
            q_norm_weight=None if q_norm is None else q_norm.weight,
            k_norm_weight=None if k_norm is None else k_norm.weight,
            eps=1e-6 if q_norm is None else q_norm.eps, **self._fp8_scales(),
        )

    def _fp8_scales(self) -> dict:
        """The checkpoint's KV scales, where the cache is FP8 (else unused, as vLLM)."""
        if self.k_cache.element_size() != 1:
            return {}
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}

    def attend(self, q: torch.Tensor, attn_metadata: AttentionMetadata,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """The half that reads the whole batch's context: each new token over its cached keys
        (shapes depend on the batch, so piecewise CUDA graphs run it eagerly, into `out`)."""
        md = attn_metadata
        kv = self._fp8_scales()  # stored k / k_scale, v / v_scale: k_scale joins the scores'
        out = kernels.paged_attention(  # scale, v_scale multiplies the output
            q, self.k_cache, self.v_cache, md.block_tables, md.seq_lens, md.query_start_loc,
            self.scale * kv.get("k_scale", 1.0), max_query_len=md.max_query_len,
            max_seq_len=md.max_seq_len,
            out=out, sliding_window=self.sliding_window, softcap=self.logits_soft_cap,
            uniform_decode=md.uniform_decode,
        )  # [T, num_heads, head_dim]
        return out if kv.get("v_scale", 1.0) == 1.0 else out.mul_(kv["v_scale"])
