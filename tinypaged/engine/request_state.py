"""The engine's state of one request: its samples, detokenizers, generators, logprobs, stats
and logits constraints, and the output built from them; and the two tests that decide how its
steps overlap under async scheduling (engine.py's docstring)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tinypaged.engine.stats import RequestStateStats
from tinypaged.outputs import CompletionOutput, RequestOutput
from tinypaged.sampling.logits_processors import LogitsConstraints
from tinypaged.sampling.params import SamplingParams
from tinypaged.scheduler import Sequence


@dataclass
class RequestState:
    """One request as the engine tracks it: its n samples (`seqs`) and, per sample, the
    detokenizer, seeded generator, logprobs so far and stop reason."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list[Any]  # one IncrementalDetokenizer per sample (None without a tokenizer)
    generators: list[torch.Generator | None]
    logprobs: list[list[dict[int, float]] | None]
    cumulative_logprob: list[float]
    stop_reasons: list[int | str | None] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # grows during the prefill
    prompt_logprob_ranks: list[int | None] = field(default_factory=lambda: [None])  # beside it
    stats: RequestStateStats = field(default_factory=RequestStateStats)
    constraints: LogitsConstraints | None = None

    @property
    def finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:  # the common case, once per step: no generator
            return seqs[0].finish_reason is not None
        return all(s.finish_reason is not None for s in seqs)

    def take_token(self, seq: Sequence, logprobs: dict[int, float] | None,
                   eos_token_ids: frozenset[int]) -> tuple[str | None, int | str | None]:
        """The first stop checks of `seq`'s new token, in engine.py's order: a stop token (eos
        unless ignore_eos, then stop_token_ids), then a stop string in its text, which grows
        here (its logprobs too). Returns (finish reason, stop reason), (None, None) when none
        holds; the engine's `_end_checks` take it from there."""
        token, params, index = seq.last_token_id, self.params, seq.index
        if logprobs is not None and self.logprobs[index] is not None:
            self.logprobs[index].append(logprobs)
            self.cumulative_logprob[index] += logprobs[token]
        reason: str | None = None
        stop_reason: int | str | None = None
        min_done = seq.num_output_tokens >= params.min_tokens
        if min_done and not params.ignore_eos and token in eos_token_ids:
            reason = "stop"
        elif min_done and params.stop_token_ids and token in params.stop_token_ids:
            reason, stop_reason = "stop", token
        detok = self.detoks[index]
        if detok is not None:
            # The stop token itself is not part of the text (vLLM drops eos / stop ids).
            stop_str = detok.update(token, skip=reason is not None, check_stop=min_done)
            if reason is None and stop_str is not None:
                reason, stop_reason = "stop", stop_str
        return reason, stop_reason

    def output(self) -> RequestOutput:
        outputs = [
            CompletionOutput(
                index=i,
                text=d.get_next_output_text(s.finish_reason is not None, delta=False)
                if d is not None
                else "",
                token_ids=list(s.output_token_ids),
                cumulative_logprob=(
                    self.cumulative_logprob[i] if self.logprobs[i] is not None else None
                ),
                # Copies, never the live lists: the engine thread keeps appending to them
                # while the API side formats this output.
                logprobs=None if self.logprobs[i] is None else list(self.logprobs[i]),
                finish_reason=s.finish_reason,
                stop_reason=self.stop_reasons[i],
            )
            for i, (s, d) in enumerate(zip(self.seqs, self.detoks))
        ]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            num_cached_tokens=self.seqs[0].num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs,
            prompt_logprob_ranks=None if self.prompt_logprobs is None
            else self.prompt_logprob_ranks,
            metrics=self.stats,
        )


def reads_tokens_on_host(params: SamplingParams) -> bool:
    """Whether a request's step must be processed before its next step is scheduled: its
    logprobs are read on the host."""
    return params.logprobs is not None or params.prompt_logprobs is not None


def samples_from_host_state(params: SamplingParams, constraints: LogitsConstraints | None) -> bool:
    """Whether a request's sampling reads what the host learns from its previous token (grammar
    state, output history): with async scheduling its steps sample late (see above)."""
    return constraints is not None or params.uses_penalties or params.min_tokens > 0
