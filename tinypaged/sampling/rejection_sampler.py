"""The rejection sampler of speculative decoding: verify proposed tokens against the target.

A verified sequence i proposed n_i tokens; the target's logits come as n_i + 1 consecutive rows
(row_start[i] ..): row j scores the token after draft x_0..x_{j-1}. Every row goes through the
sampler's pipeline (sampler.py, steps 0-5: bitmask, logit bias, min_tokens, penalties with the
row's own history, temperature, min-p, top-k, top-p) to the target distribution p_j, exactly as
the row would be sampled without speculation. Then (kernels/rejection.py walks the result):

- greedy rows accept the longest prefix of drafts equal to argmax p_j and add the argmax at the
  first mismatch (or the bonus argmax after all n): token for token what greedy decoding makes;
- random rows accept x_j with probability min(1, p_j(x_j) / q_j(x_j)) and, at the first
  rejection, draw from the residual norm(max(p_j - q_j, 0)); after n acceptances the bonus comes
  from p_n. For any q this emits tokens distributed exactly as sampling p one token at a time
  (q = onehot(x_j) for proposers without probabilities, e.g. n-gram: the residual is p_j with
  x_j removed).

Draws use the exponential race of sampler.py (argmax(w / e), e ~ Exp(1), picks t with
probability w_t / sum w, no normalisation needed). A seeded request draws its uniforms and races
from its own generator, so its tokens depend on its seed and logits alone.
"""

from __future__ import annotations

import itertools

import torch

from tinypaged.kernels.rejection import rejection_sample
from tinypaged.sampling.sampler import SamplingBatch, processed_probs


class RejectionSampler:
    """`sampler(logits, batch, drafts, generators)` -> (emitted [N, K + 1] int64, -1 padded;
    raw logprobs [R, V] or None). `batch` describes the R = sum(len(d) + 1) rows; `generators[i]`
    is sequence i's own generator (seeded requests) or None (the shared one)."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    @staticmethod
    def _to_device(values: list, device: torch.device) -> torch.Tensor:
        host = torch.tensor(values, dtype=torch.int64, pin_memory=device.type == "cuda")
        return host.to(device, non_blocking=True)

    def _shared(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    @torch.inference_mode()
    def __call__(
        self, logits: torch.Tensor, batch: SamplingBatch, drafts: list[list[int]],
        generators: list[torch.Generator | None], draft_probs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        device = logits.device
        n = len(drafts)
        k = max(map(len, drafts), default=0)
        # One host->device copy: drafts [N, K] (0-padded) | num_draft [N] | row_start [N]
        # (| greedy [N], all 1, when every row is greedy: no kernels fill it after the forward).
        packed, counts, starts, num_rows = [], [], [], 0
        for d in drafts:
            packed += d
            packed += [0] * (k - len(d))
            counts.append(len(d))
            starts.append(num_rows)
            num_rows += len(d) + 1
        if logits.shape[0] != num_rows or batch.num_rows != num_rows:
            raise ValueError(
                f"{n} sequences with {num_rows - n} drafts need {num_rows} rows; got "
                f"{logits.shape[0]} logits rows and a batch of {batch.num_rows}"
            )
        all_greedy = batch.all_greedy
        on_device = self._to_device(packed + counts + starts + [1] * (n if all_greedy else 0),
                                    device)
        draft = on_device[: n * k].view(n, k)
        num_draft, row_start = on_device[n * k : n * k + n], on_device[n * k + n : n * k + 2 * n]

        argmax, probs, raw = processed_probs(logits, batch)
        if probs is None:  # every row greedy: no uniforms are read (an empty placeholder)
            greedy = on_device[n * k + 2 * n :]
            uniform = torch.empty(0, dtype=torch.float32, device=device)
            out = rejection_sample(draft, num_draft, row_start, greedy, None, None, uniform,
                                   argmax)
            return out, raw
        # One uniform per row and one exponential per (row, token): shared draws, then the
        # seeded sequences' rows redrawn from their own generators.
        uniform = torch.empty(num_rows, dtype=torch.float32, device=device)
        race = torch.empty_like(probs)
        shared = self._shared(device)
        uniform.uniform_(generator=shared)
        race.exponential_(generator=shared)
        for s, c, g in zip(starts, counts, generators):
            if g is not None:
                uniform[s : s + c + 1].uniform_(generator=g)
                race[s : s + c + 1].exponential_(generator=g)
        residual = probs.clone()
        if k:
            # The drafts' rows and tokens, chosen on the host (a boolean index on the device
            # would wait for it): [2, sum(num_draft)]
            rows, ids = self._to_device(
                [[s + j for s, c in zip(starts, counts) for j in range(c)],
                 list(itertools.chain.from_iterable(drafts))], device)
            if draft_probs is None:  # q = onehot(x): p without x
                residual[rows, ids] = 0.0
            else:
                residual[rows] = (residual[rows] - draft_probs[rows]).clamp_(min=0.0)
        recovered = residual.div_(race.clamp_(min=1e-30)).argmax(dim=-1)
        greedy_rows = batch.greedy if batch.greedy is not None else None
        if greedy_rows is not None:
            recovered = torch.where(greedy_rows, argmax, recovered)
            greedy = greedy_rows[row_start]
        else:
            greedy = torch.zeros(len(drafts), dtype=torch.bool, device=device)
        out = rejection_sample(draft, num_draft, row_start, greedy, probs, draft_probs, uniform,
                               recovered)
        return out, raw
