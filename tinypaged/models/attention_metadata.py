"""The flat batch the runner hands to a model: no padding, new tokens laid end to end.

B sequences, T new tokens in all. Sequence b's new tokens are rows
`query_start_loc[b] : query_start_loc[b+1]` of every [T, ...] tensor; its whole context
(cached + new, new ones last) is `seq_lens[b]` tokens long and lives in the KV-cache blocks
`block_tables[b, :ceil(seq_lens[b] / block_size)]`.
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
