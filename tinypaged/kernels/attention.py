"""Paged attention: one entry point for prefill, chunked prefill, decode and mixed batches.

A batch holds B sequences. Sequence b brings q_len_b new tokens, laid end to end in q (rows
query_start_loc[b] : query_start_loc[b+1]); its whole context is seq_lens[b] tokens, the new ones
last, and the K/V of all of them (new ones included) are already stored in the paged cache. New
token i of sequence b sits at position p_i = seq_lens[b] - q_len_b + i and attends causally:

    out[t, h] = sum_{j in W(p_i)} softmax_j(s_ij) V[j, h // GROUP],
    s_ij = scale * q[t, h] . K[j, h // GROUP]

with GROUP = Hq / Hk query heads per KV head (GQA; 1 = multi-head). Key j of sequence b lives in
row j % block_size of physical block block_tables[b, j // block_size]. W(p) is the causal range
j <= p, or with a sliding window of w tokens (Mistral, Gemma's local layers) p - w < j <= p,
as transformers masks it: the kernels skip the KV tiles wholly outside it. With logit
soft-capping (Gemma 2) the scores are s_ij = cap * tanh(s_ij / cap) before the softmax.

Shapes: q [T, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hk, D] in q's dtype or FP8
(float8_e4m3fn, scale 1.0: kv_cache.py; the kernels widen each K/V tile to q's dtype as it
loads); block_tables
[B, max_blocks] int32; seq_lens [B] int32; query_start_loc [B + 1] int32; out [T, Hq, D] in q's
dtype. A prefill is q_len = seq_len; a chunked prefill q_len < seq_len; a decode q_len = 1.

Three Triton kernels (see their files): batches with a query longer than 1 run the varlen kernel
(attention_varlen.py), or on Hopper GPUs (sm_90), when the query tiles fill 128 rows and there
is no window or soft-cap, its Hopper-shaped twin (attention_hopper.py), or with
TINYPAGED_PREFILL_ATTENTION=gluon and head_dim 128 the same in Gluon (attention_gluon.py:
warp-specialized, TMA and wgmma); pure-decode batches
(max_query_len == 1) and uniform decodes (every sequence q new tokens, a speculative
verification: `uniform_decode`) the split-KV flash-decoding kernel (attention_decode.py). None
reads a tensor on the host when max_query_len and max_seq_len are passed, so a step stays
asynchronous and graph-capturable.
"""

from __future__ import annotations

import torch

from tinypaged import envs
from tinypaged.kernels._triton import num_sms, use_triton
from tinypaged.kernels.attention_decode import decode_attention_triton, decode_num_splits
from tinypaged.kernels.attention_gluon import gluon_attention, gluon_supports
from tinypaged.kernels.attention_hopper import hopper_attention_triton, hopper_supports, is_hopper
from tinypaged.kernels.attention_varlen import varlen_attention_triton
from tinypaged.kernels.kv_cache import check_cache_pair

# The tile configurations (the launchers have no defaults of their own), overridable per call
# through `config=`. Prefill: 128-row query tiles over 32-key tiles, 4 warps, 3 stages; decode
# streams K/V in 64-key tiles with 4 warps, 3 stages. Tuned with `benchmarks/kernel_bench.py --tune`
# (B4 L2048 32/8 heads, bf16); the decode tiles held against a sweep of variants in CUDA graphs
# (block_n 32-128, 2-8 warps, 1-3 stages, next tile prefetched, sums instead of tl.dot, a
# register cap): none was faster on every shape. 128-key tiles take fewer loop trips on the long
# sequences of a mix of contexts, but lose on uniform ones, and a launch cannot tell the two
# apart (graphs pass max_model_len). The sweep: benchmarks/RESULTS-log.md.
VARLEN_CONFIG = {"block_m": 128, "block_n": 32, "num_warps": 4, "num_stages": 3}
DECODE_CONFIG = {"block_n": 64, "num_warps": 4, "num_stages": 3}
# Prefill on sm_90 (attention_hopper.py), for batches whose query tiles fill 128 rows: 128 x 64
# tiles on two warpgroups, 2 stages, registers capped at 128 so that two programs share an SM
# (one's softmax overlaps the other's MMA; a few registers spill, and it still wins over one
# program per SM with 3 stages and no cap, and over 128 x 32 tiles that fit the cap without
# spilling but feed smaller MMAs). The sweep: benchmarks/RESULTS-log.md.
HOPPER_CONFIG = {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2, "tma": True,
                 "maxnreg": 128}
# The Gluon kernel (attention_gluon.py), taken instead of HOPPER_CONFIG's when
# TINYPAGED_PREFILL_ATTENTION=gluon (the default) and gluon_supports the shape: 128 rows on two
# consumer warpgroups taking turns at the tensor cores (mode, attention_gluon.MODES) plus a TMA
# producer warp; 128-key tiles, 3 stages; programs launched 4 KV heads at a time, heaviest
# query tiles first (head_group): the fastest of GLUON_CONFIGS on every shape
# benchmarks/prefill_gluon.py timed on the H200 (figures: benchmarks/RESULTS.md).
GLUON_CONFIG = {"block_m": 128, "block_n": 128, "num_stages": 3, "mode": "pingpong",
                "head_group": 4}

_CONFIG_KEYS = (frozenset(VARLEN_CONFIG) | frozenset(DECODE_CONFIG) | frozenset(HOPPER_CONFIG)
                | frozenset(GLUON_CONFIG))


def _varlen_config(max_query_len: int, group: int) -> dict:
    """Shrink the query tile for short queries (decode-heavy mixed batches) to waste fewer rows."""
    config = dict(VARLEN_CONFIG)
    rows = max_query_len * group
    if rows <= 16:
        config.update(block_m=16, num_warps=4)
    elif rows <= 64:
        config.update(block_m=64, num_warps=4)
    return config


def _override(defaults: dict, config: dict | None) -> dict:
    """The defaults, updated by the entries of `config` that this kernel knows."""
    return {key: (config or {}).get(key, value) for key, value in defaults.items()}


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: dict | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    uniform_decode: bool = False,
) -> torch.Tensor:
    """The Triton launcher; arguments as checked by `paged_attention`."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0 or seq_lens.shape[0] == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    if max_query_len is None:  # host sync: callers on the hot path pass these
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out)
    window = {"sliding_window": sliding_window, "softcap": softcap}
    if max_query_len == 1 or uniform_decode:
        if num_splits is None:
            if max_seq_len is None:
                max_seq_len = int(seq_lens.max().item())
            if sliding_window is not None:  # the splits share the windows, not the context
                max_seq_len = min(max_seq_len, sliding_window + max_query_len - 1)
            sms = num_sms(q.device.index or 0) if q.is_cuda else 8
            num_splits = decode_num_splits(seq_lens.shape[0], k_cache.shape[2], max_seq_len, sms)
        return decode_attention_triton(*args, num_splits=num_splits, max_query_len=max_query_len,
                                       **window, **_override(DECODE_CONFIG, config))
    group = q.shape[1] // k_cache.shape[2]
    on_hopper = q.is_cuda and is_hopper(q.device.index or 0)
    path = prefill_kernel(q, k_cache, max_query_len, sliding_window, softcap, on_hopper)
    if path == "gluon":
        return gluon_attention(*args, **_override(GLUON_CONFIG, config))
    if path == "hopper":
        return hopper_attention_triton(*args, **_override(HOPPER_CONFIG, config))
    return varlen_attention_triton(*args, **window,
                                   **_override(_varlen_config(max_query_len, group), config))


def prefill_kernel(q, k_cache, max_query_len: int, sliding_window, softcap,
                   on_hopper: bool) -> str:
    """Which kernel takes a batch with queries longer than one token: "varlen", or on sm_90 when
    the query tiles fill 128 rows "hopper" (attention_hopper.py), or "gluon" (attention_gluon.py)
    where TINYPAGED_PREFILL_ATTENTION=gluon asks for it and it covers the shape."""
    group = q.shape[1] // k_cache.shape[2]
    if not (max_query_len * group > 64 and on_hopper
            and hopper_supports(q, sliding_window, softcap)
            and k_cache.dtype == q.dtype):  # an FP8 cache: the portable kernel widens its tiles
        return "varlen"
    if (envs.TINYPAGED_PREFILL_ATTENTION == "gluon"
            and gluon_supports(q, k_cache, sliding_window, softcap)):
        return "gluon"
    return "hopper"


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    uniform_decode: bool = False,
) -> torch.Tensor:
    """The torch reference: per sequence, gather its K/V through the block table, fp32 softmax
    (uniform_decode picks a Triton kernel, not a result: ignored here)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    block_size = k_cache.shape[1]
    group = q.shape[1] // num_kv_heads
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_rows = k_cache.reshape(-1, num_kv_heads, head_dim)  # [num_blocks * block_size, Hk, D]
    v_rows = v_cache.reshape(-1, num_kv_heads, head_dim)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q_begin, q_end = starts[b], starts[b + 1]
        if q_end == q_begin:
            continue
        pos = torch.arange(seq_len, device=q.device)
        slots = block_tables[b, pos // block_size].long() * block_size + pos % block_size
        k = k_rows[slots].float().repeat_interleave(group, dim=1)  # [seq_len, Hq, D]
        v = v_rows[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q_begin:q_end].float(), k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = seq_len - (q_end - q_begin) + torch.arange(q_end - q_begin, device=q.device)
        hidden = pos[None, :] > q_pos[:, None]  # [q_len, seq_len]
        if sliding_window is not None:
            hidden |= pos[None, :] <= q_pos[:, None] - sliding_window
        scores.masked_fill_(hidden, float("-inf"))
        out[q_begin:q_end] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).to(out.dtype)
    return out


def _check_int_tensor(name: str, t: torch.Tensor, shape: tuple) -> None:
    if t.is_floating_point() or t.is_complex() or t.dim() != len(shape) or any(
        want is not None and got != want for got, want in zip(t.shape, shape)
    ):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(
            f"{name} must be an integer tensor of shape {want}; "
            f"got {t.dtype} of shape {tuple(t.shape)}"
        )


def _check_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, config):
    if q.dim() != 3 or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(
            f"q must be a [T, Hq, D] float16/bfloat16/float32 tensor; "
            f"got {q.dtype} of shape {tuple(q.shape)}"
        )
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    if k_cache.dim() != 4 or k_cache.shape[3] != head_dim or \
            k_cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, Hk, D={head_dim}] in q's dtype {q.dtype} "
            "or float8_e4m3fn (kv_cache_dtype='fp8'); "
            f"got {k_cache.dtype} of shape {tuple(k_cache.shape)}"
        )
    check_cache_pair(k_cache, v_cache)
    num_kv_heads = k_cache.shape[2]
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"q's head count ({num_q_heads}) must be a multiple of k_cache's KV head count "
            f"({num_kv_heads}); check num_attention_heads / num_key_value_heads"
        )
    _check_int_tensor("seq_lens", seq_lens, (None,))
    num_seqs = seq_lens.shape[0]
    _check_int_tensor("query_start_loc", query_start_loc, (num_seqs + 1,))
    _check_int_tensor("block_tables", block_tables, (num_seqs, None))
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ValueError(
            f"out must be {tuple(q.shape)} {q.dtype} like q; got {tuple(out.shape)} {out.dtype}"
        )
    tensors = (k_cache, v_cache, block_tables, seq_lens, query_start_loc) + (
        () if out is None else (out,)
    )
    if any(t.device != q.device for t in tensors):
        raise ValueError(f"every tensor must be on q's device {q.device}")
    unknown = set(config or ()) - _CONFIG_KEYS
    if unknown:
        raise ValueError(
            f"config has unknown keys {sorted(unknown)}; known: {sorted(_CONFIG_KEYS)}"
        )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: dict | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    uniform_decode: bool = False,
) -> torch.Tensor:
    """Causal attention of each new token over its paged context; returns [T, Hq, D].

    max_query_len / max_seq_len: pass them (host ints) to keep the call free of host syncs;
    max_query_len == 1 selects the split-KV decode kernel. num_splits: fixed split count for
    decode (e.g. under CUDA-graph capture); default from batch, heads, context and SM count.
    config: tile overrides, keys of VARLEN_CONFIG / DECODE_CONFIG / HOPPER_CONFIG /
    GLUON_CONFIG (block_m, block_n, num_warps, num_stages; tma, maxnreg on Hopper).
    num_splits and config only affect the Triton path.
    sliding_window: each token sees only itself and the sliding_window - 1 keys before it
    (None: the whole causal context). softcap: scores become softcap * tanh(scores / softcap).
    uniform_decode (vLLM's term): every sequence has max_query_len new tokens, few of them, as a
    speculative verification's k + 1 (fewer, 0 included, are right too): the split-KV decode
    kernel takes all of a sequence's tokens in one program (attention_decode.py's multi-query
    mode) instead of the varlen kernel.
    """
    _check_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, config)
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 or None; got {num_splits}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None; got {sliding_window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None; got {softcap}")
    window = {"sliding_window": sliding_window, "softcap": softcap}
    if use_triton(q):
        return paged_attention_triton(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
            max_query_len=max_query_len, max_seq_len=max_seq_len, out=out,
            num_splits=num_splits, config=config, uniform_decode=uniform_decode, **window,
        )
    return paged_attention_ref(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
        max_query_len=max_query_len, max_seq_len=max_seq_len, out=out, **window,
    )
