"""The rejection walk (kernels/rejection.py) under the Triton interpreter against its torch
reference, and the reference against the rule written out by hand."""

import pytest
import torch

from tinypaged.kernels import rejection as ops

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")


def random_case(counts, vocab=40, draft_probs=False, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    n, k = len(counts), max(counts)
    rows = sum(counts) + n
    starts = torch.tensor([sum(counts[:i]) + i for i in range(n)], dtype=torch.int64)
    target = torch.softmax(torch.randn(rows, vocab, generator=g) * 2, -1).to(dtype).float()
    # Drafts: half the time the target's argmax (often accepted), else random tokens.
    draft = torch.randint(0, vocab, (n, k), generator=g)
    for i, s in enumerate(starts.tolist()):
        for j in range(counts[i]):
            if torch.rand(1, generator=g) < 0.5:
                draft[i, j] = target[s + j].argmax()
    q = torch.softmax(torch.randn(rows, vocab, generator=g), -1) if draft_probs else None
    uniform = torch.rand(rows, generator=g)
    recovered = torch.randint(0, vocab, (rows,), generator=g)
    greedy = torch.tensor([i % 3 == 0 for i in range(n)])
    num = torch.tensor(counts, dtype=torch.int32)
    return draft, num, starts, greedy, target, q, uniform, recovered


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("draft_probs", [False, True])
@pytest.mark.parametrize("counts", [[1], [4, 0, 2, 5, 3, 1], [3, 3, 3]])
def test_kernel_matches_reference(counts, draft_probs, dtype):
    args = random_case(counts, draft_probs=draft_probs, dtype=dtype)
    got = ops.rejection_sample_triton(*args)
    want = ops.rejection_sample_ref(*args)
    assert torch.equal(got, want)


def test_kernel_all_greedy_and_no_drafts():
    draft, num, starts, _, _, _, uniform, _ = random_case([2, 5, 0])
    recovered = torch.arange(len(uniform)) % 40
    draft[1, :2] = recovered[starts[1] : starts[1] + 2]  # two accepted, then a mismatch
    greedy = torch.ones(3, dtype=torch.bool)
    got = ops.rejection_sample_triton(draft, num, starts, greedy, None, None, uniform, recovered)
    assert torch.equal(got, ops.rejection_sample_ref(draft, num, starts, greedy, None, None,
                                                     uniform, recovered))
    # as the rejection sampler passes them: int64 counts and flags, no uniforms
    packed = ops.rejection_sample_triton(draft, num.long(), starts, greedy.long(), None, None,
                                         torch.empty(0), recovered)
    assert torch.equal(packed, got)
    assert torch.equal(packed, ops.rejection_sample_ref(draft, num.long(), starts, greedy.long(),
                                                        None, None, torch.empty(0), recovered))
    s = starts[1].item()
    assert got[1, :3].tolist() == recovered[s : s + 3].tolist()  # 2 accepted + the correction
    assert got[2, 0] == recovered[starts[2]] and (got[2, 1:] == -1).all()  # the bonus alone
    empty = torch.zeros(2, 0, dtype=torch.int64)
    out = ops.rejection_sample_triton(empty, torch.zeros(2, dtype=torch.int32),
                                      torch.tensor([0, 1]), greedy[:2], None, None,
                                      uniform[:2], recovered[:2])
    assert out[:, 0].tolist() == recovered[:2].tolist()


def test_reference_follows_the_rule():
    counts = [3, 4, 2]
    draft, num, starts, greedy, target, q, uniform, recovered = random_case(counts, seed=5,
                                                                            draft_probs=True)
    out = ops.rejection_sample_ref(draft, num, starts, greedy, target, q, uniform, recovered)
    for i, n in enumerate(counts):
        s, row = int(starts[i]), out[i].tolist()
        for j in range(n + 1):
            if j == n:
                assert row[j] == recovered[s + j]
                break
            x = int(draft[i, j])
            ok = (x == recovered[s + j]) if greedy[i] else (
                uniform[s + j] * q[s + j, x] <= target[s + j, x])
            assert row[j] == (x if ok else recovered[s + j])
            if not ok:
                break
        assert all(t == -1 for t in row[j + 1 :])
