"""The flat batch the runner hands to a model: no padding, new tokens laid end to end.

B sequences, T new tokens in all. Sequence b's new tokens are rows
`query_start_loc[b] : query_start_loc[b+1]` of every [T, ...] tensor; its whole context
(cached + new, new ones last) is `seq_lens[b]` tokens long and lives in the KV-cache blocks
`block_tables[b, :ceil(seq_lens[b] / block_size)]`.

A batch in which every sequence has the same q new tokens (a speculative verification: k + 1
each) can take the split-KV decode kernel, whose splits fill the GPU where the varlen kernel
would give a short query of one sequence a single program per KV head walking the whole
context, in one of two ways:

- `uniform_decode=True` (vLLM's term for such a batch): the kernel's multi-query mode, one
  program per (KV head, sequence, split) for all q tokens, so each K/V tile is read once;
- `as_decodes`: B * q one-token decodes, new token i of sequence b, at position
  seq_lens[b] - q + i, attending causally to exactly the keys a decode of a sequence of length
  seq_lens[b] - q + i + 1 over the same blocks attends to; the q copies of a sequence read the
  same K/V (mostly from L2) q times.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token (-1 = do not store)
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32: cached + new tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int  # max over b of new tokens; 1 means a pure-decode batch
    max_seq_len: int  # max over b of seq_lens
    uniform_decode: bool = False  # every sequence has max_query_len new tokens (or 0: padding)


def as_decodes(md: AttentionMetadata, q: int) -> AttentionMetadata:
    """`md` of B sequences with q new tokens each (T = B * q) as T one-token decodes, built on
    the device with no host sync (CUDA-graph capturable); the slots stay as they are."""
    num_seqs = md.seq_lens.shape[0]
    offsets = torch.arange(1 - q, 1, dtype=md.seq_lens.dtype, device=md.seq_lens.device)
    seq_lens = (md.seq_lens[:, None] + offsets[None, :]).reshape(-1)  # [B * q]
    block_tables = md.block_tables[:, None].expand(-1, q, -1).reshape(num_seqs * q, -1)
    query_start_loc = torch.arange(num_seqs * q + 1, dtype=md.query_start_loc.dtype,
                                   device=md.query_start_loc.device)  # [B * q + 1]
    return AttentionMetadata(md.slot_mapping, query_start_loc, seq_lens, block_tables,
                             max_query_len=1, max_seq_len=md.max_seq_len)
