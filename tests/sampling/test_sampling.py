"""The batched sampler against independent float64 computations of what each option means."""

import math

import numpy as np
import pytest
import torch

from tinypaged.sampling.params import SamplingParams
from tinypaged.sampling.sampler import (
    Sampler,
    SamplingBatch,
    apply_penalties,
    new_generator,
)

V = 24


def build(params, outputs=None, prompts=None, generators=None, eos=frozenset()):
    n = len(params)
    outputs = outputs if outputs is not None else [[] for _ in range(n)]
    prompts = prompts if prompts is not None else [[] for _ in range(n)]
    if generators is None:
        generators = [new_generator(p.seed, "cpu") if p.seed is not None else None for p in params]
    return SamplingBatch.build(params, prompts, outputs, generators, eos, "cpu")


def allowed_set(row: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray, float]:
    """The tokens each filter lets through, straight from the definitions, in float64.

    Returns (keep mask, renormalised probabilities, smallest distance to a decision boundary)."""
    z = row.astype(np.float64) / p.temperature
    prob = np.exp(z - z.max())
    prob /= prob.sum()
    keep = np.ones(len(row), bool)
    margin = math.inf
    if p.min_p > 0:
        threshold = p.min_p * prob.max()
        keep &= prob >= threshold
        margin = min(margin, np.abs(prob - threshold).min())
    if p.top_k > 0:
        ranked = [t for t in np.argsort(-z) if keep[t]]
        keep[:] = False
        keep[ranked[: p.top_k]] = True
    if p.top_p < 1:
        q = np.where(keep, prob, 0.0)
        q /= q.sum()
        order = np.argsort(-q)
        mass_before = np.concatenate([[0.0], np.cumsum(q[order])[:-1]])
        keep[:] = False
        keep[order[mass_before < p.top_p]] = True
        margin = min(margin, np.abs(mass_before - p.top_p).min())
    final = np.where(keep, prob, 0.0)
    return keep, final / final.sum(), margin


def well_separated_logits(params: SamplingParams, start_seed: int) -> torch.Tensor:
    """Random logits whose filter boundaries are not within float32 noise of any token."""
    for seed in range(start_seed, start_seed + 100):
        row = torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 2
        if allowed_set(row.numpy(), params)[2] > 1e-3:
            return row
    raise AssertionError("no well separated logits found")


FILTERS = [
    SamplingParams(top_k=3),
    SamplingParams(top_p=0.6),
    SamplingParams(min_p=0.15),
    SamplingParams(temperature=0.7, top_k=6, top_p=0.8),
    SamplingParams(temperature=1.5, min_p=0.05, top_k=10, top_p=0.9),
    SamplingParams(temperature=0.5),
]


@pytest.mark.parametrize(
    "params", FILTERS, ids=lambda p: f"T{p.temperature}k{p.top_k}p{p.top_p}m{p.min_p}"
)
def test_draws_stay_in_allowed_set_with_the_right_frequencies(params):
    # Several different logit rows in one batch, so many filter boundaries get exercised.
    rows = [well_separated_logits(params, start_seed=100 * r) for r in range(4)]
    per_row, calls = 500, 10
    logits = torch.stack(rows).repeat_interleave(per_row, dim=0)  # [4 * per_row, V]
    sampler = Sampler(seed=1)
    counts = np.zeros((len(rows), V))
    for _ in range(calls):
        out = np.array(sampler(logits.clone(), build([params] * len(logits))).token_ids)
        for r in range(len(rows)):
            counts[r] += np.bincount(out[r * per_row : (r + 1) * per_row], minlength=V)
    total = per_row * calls
    for r, row in enumerate(rows):
        keep, expected, _ = allowed_set(row.numpy(), params)
        assert counts[r][~keep].sum() == 0, f"row {r}: drew {np.nonzero(counts[r] * ~keep)}"
        sigma = np.sqrt(expected * (1 - expected) / total)
        assert np.all(np.abs(counts[r] / total - expected) <= 5 * sigma + 1e-3), r


def test_top_k_1_is_greedy_and_greedy_is_argmax():
    logits = torch.randn(64, V, generator=torch.Generator().manual_seed(3))
    want = logits.argmax(-1).tolist()
    sampler = Sampler(seed=5)
    assert sampler(logits.clone(), build([SamplingParams(top_k=1)] * 64)).token_ids == want
    greedy_batch = build([SamplingParams(temperature=0.0)] * 64)
    assert greedy_batch.argmax_only
    assert sampler(logits.clone(), greedy_batch).token_ids == want
    # Greedy rows inside a random batch still take the argmax.
    mixed = [SamplingParams(temperature=0.0 if i % 2 else 1.0) for i in range(64)]
    got = sampler(logits.clone(), build(mixed)).token_ids
    assert got[1::2] == want[1::2]
    assert got[0::2] != want[0::2]  # the random rows really sample


def generate(params, sampler_seed, steps=10):
    """Sample a few steps for each row, with logits that depend on the row's own history."""
    table = torch.randn(V, V, generator=torch.Generator().manual_seed(0))
    outputs = [[] for _ in params]
    generators = [new_generator(p.seed, "cpu") if p.seed is not None else None for p in params]
    sampler = Sampler(seed=sampler_seed)
    for _ in range(steps):
        logits = torch.stack([table[o[-1] if o else 0] for o in outputs])
        batch = build(params, outputs=outputs, generators=generators)
        for out, token in zip(outputs, sampler(logits, batch).token_ids):
            out.append(token)
    return outputs


def test_seeded_rows_ignore_the_rest_of_the_batch():
    a = SamplingParams(seed=11, temperature=1.0)
    b = SamplingParams(seed=12, temperature=1.2, top_p=0.9)
    alone_a, alone_b = generate([a], 0)[0], generate([b], 0)[0]
    assert alone_a != alone_b
    others = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(seed=99, top_k=4)]
    for sampler_seed, batch in [
        (1, [a, b] + others),
        (2, others + [b, a]),
        (3, [others[0], a, others[2], b]),
    ]:
        outs = generate(batch, sampler_seed)
        assert outs[batch.index(a)] == alone_a
        assert outs[batch.index(b)] == alone_b
    # Unseeded rows follow the engine seed instead.
    assert generate([SamplingParams()] * 3, 4) == generate([SamplingParams()] * 3, 4)
    assert generate([SamplingParams()] * 3, 4) != generate([SamplingParams()] * 3, 5)


def test_penalties_match_their_definition():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(3, V, generator=gen) * 3
    prompts = [[1, 2, 2, 5], [], [9]]
    outputs = [[2, 3, 3, 3, 7], [4, 4, 20], []]
    rep, freq, pres = [1.3, 0.7, 2.0], [0.5, -0.4, 1.0], [0.25, 1.5, -2.0]
    got = apply_penalties(
        logits.clone(),
        torch.tensor([p + [-1] * (4 - len(p)) for p in prompts]),
        torch.tensor([o + [-1] * (5 - len(o)) for o in outputs]),
        torch.tensor(list(zip(rep, freq, pres))),
    )
    for i in range(3):
        for t in range(V):
            x = logits[i, t].item()
            if t in prompts[i] or t in outputs[i]:
                x = x / rep[i] if x > 0 else x * rep[i]
            c = outputs[i].count(t)
            x -= freq[i] * c + pres[i] * (c > 0)
            assert got[i, t].item() == pytest.approx(x, rel=1e-6, abs=1e-6)


def test_sampler_applies_penalties_before_choosing():
    logits = torch.zeros(2, V)
    logits[:, 5], logits[:, 6] = 3.0, 2.0  # 5 wins unpenalised
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=2.0),  # 3 / 2 < 2
        SamplingParams(temperature=0.0, presence_penalty=1.5),  # 3 - 1.5 < 2
    ]
    batch = build(params, outputs=[[], [5]], prompts=[[5], []])
    assert Sampler()(logits.clone(), batch).token_ids == [6, 6]
    # Rows without penalties in the same batch are untouched.
    mixed = build([params[0], SamplingParams(temperature=0.0)], prompts=[[5], [5]])
    assert Sampler()(logits.clone(), mixed).token_ids == [6, 5]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_blocks_eos_and_stop_tokens(temperature):
    logits = torch.zeros(200, V)
    logits[:, 0] = 30.0  # eos
    logits[:, 1] = 29.0  # a stop token id
    params = SamplingParams(temperature=temperature, min_tokens=3, stop_token_ids=[1])
    sampler = Sampler()
    for done in range(3):
        batch = build([params] * 200, outputs=[[7] * done] * 200, eos={0})
        tokens = sampler(logits.clone(), batch).token_ids
        assert 0 not in tokens and 1 not in tokens
    batch = build([params] * 200, outputs=[[7] * 3] * 200, eos={0})
    assert set(sampler(logits.clone(), batch).token_ids) <= {0, 1}


def test_logprobs_are_raw_log_softmax():
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(4, V, generator=gen)
    params = [
        SamplingParams(logprobs=3, temperature=0.3, repetition_penalty=1.5),
        SamplingParams(),
        SamplingParams(logprobs=0, top_k=2),
        SamplingParams(logprobs=5, temperature=0.0),
    ]
    out = Sampler()(logits.clone(), build(params, prompts=[[0, 1, 2]] * 4))
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert out.logprobs[1] is None
    for i, k in [(0, 3), (2, 0), (3, 5)]:
        row = out.logprobs[i]
        token = out.token_ids[i]
        top = set(ref[i].topk(k).indices.tolist()) if k else set()
        assert set(row) == top | {token}
        for t, lp in row.items():
            assert lp == pytest.approx(ref[i, t].item(), abs=1e-5)
    assert out.token_ids[3] == logits[3].argmax().item()


def test_row_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.zeros(3, V), build([SamplingParams()] * 2))


def test_model_dtype_logits_sample_as_their_float32_copy():
    """The LM head hands over bf16 logits: greedy takes their argmax as they are, everything
    else (penalties, logprobs, temperature with a seed) works on a float32 copy, so the tokens
    and logprobs are those of the float32 logits."""
    logits = (4 * torch.randn(16, V, generator=torch.Generator().manual_seed(4))).bfloat16()
    params = [SamplingParams(temperature=0.0)] * 16
    greedy = Sampler()(logits.clone(), build(params))
    assert greedy.sampled.dtype == torch.int64
    assert greedy.token_ids == logits.float().argmax(-1).tolist()
    mixed = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(seed=3, top_p=0.8),
             SamplingParams(temperature=0.0, presence_penalty=1.0)] * 2
    prompts = [[0, 1]] * 6
    got = Sampler()(logits[:6].clone(), build(mixed, prompts=prompts))
    want = Sampler()(logits[:6].float(), build(mixed, prompts=prompts))
    assert got.token_ids == want.token_ids
    assert got.logprobs == want.logprobs
