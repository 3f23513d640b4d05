"""Sequence: the state of one sample of one request as it moves through the scheduler.

A request with `n` samples becomes `n` Sequences sharing `request_id` and the prompt (the prefix
cache lets the later ones reuse the first one's prompt blocks). A Sequence's tokens are
`token_ids = prompt + generated`; of these, the first `num_computed_tokens` have their K/V rows
in the paged cache, in the blocks listed by `block_table`:

    slot of position p = block_table[p // block_size] * block_size + p % block_size

Between engine steps `num_computed_tokens < len(token_ids)`: at least the newest token (the last
prompt token, or the last sampled one) still has to run through the model, since its logits give
the next token. A step that computes the rest of the tokens ends in a sampled token.

`num_computed_tokens` counts a step's tokens from the moment the step is scheduled (as in vLLM
v1). Under async scheduling the next step is scheduled before the host knows the token a step
samples: that token is a placeholder, counted in `num_output_placeholders` until it arrives,
and the next step computes it from the sampled ids still on the GPU. So in general

    tokens the scheduler sees = len(token_ids) + num_output_placeholders

Lifecycle: WAITING -> RUNNING -> FINISHED, with RUNNING -> WAITING on preemption (the blocks are
freed and the prompt and generated tokens are recomputed later, the tokens themselves are kept).
"""

from __future__ import annotations

import enum
import itertools
from typing import Any

_next_seq_id = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One sample of one request. `sampling_params` is opaque here; only `.max_tokens` is read."""

    lora_int_id = 0  # its LoRA adapter (lora/), 0 = none; keys its prefix-cache blocks
    lora_request = None

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: Any = None,
        *,
        index: int = 0,
        seq_id: int | None = None,
    ) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError(
                f"request {request_id!r}: the prompt is empty; give at least one token"
            )
        self.seq_id: int = next(_next_seq_id) if seq_id is None else seq_id
        self.request_id = request_id
        self.index = index  # which of the request's n samples
        self.sampling_params = sampling_params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.arrival_order = -1  # set by Scheduler.add: FIFO position among all sequences
        self.max_length = 0  # set by Scheduler.add: min(max_model_len, prompt + max_tokens)
        self.num_preemptions = 0

        # KV-cache state, owned by the BlockManager and the Scheduler.
        self.num_computed_tokens = 0  # tokens whose K/V rows are in the cache (or scheduled)
        self.num_output_placeholders = 0  # sampled tokens still on their way to the host
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.skip_prefix_cache = False  # compute the whole prompt (its logits are wanted)
        self.block_table: list[int] = []
        # Chained hash of each full block of token_ids (computed lazily, kept across preemption
        # since the tokens do not change), and how many leading blocks of block_table were already
        # offered to the prefix cache.
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0
        # Speculative decoding: the tokens a proposer guessed for the next step (spec_decode/);
        # scheduled as extra new tokens after the last one, never part of token_ids.
        self.spec_token_ids: list[int] = []

    # ---- tokens --------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def max_tokens(self) -> int | None:
        """The request's generation limit; None means "up to max_model_len"."""
        return getattr(self.sampling_params, "max_tokens", None)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    # ---- scheduling state ----------------------------------------------------------------
    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) + self.num_output_placeholders - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """More than one token left to compute: the prompt (or a recompute after preemption)."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, request_id={self.request_id!r}, "
            f"status={self.status.name}, tokens={len(self.token_ids)}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )
