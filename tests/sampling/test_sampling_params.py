"""SamplingParams: vLLM's defaults, normalisation, and a ValueError naming each bad field."""

import dataclasses

import pytest

from tinypaged.sampling.params import SamplingParams


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.seed, p.stop, p.stop_token_ids, p.ignore_eos) == (None, [], [], False)
    assert (p.max_tokens, p.min_tokens, p.logprobs) == (16, 0, None)
    assert p.skip_special_tokens is True and p.include_stop_str_in_output is False
    assert not p.is_greedy and not p.uses_penalties


def test_normalisation():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(5, 7)).stop_token_ids == [5, 7]
    assert SamplingParams(top_k=-1).top_k == 0
    greedy = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.1)
    assert greedy.is_greedy and (greedy.top_k, greedy.top_p, greedy.min_p) == (0, 1.0, 0.0)
    assert SamplingParams(temperature=1, max_tokens=None).max_tokens is None  # ints pass as floats
    assert SamplingParams(repetition_penalty=1.2).uses_penalties
    child = dataclasses.replace(SamplingParams(n=3, seed=7), n=1, seed=8)
    assert (child.n, child.seed) == (1, 8)


BAD = [
    ("n", 0),
    ("n", 1.5),
    ("n", True),
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("temperature", "hot"),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", None),
    ("top_k", -2),
    ("top_k", 2.5),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.1),
    ("frequency_penalty", 2.01),
    ("frequency_penalty", -3),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("max_tokens", 0),
    ("max_tokens", 3.0),
    ("min_tokens", -1),
    ("logprobs", -1),
    ("logprobs", 1.0),
    ("seed", 1.5),
    ("seed", "42"),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", 5),
    ("stop", [None]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["2"]),
    ("stop_token_ids", 3),
    ("ignore_eos", 1),
    ("skip_special_tokens", "yes"),
    ("include_stop_str_in_output", None),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"5": 1.0}),
    ("logit_bias", {5: float("nan")}),
    ("logit_bias", [5]),
    ("allowed_token_ids", []),
    ("allowed_token_ids", [1, -2]),
    ("bad_words", "word"),
    ("bad_words", ["ok", " "]),
]


@pytest.mark.parametrize(("field", "value"), BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_bad_value_names_the_field(field, value):
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**{field: value})
    assert repr(value) in str(info.value) or str(value) in str(info.value)


def test_range_errors_state_the_range():
    with pytest.raises(ValueError, match=r"^top_p must be > 0 and <= 1 \(1 means off\), got 0$"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match=r"^presence_penalty must be >= -2 and <= 2, got 3$"):
        SamplingParams(presence_penalty=3)
    with pytest.raises(ValueError, match=r"^n must be >= 1, got 0$"):
        SamplingParams(n=0)


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens.*max_tokens"):
        SamplingParams(min_tokens=20, max_tokens=10)
    assert SamplingParams(min_tokens=20, max_tokens=None).min_tokens == 20
