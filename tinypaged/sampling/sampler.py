"""The batched sampler (SamplingParams, the per-request settings, are in params.py).

One engine step hands the sampler `logits [N, V]` (one row per sequence that samples this step,
in the model's dtype or float32; everything past a plain argmax runs on a float32 copy)
and a `SamplingBatch` describing each row. Per row, in vLLM's order:

0. the token bitmask of structured output, allowed_token_ids and bad_words (logits_processors.py):
   tokens not allowed get -inf, so they have no probability and no logprob;
1. logprobs (when asked) = log_softmax(logits), before anything below touches them;
2. logit_bias is added; min_tokens: while fewer than min_tokens tokens are out, eos and
   stop_token_ids get -inf;
3. penalties, with c(t) = count of t in the output so far and `seen` = in prompt or output:
   l = l / r if l > 0 else l * r        for seen tokens            (repetition_penalty r)
   l = l - f * c(t) - p * [c(t) > 0]                               (frequency f, presence p)
4. greedy rows (temperature 0) take argmax(l) here and skip the rest;
5. l = l / temperature; min_p drops tokens with prob < min_p * max prob; top_k keeps the k
   largest; top_p keeps the smallest set of most likely tokens whose mass reaches top_p;
6. sample from softmax(l) with the exponential trick: argmax(prob / q), q ~ Exp(1), which is an
   exact draw from prob. A seeded row draws q from its own torch.Generator, so its tokens depend
   only on its seed and its logits, never on the other rows of the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tinypaged.kernels.logits import apply_logit_bias_, apply_token_bitmask_
from tinypaged.sampling.params import SamplingParams

if TYPE_CHECKING:
    from tinypaged.sampling.logits_processors import LogitsMasks


def new_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The per-sequence generator of a seeded request (keep it for the sequence's lifetime)."""
    return torch.Generator(device=device).manual_seed(seed % 2**64)


def _pad(rows: list, pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    out = torch.full((len(rows), width), pad, dtype=torch.int64)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = torch.as_tensor(r, dtype=torch.int64)
    return out.to(device, non_blocking=True)


@dataclass
class SamplingBatch:
    """Device-side description of the N rows sampled in one step (build with `build`)."""

    num_rows: int
    all_greedy: bool
    greedy: torch.Tensor | None = None  # [N] bool, only for mixed greedy/random batches
    temperature: torch.Tensor | None = None  # [N, 1] (1.0 on greedy rows)
    min_p: torch.Tensor | None = None  # [N, 1], None when no row uses it
    top_k: torch.Tensor | None = None  # [N] int64, 0 = off; None when no row uses it
    max_top_k: int = 0
    top_p: torch.Tensor | None = None  # [N, 1], None when no row uses it
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> generator
    # Penalties, only on the rows that use them:
    penalty_rows: torch.Tensor | None = None  # [P] int64
    penalties: torch.Tensor | None = None  # [P, 3]: repetition, frequency, presence
    prompt_ids: torch.Tensor | None = None  # [P, Lp] int64, padded with -1
    output_ids: torch.Tensor | None = None  # [P, Lo] int64, padded with -1
    # min_tokens: (row, token) pairs to set to -inf
    banned_rows: torch.Tensor | None = None  # [M] int64
    banned_ids: torch.Tensor | None = None  # [M] int64
    num_logprobs: list[int | None] = field(default_factory=list)
    max_num_logprobs: int = -1  # -1 = no row asked
    logprob_token_ids: dict[int, list[int]] = field(default_factory=dict)  # row -> ids (vLLM)
    # Token bitmask and logit bias of the constrained rows (set by the engine), or None.
    logits_masks: LogitsMasks | None = None

    @property
    def argmax_only(self) -> bool:
        """True when one argmax over the raw logits is the whole job."""
        return (
            self.all_greedy
            and self.penalty_rows is None
            and self.banned_rows is None
            and self.max_num_logprobs < 0
            and (self.logits_masks is None or self.logits_masks.bias_rows is None)
        )

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        eos_token_ids: set[int] | frozenset[int],
        device: torch.device | str,
    ) -> SamplingBatch:
        """Row i samples for a sequence with `params[i]`, whose prompt and output so far are
        `prompt_token_ids[i]` and `output_token_ids[i]`; `generators[i]` is its own generator
        when `params[i].seed` is set (see `new_generator`), else None. Token lists are read only
        for rows with penalties or still under min_tokens, so per-step work stays O(N)."""
        device = torch.device(device)
        n = len(params)
        first = params[0] if params else None
        if first is not None and all(  # each distinct SamplingParams object checked once
            p.is_greedy and not p.uses_penalties and p.logprobs is None and p.min_tokens == 0
            for p in {id(p): p for p in params}.values()
        ):  # every row plainly greedy (offline batches): nothing per row to build
            return cls(num_rows=n, all_greedy=True, num_logprobs=[None] * n)
        greedy = [p.is_greedy for p in params]
        batch = cls(num_rows=n, all_greedy=all(greedy))
        batch.num_logprobs = [p.logprobs for p in params]
        batch.max_num_logprobs = max((k for k in batch.num_logprobs if k is not None), default=-1)
        batch.logprob_token_ids = {
            i: p.logprob_token_ids for i, p in enumerate(params) if p.logprob_token_ids
        }
        batch.generators = {
            i: g for i, g in enumerate(generators) if g is not None and not greedy[i]
        }

        if not batch.all_greedy:
            # One host->device copy carries every per-row scalar.
            values = [
                (1.0 if p.is_greedy else p.temperature, p.min_p, float(p.top_k), p.top_p)
                for p in params
            ]
            packed = torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)
            batch.temperature = packed[:, 0:1]
            if any(greedy):
                batch.greedy = torch.tensor(greedy).to(device, non_blocking=True)
            if any(p.min_p > 0.0 for p in params):
                batch.min_p = packed[:, 1:2]
            if any(p.top_k > 0 for p in params):
                batch.top_k = packed[:, 2].long()
                batch.max_top_k = max(p.top_k for p in params)
            if any(p.top_p < 1.0 for p in params):
                batch.top_p = packed[:, 3:4]

        rows = [i for i, p in enumerate(params) if p.uses_penalties]
        if rows:
            batch.penalty_rows = torch.tensor(rows).to(device, non_blocking=True)
            chosen = [params[i] for i in rows]
            values = [
                (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) for p in chosen
            ]
            batch.penalties = torch.tensor(values, dtype=torch.float32).to(
                device, non_blocking=True
            )
            batch.prompt_ids = _pad([prompt_token_ids[i] for i in rows], -1, device)
            batch.output_ids = _pad([output_token_ids[i] for i in rows], -1, device)

        banned: list[tuple[int, int]] = []
        for i, p in enumerate(params):
            if len(output_token_ids[i]) < p.min_tokens:
                banned += [(i, t) for t in set(eos_token_ids) | set(p.stop_token_ids)]
        if banned:
            pairs = torch.tensor(banned, dtype=torch.int64).to(device, non_blocking=True)
            batch.banned_rows, batch.banned_ids = pairs[:, 0], pairs[:, 1]
        return batch


def processed_probs(
    logits: torch.Tensor, batch: SamplingBatch
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The sampling pipeline of `logits` [N, V] (the grammar bitmask is applied in place) up to
    the distribution each row draws from: (argmax [N] after bias, bad words and penalties: what
    a greedy row takes; probs [N, V] float32 after temperature, min-p, top-k and top-p, or None
    when every row is greedy; raw logprobs [N, V] before any of these, or None when no row asks).
    The sampler draws from it, and the rejection sampler verifies drafts against it."""
    masks = batch.logits_masks
    if masks is not None and masks.bitmask is not None:
        apply_token_bitmask_(logits, masks.bitmask, masks.bitmask_rows)
    raw = torch.log_softmax(logits.float(), dim=-1) if batch.max_num_logprobs >= 0 else None
    if batch.argmax_only:  # argmax needs no float32 copy (exact)
        return logits.argmax(dim=-1), None, raw
    logits = logits.float()
    if masks is not None and masks.bias_rows is not None:
        apply_logit_bias_(logits, masks.bias_rows, masks.bias_ids, masks.bias_values)
    if batch.banned_rows is not None:
        logits[batch.banned_rows, batch.banned_ids] = -math.inf
    if batch.penalty_rows is not None:
        logits[batch.penalty_rows] = apply_penalties(
            logits[batch.penalty_rows], batch.prompt_ids, batch.output_ids, batch.penalties
        )
    argmax = logits.argmax(dim=-1)
    if batch.all_greedy:
        return argmax, None, raw
    logits.div_(batch.temperature)
    if batch.min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        logits.masked_fill_(probs < batch.min_p * probs.amax(dim=-1, keepdim=True), -math.inf)
    if batch.top_k is not None or batch.top_p is not None:
        logits = apply_top_k_top_p(logits, batch.top_k, batch.max_top_k, batch.top_p)
    return argmax, torch.softmax(logits, dim=-1), raw


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # [N] int64 on the logits' device: the sampled token of each row
    # Per row: {token_id: logprob} for the sampled token and the top `logprobs` tokens, or None
    # when that row did not ask for logprobs.
    logprobs: list[dict[int, float] | None]

    @property
    def token_ids(self) -> list[int]:
        """The sampled tokens on the host (waits for the device)."""
        return self.sampled.tolist()


class Sampler:
    """Turns one step's logits into tokens. Call once per step: `sampler(logits, batch)`.

    `seed` seeds the engine generator shared by unseeded rows. The logits tensor may be changed
    in place (it is the model's fresh output, used once). The sampled ids stay on the device
    (no sync) unless a row asks for logprobs.
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _engine_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = new_generator(self.seed, device)
        return self._generators[device]

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        # logits: [N, V], the model's dtype or float32; argmax needs no float32 copy (exact)
        if logits.shape[0] != batch.num_rows:
            raise ValueError(
                f"logits has {logits.shape[0]} rows but the SamplingBatch describes "
                f"{batch.num_rows}; build one batch row per sampled sequence"
            )
        argmax, probs, raw_logprobs = processed_probs(logits, batch)
        if probs is None:  # every row greedy
            sampled = argmax
        else:
            sampled = self._draw(probs, batch.generators)
            if batch.greedy is not None:
                sampled = torch.where(batch.greedy, argmax, sampled)

        logprobs: list[dict[int, float] | None] = [None] * batch.num_rows
        if raw_logprobs is not None:  # built on the host: waits for the device
            token_ids = sampled.tolist()
            top_vals, top_ids = raw_logprobs.topk(max(batch.max_num_logprobs, 1), dim=-1)
            chosen = raw_logprobs.gather(1, sampled.view(-1, 1)).squeeze(1).tolist()
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
            for i, k in enumerate(batch.num_logprobs):
                if k is None:
                    continue
                row = {token_ids[i]: chosen[i]}  # the sampled token first, as vLLM does
                wanted = batch.logprob_token_ids.get(i)
                if wanted is None:
                    row.update(zip(top_ids[i][:k], top_vals[i][:k]))
                else:  # the asked ids instead of the top ones
                    row.update(zip(wanted, raw_logprobs[i, wanted].tolist()))
                logprobs[i] = row
        return SamplerOutput(sampled, logprobs)

    def _draw(self, probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
        # probs: [N, V]. argmax(probs / q) with q ~ Exp(1) picks token t with probability
        # probs[t] (the exponential race), with no cumulative sums and no sync.
        q = torch.empty_like(probs)
        q.exponential_(generator=self._engine_generator(probs.device))
        for row, generator in generators.items():
            q[row].exponential_(generator=generator)
        # q can round to 0; that would make 0/0 = nan, which argmax would pick.
        return probs.div_(q.clamp_(min=1e-30)).argmax(dim=-1)


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: torch.Tensor,
    output_ids: torch.Tensor,
    penalties: torch.Tensor,
) -> torch.Tensor:
    """Repetition / frequency / presence penalties (vLLM semantics, see module docstring).

    logits [P, V]; prompt_ids [P, Lp], output_ids [P, Lo] padded with -1;
    penalties [P, 3] = (repetition, frequency, presence). Returns the new logits [P, V].
    """
    num_rows, vocab = logits.shape

    def counts(ids: torch.Tensor) -> torch.Tensor:
        # Padding (and any id beyond the logits) lands in an extra column that is dropped.
        ids = torch.where(ids < 0, vocab, ids).clamp_(max=vocab)
        bins = torch.zeros(num_rows, vocab + 1, dtype=logits.dtype, device=logits.device)
        return bins.scatter_add_(1, ids, torch.ones_like(ids, dtype=logits.dtype))[:, :vocab]

    output_counts = counts(output_ids)  # [P, V]
    seen = (counts(prompt_ids) > 0) | (output_counts > 0)
    repetition, frequency, presence = penalties.unbind(dim=1)
    r = torch.where(seen, repetition.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / r, logits * r)
    logits = logits - frequency.unsqueeze(1) * output_counts
    return logits - presence.unsqueeze(1) * (output_counts > 0).to(logits.dtype)


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    max_top_k: int,
    top_p: torch.Tensor | None,
) -> torch.Tensor:
    """Mask to -inf every token outside the row's top-k, then outside its top-p nucleus.

    logits [N, V]; top_k [N] int64 (0 = off) or None; top_p [N, 1] (1 = off) or None.
    """
    vocab = logits.shape[1]
    if top_p is None:
        # Top-k alone needs only the max_top_k largest values, not a full sort.
        k = top_k.clamp(min=1, max=min(max_top_k, vocab))
        largest = logits.topk(min(max_top_k, vocab), dim=-1).values  # [N, max_k]
        kth = largest.gather(1, (k - 1).unsqueeze(1))  # [N, 1]
        kth = torch.where(top_k.unsqueeze(1) > 0, kth, -math.inf)
        return logits.masked_fill_(logits < kth, -math.inf)

    ascending, order = logits.sort(dim=-1)  # [N, V], largest last
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
        kth = ascending.gather(1, (vocab - k).unsqueeze(1))
        ascending.masked_fill_(ascending < kth, -math.inf)
    # A token is dropped when all the mass up to and including it, from the least likely
    # end, is <= 1 - top_p: what remains is the smallest head with mass >= top_p.
    mass_below = torch.softmax(ascending, dim=-1).cumsum(dim=-1)
    drop = mass_below <= 1.0 - top_p
    drop[:, -1] = False  # always keep the most likely token
    ascending.masked_fill_(drop, -math.inf)
    return logits.scatter_(1, order, ascending)
