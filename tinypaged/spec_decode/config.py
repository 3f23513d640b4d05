"""SpeculativeConfig: vLLM's `speculative_config` dict, validated.

    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_min": 2, "prompt_lookup_max": 5})
    tinypaged serve MODEL --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'

Keys and defaults are vLLM's: `method`, `num_speculative_tokens`, `prompt_lookup_min` /
`prompt_lookup_max` (n-gram; one given sets both, neither gives 5 and 5), `model` ("ngram" as
the model is vLLM's older spelling of the method; a `model` path alone, or method "draft_model"
with it, is a draft model: spec_decode/draft_model.py). Methods implemented here: "ngram",
"draft_model", the draft heads fed the target's hidden states (spec_decode/heads.py):

    "eagle3"   `model`: an EAGLE-3 head (HF or `speculators` checkpoint)
    "eagle"    `model`: an EAGLE (EAGLE-1) head
    "mtp"      the target checkpoint's own multi-token-prediction layer (GLM-4.5 / GLM-4.5-Air;
               `model`, when given, must be the target itself)

and two benchmarking oracles of tinypaged's own, which need the target's greedy continuation
of each prompt (`oracle_token_ids`: a list of [prompt_ids, continuation_ids]):

    "oracle"       proposes the continuation itself: every draft is accepted (greedy)
    "oracle_miss"  proposes the continuation + 1 (mod vocab): every draft is rejected

The other vLLM methods ("medusa", "suffix", ...) and keys are refused with a ValueError
naming them, never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp", "oracle", "oracle_miss")
HEADS = ("eagle", "eagle3", "mtp")  # fed the target's hidden states
_LATER = ("medusa", "mlp_speculator", "suffix")
_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
         "oracle_token_ids")


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    oracle_token_ids: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    model: str | None = None  # the draft model or head (methods "draft_model", "eagle*", "mtp")

    @classmethod
    def from_dict(cls, raw: Any) -> SpeculativeConfig:
        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(raw).__name__}")
        unknown = sorted(set(raw) - set(_KEYS))
        if unknown:
            raise ValueError(
                f"speculative_config: key(s) {', '.join(unknown)} are not supported by tinypaged "
                f"(supported: {', '.join(_KEYS)})"
            )
        method, model = raw.get("method"), raw.get("model")
        if method is None and model in ("ngram", "[ngram]"):
            method = "ngram"
        elif method is None and model is not None:  # vLLM: a model alone is a draft model
            method = "draft_model"
        if method in _LATER:
            raise ValueError(
                f"speculative_config: method {method!r} (a draft head) is not implemented in "
                f"tinypaged yet; use one of {', '.join(METHODS)}"
            )
        if method in ("draft_model", "eagle", "eagle3") and not isinstance(model, str):
            raise ValueError(f"speculative_config: method {method!r} needs 'model': the path "
                             f"(or hub id) of the {'draft model' if method[0] == 'd' else 'head'}")
        if method == "mtp" and model is not None and not isinstance(model, str):
            raise ValueError(f"speculative_config: 'model' must be a path, got {model!r}")
        if method not in METHODS:
            raise ValueError(
                f"speculative_config: method must be one of {', '.join(METHODS)}, got {method!r}"
            )
        k = raw.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 64:
            raise ValueError(
                f"speculative_config: num_speculative_tokens must be an int in [1, 64], got {k!r}"
            )
        lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        lo, hi = (5, 5) if lo is None and hi is None else (lo or hi, hi or lo)
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config: {name} must be an int >= 1, got {value!r}")
        if lo > hi:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})"
            )
        table = {}
        if method.startswith("oracle"):
            pairs = raw.get("oracle_token_ids")
            if not isinstance(pairs, list) or not pairs:
                raise ValueError(
                    "speculative_config: the oracle methods need oracle_token_ids, a list of "
                    "[prompt_token_ids, greedy_continuation_ids] (tinypaged bench latency "
                    "records them)"
                )
            table = {tuple(p): list(c) for p, c in pairs}
        keep_model = method == "draft_model" or method in HEADS
        return cls(method, k, lo, hi, table, model if keep_model else None)
