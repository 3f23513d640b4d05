"""Prompt logprobs: how likely the model found each prompt token (vLLM's `prompt_logprobs`).

The logits at prompt position p predict token p + 1, so a prefill chunk over positions
[p0, p0 + q) scores prompt tokens p0 + 1 ... p0 + q (those still inside the prompt):

    logprob(prompt[p + 1]) = log_softmax(logits[p])[prompt[p + 1]]        (raw logits)

The first prompt token has no logprob (None, as vLLM). The runner returns the logits of every
row of such a chunk (`prompt_logits`); the request's own prefix is computed rather than read
from the prefix cache, since cached positions produce no logits. Only sample 0 of a request
collects them: its n samples share the prompt.
"""

from __future__ import annotations

from typing import Any

import torch


def num_prompt_rows(num_computed: int, num_new: int, num_prompt_tokens: int) -> int:
    """How many rows of a chunk starting at `num_computed` score a prompt token."""
    return max(0, min(num_computed + num_new, num_prompt_tokens - 1) - num_computed)


def prompt_rows_wanted(item: Any, req: Any) -> int:
    """Prompt tokens this step's chunk of `item` (a ScheduledItem) scores for `req`'s
    prompt_logprobs (the engine's request state); 0 when it asks for none."""
    seq, done, start = item.seq, req.prompt_logprobs, item.num_computed_tokens
    # Sample 0 collects them once; after a preemption the recomputed rows are not needed.
    if done is None or seq.index != 0 or len(done) != start + 1:
        return 0
    prompt_len = len(req.prompt_token_ids)
    return num_prompt_rows(start, item.num_new_tokens, prompt_len)


def take_prompt_logprobs(
    items: list, reqs: list, prompt_rows: list[int], logits: torch.Tensor
) -> torch.Tensor:
    """Append the prompt logprobs of the chunks that asked (the runner returned all their
    rows) to their requests; return the logits of the sampled rows alone, in `items` order."""
    sampled, row = [], 0
    for item, req, n in zip(items, reqs, prompt_rows):
        width = item.num_new_tokens if n else int(item.sample)
        if n:
            p0 = item.num_computed_tokens
            targets = req.prompt_token_ids[p0 + 1 : p0 + 1 + n]
            rows, ranks = prompt_logprobs(
                logits[row : row + n], targets, req.params.prompt_logprobs
            )
            req.prompt_logprobs += rows
            req.prompt_logprob_ranks += ranks
        if item.sample:
            sampled.append(logits[row + width - 1 : row + width])
        row += width
    return torch.cat(sampled) if sampled else logits[:0]


def prompt_logprobs(
    logits: torch.Tensor, targets: list[int], num_top: int
) -> tuple[list[dict[int, float]], list[int]]:
    """Per row: {target token: logprob} then the `num_top` most likely tokens; and the
    target's rank (1 + how many tokens are more likely, vLLM's Logprob.rank).

    logits: [n, vocab] (row i predicts targets[i])."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
    ids = torch.tensor(targets, device=logits.device).view(-1, 1)
    chosen_t = logprobs.gather(1, ids)  # [n, 1]
    ranks = ((logprobs > chosen_t).sum(dim=-1) + 1).tolist()
    chosen = chosen_t.squeeze(1).tolist()
    rows = [{t: lp} for t, lp in zip(targets, chosen)]
    if num_top > 0:
        top_vals, top_ids = logprobs.topk(num_top, dim=-1)
        for row, ks, vs in zip(rows, top_ids.tolist(), top_vals.tolist()):
            row.update(zip(ks, vs))
    return rows, ranks
