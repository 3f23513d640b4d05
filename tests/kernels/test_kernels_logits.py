"""The logits ops (token bitmask -> -inf, sparse logit bias) under the Triton interpreter: kernels
vs the torch references, and the references vs a per-token Python loop."""

import math

import pytest
import torch

from tinypaged.kernels import logits as ops

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")

DTYPES = [torch.float32, torch.float16]


def random_case(num_rows: int, vocab: int, masked_rows: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=g)
    words = (vocab + 31) // 32
    # Random words, both signs (bit 31 set), plus an all-zero and an all-one row when room.
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(masked_rows), words), generator=g,
                            dtype=torch.int64).to(torch.int32)
    if len(masked_rows) > 2:
        bitmask[1] = -1
        bitmask[2] = 0
    return logits, bitmask, torch.tensor(masked_rows, dtype=torch.int64)


def loop_bitmask(logits, bitmask, rows):
    out = logits.clone()
    for r, row in enumerate(rows.tolist()):
        for t in range(logits.shape[1]):
            if not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                out[row, t] = -math.inf
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,block", [(100, 64), (4096 + 70, 1024)])
def test_token_bitmask_kernel_matches_reference(dtype, vocab, block):
    logits, bitmask, rows = random_case(6, vocab, [4, 0, 2, 5])
    logits = logits.to(dtype)
    got, want = logits.clone(), logits.clone()
    ops.apply_token_bitmask_triton(got, bitmask, rows, block=block)
    ops.apply_token_bitmask_ref(want, bitmask, rows)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    # Unlisted rows are untouched; an all-ones row keeps everything; an all-zero row is all -inf.
    for row in (1, 3):
        assert torch.equal(got[row], logits[row])
    assert torch.equal(got[0], logits[0])  # bitmask row 1 (all ones) -> logits row 0
    assert torch.isinf(got[2]).all()  # bitmask row 2 (all zero) -> logits row 2


def test_token_bitmask_reference_matches_loop():
    logits, bitmask, rows = random_case(3, 70, [2, 0])
    want = loop_bitmask(logits, bitmask, rows)
    got = logits.clone()
    ops.apply_token_bitmask_ref(got, bitmask, rows)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_bitmask_cpu_path_matches_reference(dtype):
    # The CPU's numpy unpacking: V not a multiple of 32, an all-one and an all-zero row.
    logits, bitmask, rows = random_case(7, 4096 + 70, [6, 0, 3, 4, 1])
    logits = logits.to(dtype)
    got, want = logits.clone(), logits.clone()
    ops.apply_token_bitmask_cpu(got, bitmask, rows)
    ops.apply_token_bitmask_ref(want, bitmask, rows)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert torch.isinf(got[3]).all() and torch.equal(got[0], logits[0])


def test_token_bitmask_dispatch_and_errors():
    logits, bitmask, rows = random_case(2, 40, [1])
    want = loop_bitmask(logits, bitmask, rows)
    ops.apply_token_bitmask_(logits, bitmask, rows)
    torch.testing.assert_close(logits, want, atol=0, rtol=0)
    with pytest.raises(ValueError, match="bitmask must be int32"):
        ops.apply_token_bitmask_(logits, bitmask[:, :1], rows)
    with pytest.raises(ValueError, match="bitmask must be int32"):
        ops.apply_token_bitmask_(logits, bitmask.long(), rows)
    with pytest.raises(ValueError, match="logits must be"):
        ops.apply_token_bitmask_(logits.t(), bitmask, rows)


def bias_case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(5, 300, generator=g)
    pairs = torch.randperm(5 * 300, generator=g)[:37]
    rows, ids = pairs // 300, pairs % 300
    bias = torch.empty(37).uniform_(-100, 100, generator=g)
    return logits, rows, ids, bias


@pytest.mark.parametrize("dtype", DTYPES)
def test_logit_bias_kernel_matches_reference(dtype):
    logits, rows, ids, bias = bias_case()
    logits = logits.to(dtype)
    got, want = logits.clone(), logits.clone()
    ops.apply_logit_bias_triton(got, rows, ids, bias, block=16)
    ops.apply_logit_bias_ref(want, rows, ids, bias)
    tol = {} if dtype == torch.float32 else {"atol": 0.07, "rtol": 1e-3}
    torch.testing.assert_close(got, want, **tol)
    changed = (got != logits).nonzero().tolist()
    assert sorted(map(tuple, changed)) == sorted(zip(rows.tolist(), ids.tolist()))


def test_logit_bias_reference_matches_loop():
    logits, rows, ids, bias = bias_case(1)
    want = logits.clone()
    for r, t, b in zip(rows.tolist(), ids.tolist(), bias.tolist()):
        want[r, t] += b
    ops.apply_logit_bias_(logits, rows, ids, bias)
    torch.testing.assert_close(logits, want)
    with pytest.raises(ValueError, match="1-D of one length"):
        ops.apply_logit_bias_(logits, rows, ids[:3], bias)
