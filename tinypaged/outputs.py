"""What generate() returns, with vLLM's names: RequestOutput holding n CompletionOutputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from tinypaged.engine.stats import RequestStateStats


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str  # cumulative decoded text (stop string excluded)
    token_ids: list[int]  # cumulative generated token ids
    cumulative_logprob: float | None = None
    # Per generated token: {token_id: logprob} for the sampled token and the top-k (when asked).
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # None while running, then "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # With SamplingParams.prompt_logprobs: per prompt token {token_id: logprob} for that token
    # and the top-k; None for the first token, which nothing predicts (vLLM's layout).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # ... and each prompt token's rank in its distribution (1 = most likely; vLLM's
    # Logprob.rank), None for the first
    prompt_logprob_ranks: list[int | None] | None = None
    metrics: RequestStateStats | None = None  # when it arrived, was scheduled, got tokens
