"""SamplingParams: how to sample one request, with vLLM's field names, defaults and ranges.

This is the one place that checks sampling values, for `LLM` and the server alike: a bad value
raises ValueError whose message starts with the field's name, states the allowed range and the
value seen ("top_p must be > 0 and <= 1, got 0"); the server turns it into a 400 naming the
field. Greedy requests (temperature < 1e-5, as in vLLM) have top_p, top_k and min_p cleared, and
top_k = -1 becomes 0: one spelling of "off" for the sampler. Positive temperatures below 1e-2
are raised to 1e-2 (vLLM). Tighter than vLLM, so that nothing that reaches the batched sampler
can overflow: temperature <= 100, repetition_penalty in [0.01, 100], and every integer fits in
int64. The engine adds the checks against the model (token ids below the vocabulary size) when a
request is admitted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tinypaged.sampling.structured_output import StructuredOutputsParams

_GREEDY_EPS = 1e-5  # vLLM: temperatures below this are greedy
_MIN_TEMP = 1e-2  # vLLM raises smaller positive temperatures to this (1/t would overflow)
_MAX_TEMP = 1e2  # fp32 keeps logits / t meaningful; far beyond any useful temperature
_INT64_MAX = 2**63 - 1  # every int becomes an int64 tensor element somewhere
# logits / r and logits * r stay finite in fp32 (|logit| < ~1e4) for r in this range.
_REPETITION_PENALTY_RANGE = (1e-2, 1e2)


@dataclass(frozen=True)
class _Range:
    """An interval a number must lie in; None leaves that side open-ended."""

    low: float | None = None
    high: float | None = None
    low_excluded: bool = False  # the low end itself is outside (top_p > 0)
    note: str = ""  # what the special values mean

    def allows(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_excluded else value < self.low):
            return False
        return self.high is None or value <= self.high

    def __str__(self) -> str:  # "> 0 and <= 1 (1 means off)"
        bounds = []
        if self.low is not None:
            bounds.append(f"{'>' if self.low_excluded else '>='} {self.low:g}")
        if self.high is not None:
            bounds.append(f"<= {self.high:g}")
        return " and ".join(bounds) + (f" ({self.note})" if self.note else "")


# The range of every number field (None, where a field allows it, is checked apart).
_RANGES = {
    "n": _Range(1),
    "temperature": _Range(0, _MAX_TEMP, note="0 means greedy"),
    "top_p": _Range(0, 1, low_excluded=True, note="1 means off"),
    "top_k": _Range(-1, note="0 or -1 means off"),
    "min_p": _Range(0, 1, note="0 means off"),
    "presence_penalty": _Range(-2, 2),
    "frequency_penalty": _Range(-2, 2),
    "repetition_penalty": _Range(*_REPETITION_PENALTY_RANGE, note="1 means off"),
    "max_tokens": _Range(1),
    "min_tokens": _Range(0),
    "logprobs": _Range(0),
    "prompt_logprobs": _Range(0),
    "truncate_prompt_tokens": _Range(1),
}


def _check_number(name: str, value, kind: type) -> None:
    ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
    if not ok or (isinstance(value, float) and not math.isfinite(value)):
        want = "a finite number" if kind is float else "an integer"
        raise ValueError(f"{name} must be {want}, got {value!r:.100}")
    if kind is int and not -_INT64_MAX - 1 <= value <= _INT64_MAX:
        raise ValueError(f"{name} must fit in a 64-bit integer, got {value!r:.100}")


@dataclass
class SamplingParams:
    """How to sample one request; the same fields, defaults and ranges as vLLM."""

    n: int = 1  # number of completions for the prompt
    temperature: float = 1.0  # in [0, 100]; 0 = greedy
    top_p: float = 1.0  # in (0, 1]; 1 = off
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0  # in [0, 1]; 0 = off
    presence_penalty: float = 0.0  # in [-2, 2]
    frequency_penalty: float = 0.0  # in [-2, 2]
    repetition_penalty: float = 1.0  # in [0.01, 100]; 1 = off
    seed: int | None = None
    stop: str | list[str] | None = None  # stop strings, left out of the text
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None = up to the model's context length
    min_tokens: int = 0
    logprobs: int | None = None  # top logprobs to return besides the sampled token's
    prompt_logprobs: int | None = None  # the same for each prompt token (its prefix uncached)
    # vLLM's: with logprobs, these ids' logprobs in place of the top ones (the sampled one stays)
    logprob_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    # Between special tokens in decoded text; honoured by slow (Python) tokenizers only, as in
    # vLLM: the fast tokenizers tinypaged loads join special tokens as they are.
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (engine side)
    # Logits constraints (logits_processors.py); token ids are checked against the vocabulary
    # when the request is added.
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None  # token id -> bias, clamped to [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    bad_words: list[str] | None = None  # words that may not be generated

    def __post_init__(self) -> None:
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            _check_number(name, getattr(self, name), float)
        for name in ("n", "top_k", "min_tokens"):
            _check_number(name, getattr(self, name), int)
        for name in ("max_tokens", "logprobs", "prompt_logprobs", "seed", "truncate_prompt_tokens"):
            if getattr(self, name) is not None:
                _check_number(name, getattr(self, name), int)
        for name in (
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
        ):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

        def bad(name: str, rule: object) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {getattr(self, name)!r:.200}")

        for name, allowed in _RANGES.items():
            value = getattr(self, name)
            if value is not None and not allowed.allows(value):
                raise bad(name, allowed)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"<= max_tokens ({self.max_tokens})")

        stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise bad("stop", "a non-empty string or a list of non-empty strings")
        self.stop = list(stop)
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple, set)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _INT64_MAX for t in ids
        ):
            raise bad("stop_token_ids", "a list of non-negative token ids")
        self.stop_token_ids = list(ids)

        self._check_logits_constraints()
        if self.top_k == -1:
            self.top_k = 0  # one spelling of "off" downstream
        if _GREEDY_EPS <= self.temperature < _MIN_TEMP:
            self.temperature = _MIN_TEMP
        if self.temperature < _GREEDY_EPS:
            # Greedy ignores the filters; clearing them keeps the sampler's fast path simple.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _check_logits_constraints(self) -> None:
        def is_id(t) -> bool:
            return isinstance(t, int) and not isinstance(t, bool) and t >= 0

        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(
                f"structured_outputs must be a StructuredOutputsParams, got {type(so).__name__}"
            )
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                is_id(t) and isinstance(b, (int, float)) and not isinstance(b, bool)
                and math.isfinite(b)
                for t, b in self.logit_bias.items()
            ):
                raise ValueError(
                    "logit_bias must map token ids (non-negative integers) to finite numbers, "
                    f"got {self.logit_bias!r:.100}"
                )
            # OpenAI's range: -100 bans a token in practice, +100 makes it all but certain.
            self.logit_bias = {t: min(100.0, max(-100.0, float(b))) for t, b in
                               self.logit_bias.items()}
        ids = self.logprob_token_ids
        if ids is not None and (
            not isinstance(ids, (list, tuple)) or not ids or not all(is_id(t) for t in ids)
            or self.logprobs is None
        ):
            raise ValueError(
                "logprob_token_ids must be a non-empty list of token ids, with logprobs set, "
                f"got {ids!r:.100}"
            )
        ids = self.allowed_token_ids
        if ids is not None and (
            not isinstance(ids, (list, tuple)) or not ids or not all(is_id(t) for t in ids)
        ):
            raise ValueError(
                f"allowed_token_ids must be a non-empty list of token ids, got {ids!r:.100}"
            )
        if ids is not None:
            self.allowed_token_ids = list(ids)
        words = self.bad_words
        if words is not None and (
            not isinstance(words, (list, tuple))
            or not all(isinstance(w, str) and w.strip() for w in words)
        ):
            raise ValueError(f"bad_words must be a list of non-empty strings, got {words!r:.100}")
        if words is not None:
            self.bad_words = list(words)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
