"""SpecDecoder: the engine's seam to speculative decoding (one per Engine with a
`speculative_config`).

Each step, around the engine's own:

    propose()          before schedule(): every running sequence about to decode gets up to k
                       proposed tokens in seq.spec_token_ids; the scheduler schedules them as
                       k more new tokens of that sequence (k + 1 in all) when budget and blocks
                       allow, fewer otherwise
    launch(items)      runs the target on the step, with the logits of every position of the
                       speculating sequences (the runner's per-row logits, as for prompt
                       logprobs), and verifies: rejection_sampler.py -> accepted drafts + one
    after_tokens(...)  the scheduler has appended a sequence's tokens and rolled back the slots
                       of the rejected drafts (Scheduler.update); the engine's stop checks then
                       run token by token, and a stop drops the tokens after it

Sequences that do not speculate this step (prefills, a sequence one token from its limit) take
the same path with no drafts: their one row is sampled by the same pipeline, so a batch mixes
any k. Requests with logits constraints (structured output, allowed_token_ids, bad_words,
logit_bias) speculate too: their drafts are cut where the grammar rejects one, and each
verified row gets the mask of its own position (grammar.py).

A verification replays one CUDA graph only when every sequence verifies exactly k drafts
(worker/cuda_graphs.py, q = k + 1); any other step runs the piecewise graphs and launches the
attention of every layer outside them. So on a GPU with graphs, when every running sequence is
a decode that may speculate k tokens, shorter drafts of the host proposers (an n-gram lookup
with no match, or one near the end of the text) are padded to k by repeating their last token
(`_pad`). No output changes: the rejection rule holds for any draft token (greedy keeps the
target's argmax; sampling accepts a point-mass draft x with probability p(x), else draws from
the residual), so a filler is one more row verified and nearly always rejected. The
spec-decode counters count the proposer's own drafts only.

Async scheduling. `launch` queues the verification and starts the copy of its emitted tokens
[S, K + 1] to the host, without waiting. A launched step's tokens are taken in two halves:

    apply(step)        wait for the emitted tokens (the one wait of a step), the proposer's
                       observe, the scheduler's update (tokens appended, rejected slots rolled
                       back); called by propose() of the next step, which needs them. The
                       GPU idles from the tokens' arrival to the next launch: nothing else
                       belongs here
    taken(step),       the acceptance counts, then the engine's stop checks, detokenization
    after_tokens(...)  and outputs, run while the next step's forward runs on the device

so each engine step reads: apply N -> propose N+1 -> schedule -> launch N+1 -> stop checks of
N. A sequence that N's stop checks end (eos, stop string, abort) has one wasted verification in
N+1, whose tokens are dropped, as in the engine without speculation; one that reached its
max_tokens is not scheduled again (Scheduler.schedule). A step holding a request whose next
proposal or masks read what the stop checks leave (a grammar's matcher) is taken whole at once,
as synchronously. Penalties, min_tokens and logprobs need only the tokens, which apply gives.

Overlapped verification (n-gram and the oracles, which propose from tokens alone, without
pipeline stages; `TINYPAGED_SPEC_OVERLAP=0` turns it off). Even so the GPU would idle from N's
tokens' arrival to N+1's launch, while the host applies, proposes, schedules and builds.
Overlapped, step N+1 is launched before N's tokens are known, and apply N runs while N+1
computes:

    propose N+1 -> schedule -> launch N+1 -> apply N -> stop checks of N

- **Schedule as if N accepted every draft** (`_assume`): a sequence verifying n drafts in N
  counts n + 1 placeholders, so N+1's rows sit at the furthest positions N can leave them and
  their blocks are allocated; its first row is a placeholder for N's last emitted token.
- **Move on the device** (kernels/spec_shift.py): once N's walk has run, each such sequence's
  rows move back by the tokens N did not emit, their slots follow, and the placeholder gets N's
  last token. The rejected drafts' KV rows are at positions the moved rows write again. Apply N
  then rolls back the host's count the same way (Scheduler.update).
- **Propose from a guess**: N+1's drafts continue `token_ids + tail`, the tail being the drafts
  N is assumed to accept; the proposer is asked one token more, whose first is the guess of N's
  last token, so the drafts follow the guess. Any draft is verified by the same rule, so a wrong
  guess costs acceptance, never output. A guess that proved wrong (`_on_track`) also made N+1's
  drafts wrong: the next proposal then assumes N+1 accepts none of them.

Requests whose sampling reads host state (penalties, min_tokens, grammars) turn it off for the
steps they run in. Where it runs, other drafts are proposed than synchronously, so the
spec-decode counters differ from the synchronous engine's; the outputs do not.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import torch

from tinypaged import envs
from tinypaged.sampling.rejection_sampler import RejectionSampler
from tinypaged.sampling.sampler import SamplingBatch
from tinypaged.scheduler import ScheduledSequence, Sequence
from tinypaged.spec_decode.config import HEADS, SpeculativeConfig
from tinypaged.spec_decode.grammar import DraftGrammar, DraftMaskBuilder, cut_draft
from tinypaged.spec_decode.proposers import NgramProposer, OracleProposer, Proposer
from tinypaged.worker.model_runner import SPEC_GRAPH_MAX_SEQS, no_graphs_reason

logger = logging.getLogger(__name__)


def build_proposer(config: SpeculativeConfig, engine: Any) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "draft_model":
        from tinypaged.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(config.model, engine)
    if config.method in HEADS:  # EAGLE-3, EAGLE, MTP: fed the target's hidden states
        from tinypaged.spec_decode.head_proposer import HeadProposer

        return HeadProposer(config, engine)
    return OracleProposer(config.oracle_token_ids, engine.vocab_size,
                          config.method == "oracle_miss")


class SpecDecodeStats:
    """vLLM's spec-decode counters, cumulative since the engine started."""

    def __init__(self, k: int) -> None:
        self.num_drafts = 0  # verified sequence-steps with at least one draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * k

    def observe(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.num_accepted_tokens_per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
        }


class _Verified:
    """A launched verification: its emitted tokens [S, K + 1] on their way to the host, and
    what `apply` needs to take them; `tokens`, `logprobs` and `grown` are what apply made."""

    def __init__(self, items, seqs, reqs, drafts, starts, raw, emitted, event,
                 proposed=None) -> None:
        self.items, self.seqs, self.reqs, self.drafts = items, seqs, reqs, drafts
        # the proposer's draft length of each sequence (drafts[i] may hold fillers after it)
        self.proposed = [len(d) for d in drafts] if proposed is None else proposed
        self.starts, self.raw = starts, raw  # raw logprobs [R, V] (device) or None
        self.emitted, self.event = emitted, event  # host [S, K + 1] int64 (-1 padded)
        self.tokens: dict[int, list[int]] = {}  # seq_id -> accepted drafts + the target's token
        self.logprobs: dict[int, list] = {}  # seq_id -> a logprobs entry per token (if asked)
        self.grown: list[Sequence] | None = None  # None until applied

    def tolist(self) -> list[list[int]]:
        """Wait for the emitted tokens: one list per sampled sequence, the padding dropped."""
        if self.event is not None:
            self.event.synchronize()
        return [[t for t in row if t >= 0] for row in self.emitted.tolist()]


class SpecDecoder:
    def __init__(self, engine: Any, raw_config: dict) -> None:
        self.engine = engine
        self.config = SpeculativeConfig.from_dict(raw_config)
        self.k = self.config.num_speculative_tokens
        self.proposer = build_proposer(self.config, engine)
        self.sampler = RejectionSampler(engine.config.seed)
        self.stats = SpecDecodeStats(self.k)
        self.mask_builder = DraftMaskBuilder(engine.vocab_size, engine.device)
        # Two landing buffers for the emitted tokens (pinned on a GPU): step N's are read while
        # N+1's copy. The CPU copies into them too, so that path runs in the tests.
        self._pin = engine.device.type == "cuda"
        self._landing = [torch.empty(engine.config.max_num_seqs * (self.k + 1), dtype=torch.int64,
                                     pin_memory=self._pin) for _ in range(2)]
        self.num_launched = 0
        # Pad short drafts to k where a step of k-token drafts replays one CUDA graph.
        graphs = engine.device.type == "cuda" and no_graphs_reason(engine.config) is None
        self.pad_drafts = self.proposer.paddable and graphs and envs.TINYPAGED_SPEC_PAD_DRAFTS
        self._proposed: dict[int, int] = {}  # seq_id -> its draft's length before padding
        # Overlapped verification (module docstring): whether it is on, the tokens assumed for
        # each sequence's verification in flight (None: its next step has no drafts to be
        # wrong), and whether that verification's drafts followed the right tokens.
        config = engine.config
        self.overlap = bool(envs.TINYPAGED_SPEC_OVERLAP and self.proposer.overlaps
                            and config.async_scheduling and config.pipeline_parallel_size == 1)
        if self.overlap:
            engine.runner.start_overlap(self.k)
        self._assumed: dict[int, list[int] | None] = {}
        self._on_track: dict[int, bool] = {}
        self.num_overlapped = 0  # steps proposed before the tokens of the one in flight
        logger.info("speculative decoding: %s, k=%d", self.config.method, self.k)

    def check_request(self, params: Any) -> None:
        if params.prompt_logprobs is not None:
            raise ValueError(
                "prompt_logprobs cannot be combined with speculative decoding in tinypaged yet; "
                "start the engine without speculative_config to get them"
            )

    # ------------------------------------------------------------------ propose
    def propose(self, prev: Any = None) -> None:
        """Propose for the step about to be scheduled, once `prev` (the launched step not yet
        taken, if any) has given its tokens."""
        eng = self.engine
        in_flight: dict[int, tuple[ScheduledSequence, int]] = {}
        if prev is not None:
            if self.overlap and not eng._late_requests:
                in_flight = self._assume(prev)
            else:
                self.apply(prev)
        seqs, ks = [], []
        for seq in eng.scheduler.running.values():
            seq.spec_token_ids = []
            if seq.num_uncomputed_tokens != 1 or (seq.num_output_placeholders
                                                  and seq.seq_id not in in_flight):
                continue  # a prefill (or a recompute after preemption)
            if seq.request_id not in eng.requests:
                continue
            k = min(self.k, seq.max_length - len(seq) - seq.num_output_placeholders - 1)
            if k > 0:
                seqs.append(seq)
                ks.append(k)
        self._proposed = {}
        if seqs:
            if in_flight:
                proposals = self._guessed(seqs, ks, in_flight)
            else:
                self._on_track.clear()  # every draft follows known tokens
                proposals = self._proposals(seqs, ks)
            for seq, k, draft in zip(seqs, ks, proposals):
                draft = [int(t) for t in draft[:k]]
                constraints = eng.requests[seq.request_id].constraints
                if constraints is not None:  # nothing after a token the grammar rejects
                    draft = cut_draft(constraints, seq.index, draft)
                seq.spec_token_ids = draft
            if self.pad_drafts:
                self._pad(seqs, ks)

    def _assume(self, prev: Any) -> dict[int, tuple[ScheduledSequence, int]]:
        """Count every draft of the verification in flight as accepted (placeholders, taken back
        by Scheduler.update); seq_id -> (its item, the proposer's draft length)."""
        verified: _Verified = prev.tokens
        if verified.grown is not None:
            return {}
        self.num_overlapped += 1
        sampled = [it for it in verified.items if it.sample]
        in_flight = {}
        for item, n in zip(sampled, verified.proposed):
            if not item.seq.is_finished:
                item.num_assumed = len(item.spec_token_ids)
                item.seq.num_output_placeholders += item.num_assumed
                in_flight[item.seq.seq_id] = item, n
        return in_flight

    def _guessed(self, seqs: list[Sequence], ks: list[int],
                 in_flight: dict[int, tuple[ScheduledSequence, int]]) -> list[list[int]]:
        """Drafts proposed before the verification in flight gave its tokens: a sequence
        behind one continues its token_ids + the drafts it is assumed to accept (none when
        they followed a wrong guess), and the first token proposed is the guess of that
        verification's last token, recorded in `_assumed` with the tail."""
        if len(self._on_track) > 2 * len(seqs):  # aborted sequences are not finished here
            live = {seq.seq_id for seq in seqs}
            self._on_track = {i: v for i, v in self._on_track.items() if i in live}
            self._assumed = {i: v for i, v in self._assumed.items() if i in live}
        tails, asks = [], []
        for seq, k in zip(seqs, ks):
            entry = in_flight.get(seq.seq_id)
            if entry is None:  # nothing in flight: proposed from its own tokens
                self._on_track[seq.seq_id] = True
                tails.append(())
                asks.append(k)
                continue
            item, n = entry
            tails.append(item.spec_token_ids[:n] if self._on_track.get(seq.seq_id, True) else [])
            asks.append(k + 1)
        drafts = []
        for seq, tail, proposal in zip(seqs, tails, self.proposer.propose(seqs, asks, tails)):
            if seq.seq_id not in in_flight:
                drafts.append(proposal)
                continue
            drafts.append(proposal[1:])
            self._assumed[seq.seq_id] = [*tail, *proposal[:1]] if proposal[1:] else None
        return drafts

    def _pad(self, seqs: list[Sequence], ks: list[int]) -> None:
        """Fill every draft up to k (its last token repeated; the sequence's last without a
        draft) when the step can then be one verification graph: every running sequence a
        decode that may take k drafts, no request waiting to be admitted, none constrained
        (their masks follow the grammar along the drafts), a batch the graphs cover, and k + 1
        tokens for each within the step's token budget (fillers never crowd out a sequence)."""
        eng = self.engine
        sched = eng.scheduler
        if (len(seqs) != len(sched.running) or sched.waiting or len(seqs) > SPEC_GRAPH_MAX_SEQS
                or len(seqs) * (self.k + 1) > sched.max_num_batched_tokens
                or any(k != self.k for k in ks)
                or any(eng.requests[s.request_id].constraints is not None for s in seqs)):
            return
        for seq in seqs:
            draft = seq.spec_token_ids
            if len(draft) < self.k:
                self._proposed[seq.seq_id] = len(draft)
                filler = draft[-1] if draft else seq.token_ids[-1]
                seq.spec_token_ids = draft + [filler] * (self.k - len(draft))

    def _proposals(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        if not self.proposer.follows_grammar:
            return self.proposer.propose(seqs, ks)
        requests = self.engine.requests
        entries = [None if c is None else (c, s.index, s.output_token_ids)
                   for s in seqs for c in [requests[s.request_id].constraints]]
        if all(e is None for e in entries):
            return self.proposer.propose(seqs, ks)
        with DraftGrammar(entries, self.engine.vocab_size) as grammar:
            return self.proposer.propose(seqs, ks, grammar)

    # ------------------------------------------------------------------ verify
    def launch(self, items: list[ScheduledSequence]):
        """Queue the verification of a scheduled step: (sampled sequences, their _Verified
        tokens, [] (the logprobs come with apply), whether the step is taken at once)."""
        eng = self.engine
        every = [bool(it.spec_token_ids) for it in items]
        logits = eng.executor.execute(items, every if any(every) else None)
        eng.executor.keep_sampled(None)  # tensor parallelism: every rank's collectives in step
        sampled = [it for it in items if it.sample]
        seqs = [it.seq for it in sampled]
        reqs = [eng.requests[s.request_id] for s in seqs]
        # A grammar's matcher takes the tokens in the stop checks: the next proposal (cut_draft)
        # and masks read it, so a step with one is taken whole before the next is scheduled.
        at_once = any(r.constraints is not None and r.constraints.matchers for r in reqs)
        if not sampled:
            return [], _Verified(items, [], [], [], [], None, torch.empty(0, 1), None), [], False
        drafts = [it.spec_token_ids for it in sampled]
        proposed = [min(len(d), self._proposed.get(s.seq_id, len(d))) for s, d in zip(seqs, drafts)]
        batch, starts, gens = self._batch(seqs, reqs, drafts, logits.device)
        out, raw = self.sampler(logits, batch, drafts, gens)  # [S, K' + 1] on the device
        if self.overlap:  # where the step built before these tokens are known moves to
            eng.executor.keep_verified(out)
        # Start the copy to the host; apply waits for it. A contiguous view: a strided host
        # destination would make the copy wait at once.
        buf = self._landing[self.num_launched % 2]
        self.num_launched += 1
        emitted, event = buf[: out.numel()].view(out.shape), None
        emitted.copy_(out, non_blocking=True)
        if self._pin:
            event = torch.cuda.Event()
            event.record()
        verified = _Verified(items, seqs, reqs, drafts, starts, raw, emitted, event, proposed)
        return seqs, verified, [], at_once

    def apply(self, step: Any) -> None:
        """Take a launched step's tokens (once): the proposer observes them, the scheduler
        appends them and rolls back the rejected drafts' slots. The GPU idles from the tokens'
        arrival to the next launch, so this holds only what the next proposal and schedule
        need; `taken` does the rest after that launch."""
        verified: _Verified = step.tokens
        if verified.grown is not None:
            return
        eng = self.engine
        rows = eng.executor.collect(verified) if verified.seqs else []
        tokens = verified.tokens = {s.seq_id: t for s, t in zip(verified.seqs, rows)}
        if self.overlap:  # did the next step's drafts follow the right tokens?
            for seq, toks in zip(verified.seqs, rows):
                assumed = self._assumed.pop(seq.seq_id, None)
                self._on_track[seq.seq_id] = assumed is None or toks == assumed
        self.proposer.observe(verified.items, tokens)
        if verified.raw is not None:  # now: after the next launch a read waits for its forward
            for seq, req, start, toks in zip(verified.seqs, verified.reqs, verified.starts, rows):
                k = req.params.logprobs
                verified.logprobs[seq.seq_id] = None if k is None else [
                    _logprobs_row(verified.raw[start + j], t, k) for j, t in enumerate(toks)
                ]
        verified.grown = eng.scheduler.update(step.out, tokens)
        verified.items = verified.reqs = verified.raw = None  # nothing held past its step

    def taken(self, step: Any) -> tuple[list[Sequence], dict, dict]:
        """A launched step's tokens for the engine's stop checks, applied first if they were
        not yet: (the grown sequences, seq_id -> tokens, seq_id -> logprobs entries of the
        sequences that asked for them). Call once a step: it counts the acceptance."""
        self.apply(step)
        verified: _Verified = step.tokens
        for seq, n in zip(verified.seqs, verified.proposed):
            if n and not seq.is_finished:  # not a wasted row (async scheduling)
                self.stats.observe(n, min(n, len(verified.tokens[seq.seq_id]) - 1))
        return verified.grown, verified.tokens, verified.logprobs

    def _batch(self, seqs: list[Sequence], reqs: list, drafts: list[list[int]], device):
        eng = self.engine
        params, prompts, outputs, row_gens, starts, gens = [], [], [], [], [], []
        for seq, req, draft in zip(seqs, reqs, drafts):
            starts.append(len(params))
            p, rows = req.params, len(draft) + 1
            gen = req.generators[seq.index]
            gens.append(gen if gen is not None and not p.is_greedy else None)
            params += [p] * rows
            row_gens += [gen] * rows
            if p.uses_penalties or p.min_tokens > 0:  # row j sees output + draft[:j]
                out = seq.output_token_ids
                prompts += [seq.prompt_token_ids] * rows
                outputs += [out + draft[:j] for j in range(rows)]
            else:
                prompts += [()] * rows
                outputs += [()] * rows
        batch = SamplingBatch.build(params, prompts, outputs, row_gens, eng.eos_token_ids, device)
        # Constrained requests: one mask per verified row, the grammar along the drafts.
        constrained = [(start, req.constraints, seq.index, seq.output_token_ids, draft)
                       for start, req, seq, draft in zip(starts, reqs, seqs, drafts)
                       if req.constraints is not None]
        batch.logits_masks = self.mask_builder.build_drafts(constrained) if constrained else None
        return batch, starts, gens

    # ------------------------------------------------------------------ stop checks
    def after_tokens(self, req: Any, seq: Sequence, tokens: list[int],
                     logprobs: list | None) -> None:
        """The engine's per-token stop checks over the `tokens` this step gave `seq`."""
        del seq.token_ids[-len(tokens):]
        c = req.constraints
        matcher = c.matchers[seq.index] if c is not None and c.matchers else None
        for token, lp in zip(tokens, logprobs or itertools.repeat(None)):
            seq.token_ids.append(token)
            rejected = matcher is not None and not matcher.accept_token(token)
            self.engine._after_token(req, seq, lp, rejected)
            if seq.finish_reason is not None:
                self.proposer.finish(seq)
                self._assumed.pop(seq.seq_id, None)
                self._on_track.pop(seq.seq_id, None)
                break  # the tokens after a stop are dropped

    def get_stats(self) -> dict[str, Any]:
        return {**self.stats.as_dict(), "acceptance_rate": self.stats.acceptance_rate}


def _logprobs_row(raw: torch.Tensor, token: int, k: int) -> dict[int, float]:
    """The sampled token's logprob first, then the top k (the Sampler's format)."""
    row = {token: float(raw[token])}
    if k > 0:
        values, ids = raw.topk(k)
        row.update(zip(ids.tolist(), values.tolist()))
    return row
