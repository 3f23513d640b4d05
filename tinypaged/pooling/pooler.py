"""Pooling a step's rows into one vector per finished input, then the task's last touches.

The runner returns the head's output (model.py) for the rows the pooler asks for:

    LAST   the last row of each sequence whose prefill ends this step (the sampled rows)
    MEAN   every new row: vector = sum of the rows of all its chunks / prompt length
    CLS    every new row: vector = the row of position 0

A prompt longer than a step's token budget is prefilled in chunks over several steps; MEAN and
CLS keep a partial result per sequence on the device until its last chunk. A sequence that
restarts at position 0 (first chunk, or recompute after preemption) drops its partial result.

Then per request (`finish`): embeddings are cut to `dimensions` (Matryoshka) and L2-normalized,
in that order (vLLM's); classifier logits go through sigmoid (one label) or softmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tinypaged.pooling.params import PoolingParams


class Pooler:
    def __init__(self, pooler_config: dict) -> None:
        self.config = pooler_config
        self.pooling_type: str = pooler_config["pooling_type"]
        self.every_row = self.pooling_type != "LAST"  # MEAN and CLS read every new row
        self.partial: dict[int, torch.Tensor] = {}  # seq_id -> [dim] sum (MEAN) or row 0 (CLS)

    def forget(self, seq_id: int) -> None:
        self.partial.pop(seq_id, None)

    def pool(self, items: Sequence, rows: torch.Tensor) -> torch.Tensor:
        """`items`: the step's ScheduledSequences; `rows`: the head outputs the runner returned
        for them (see the module docstring). -> [S, dim] float32, one row per item with
        `sample` (its prefill ends here), in step order."""
        if not self.every_row:
            return rows.float()
        device, dim = rows.device, rows.shape[-1]
        lens = [it.num_new_tokens for it in items]
        starts = torch.tensor([0, *lens[:-1]], device=device).cumsum(0)  # [B]
        if self.pooling_type == "MEAN":
            seg = torch.repeat_interleave(torch.arange(len(items), device=device),
                                          torch.tensor(lens, device=device))
            vectors = torch.zeros(len(items), dim, dtype=torch.float32, device=device)
            vectors.index_add_(0, seg, rows.float())  # [B, dim]: each item's sum of rows
        else:
            vectors = rows[starts].float()  # [B, dim]: each item's first new row
        if all(it.sample and it.num_computed_tokens == 0 for it in items):  # one chunk each
            if self.pooling_type == "MEAN":
                return vectors / torch.tensor(lens, device=device).unsqueeze(1)
            return vectors
        done = []
        for i, it in enumerate(items):
            seq_id, first = it.seq.seq_id, it.num_computed_tokens == 0
            before = None if first else self.partial.pop(seq_id, None)
            if before is None:
                vector = vectors[i]
            else:
                vector = before + vectors[i] if self.pooling_type == "MEAN" else before
            if it.sample:
                end = it.num_computed_tokens + it.num_new_tokens
                done.append(vector / end if self.pooling_type == "MEAN" else vector)
            else:
                self.partial[seq_id] = vector
        return torch.stack(done) if done else vectors[:0]

    def finish(self, pooled: torch.Tensor, params: list[PoolingParams]) -> list[torch.Tensor]:
        """The task's last touches on `pooled` [S, dim] float32, one PoolingParams per row;
        returns one tensor per row (still on the device)."""
        if self.config["task"] == "classify":
            act = torch.sigmoid if pooled.shape[-1] == 1 else (lambda x: x.softmax(-1))
            on = [p.use_activation is not False for p in params]
            if all(on):
                return list(act(pooled))
            return [act(row) if a else row for row, a in zip(pooled, on)]
        default = bool(self.config.get("normalize", True))
        wants = [(p.dimensions, default if p.normalize is None else p.normalize) for p in params]
        if len(set(wants)) == 1:  # the usual batch: every request alike, one launch or two
            return list(_embedding(pooled, *wants[0]))
        return [_embedding(row.unsqueeze(0), *w)[0] for row, w in zip(pooled, wants)]

    def check(self, params: PoolingParams, hidden_size: int) -> None:
        """Refuse at admission what `finish` could not do for this model."""
        kind = self.config["task"]
        if params.task == "embed" and kind == "classify":
            raise ValueError("this model is a classifier / reranker: it gives scores, not "
                             "embeddings; use classify, score or rerank")
        if params.task in ("classify", "score") and kind == "embed":
            raise ValueError("this model is an embedding model with no classifier head: use "
                             "embed (score compares embeddings by cosine similarity)")
        if params.dimensions is not None:
            if kind != "embed":
                raise ValueError("dimensions applies to embeddings only")
            if params.dimensions > hidden_size:
                raise ValueError(f"dimensions must be <= the model's embedding size "
                                 f"{hidden_size}, got {params.dimensions}")


def _embedding(x: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    if dimensions is not None:
        x = x[:, :dimensions]
    return F.normalize(x, p=2, dim=-1) if normalize else x
