"""The rejection sampler keeps the target's distribution: a chi-square test over many draws on
an 8-token vocabulary, for temperature, top-k, top-p and min-p, with proposals made with
certainty (n-gram style) and with a draft distribution; greedy rows give the argmax chain."""

import math

import pytest
import torch

from tinypaged.kernels._triton import kernel_choice
from tinypaged.sampling.params import SamplingParams
from tinypaged.sampling.rejection_sampler import RejectionSampler
from tinypaged.sampling.sampler import SamplingBatch

VOCAB = 8
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}  # p = 0.001
NUM = 4000  # sequences per test, all verified in one call


def expected(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The target distribution written out by hand (vLLM's order: temperature, min-p, top-k,
    top-p)."""
    probs = torch.softmax(logits / p.temperature, -1)
    keep = torch.ones(VOCAB, dtype=torch.bool)
    if p.min_p > 0:
        keep &= probs >= p.min_p * probs.max()
    order = probs.argsort(descending=True)
    if p.top_k > 0:
        keep[order[p.top_k :]] = False
    probs = torch.where(keep, probs, 0.0)
    if p.top_p < 1:
        mass, kept = 0.0, torch.zeros(VOCAB, dtype=torch.bool)
        for t in order.tolist():
            if keep[t] and mass < p.top_p:
                kept[t] = True
                mass += float(probs[t] / probs.sum())
        probs = torch.where(kept, probs, 0.0)
    return probs / probs.sum()


def chi_square_ok(samples: torch.Tensor, probs: torch.Tensor) -> None:
    counts = torch.bincount(samples, minlength=VOCAB).double()
    assert counts[probs == 0].sum() == 0, "a token outside the target's support was emitted"
    support = probs > 0
    want = probs[support].double() * counts.sum()
    stat = float(((counts[support] - want) ** 2 / want).sum())
    df = int(support.sum()) - 1
    if df > 0:
        assert stat < CHI2_999[df], (stat, counts.tolist(), want.tolist())


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.1, top_k=6),
]


@pytest.mark.parametrize("with_draft_probs", [False, True])
@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p.temperature}k{p.top_k}p{p.top_p}")
def test_emitted_tokens_follow_the_target(params, with_draft_probs):
    g = torch.Generator().manual_seed(1)
    l0, l1 = torch.randn(VOCAB, generator=g) * 1.5, torch.randn(VOCAB, generator=g) * 1.5
    p0, p1 = expected(l0, params), expected(l1, params)
    x0 = int(p0.argsort()[-2])  # a likely, not the likeliest, first draft
    x1 = int(torch.randint(0, VOCAB, (1,), generator=g))
    # Every sequence proposes [x0, x1]; rows: p0, p1 (after x0), the bonus row.
    logits = torch.stack([l0, l1, torch.zeros(VOCAB)]).repeat(NUM, 1)
    batch = SamplingBatch.build([params] * (3 * NUM), [()] * (3 * NUM), [()] * (3 * NUM),
                                [None] * (3 * NUM), set(), "cpu")
    drafts, draft_probs = [[x0, x1]] * NUM, None
    if with_draft_probs:  # each sequence's drafts are draws from the proposer's q0, q1
        q = torch.softmax(torch.randn(3, VOCAB, generator=g), -1)
        draws = torch.stack([torch.multinomial(q[j], NUM, True, generator=g) for j in (0, 1)])
        drafts, draft_probs = draws.T.tolist(), q.repeat(NUM, 1)
    out, _ = RejectionSampler(seed=3)(logits, batch, drafts, [None] * NUM, draft_probs)
    chi_square_ok(out[:, 0], p0)
    # Once the first draft is accepted, the second token follows p1.
    first = torch.tensor([d[0] for d in drafts])
    after_x0 = out[out[:, 0] == first][:, 1]
    assert len(after_x0) > 300
    chi_square_ok(after_x0, p1)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_greedy_rows_accept_the_argmax_chain_and_seeds_repeat(kernels):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, VOCAB, generator=g)
    best = logits.argmax(-1).tolist()
    drafts = [[best[0], best[1], (best[2] + 1) % VOCAB], [best[4]], []]
    greedy = SamplingParams(temperature=0.0)
    batch = SamplingBatch.build([greedy] * 7, [()] * 7, [()] * 7, [None] * 7, set(), "cpu")
    with kernel_choice(kernels):  # triton: the interpreted walk, fed the packed int64 inputs
        out, _ = RejectionSampler()(logits.clone(), batch, drafts, [None] * 3)
    assert out[0].tolist() == [best[0], best[1], best[2], -1]
    assert out[1].tolist() == [best[4], best[5], -1, -1]
    assert out[2].tolist() == [best[6], -1, -1, -1]
    # A seeded row's draws come from its own generator: the same seed, the same tokens.
    seeded = SamplingParams(temperature=1.0, seed=7)
    runs = []
    for other_seed in (0, 1):
        batch = SamplingBatch.build([seeded] * 7, [()] * 7, [()] * 7, [None] * 7, set(), "cpu")
        gens = [torch.Generator().manual_seed(7), None, None]
        runs.append(RejectionSampler(other_seed)(logits.clone(), batch, drafts, gens)[0][0])
    assert torch.equal(runs[0], runs[1])
    assert math.isfinite(float(out.sum()))
