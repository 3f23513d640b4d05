"""Moving a step's rows to where the verification before it ended (kernels/spec_shift.py): the
Triton kernel under the interpreter against its torch reference, and the reference against the
moves written out by hand."""

import pytest
import torch

from tinypaged.kernels import spec_shift as ops

BLOCK_SIZE = 4


def random_case(q_lens, in_flight, seed=0, width=5, padding=3):
    """A step of len(q_lens) sequences built as if every verification in flight accepted all
    its drafts; in_flight[b]: sequence b follows one (its row in `emitted`), else -1."""
    g = torch.Generator().manual_seed(seed)
    num_seqs, max_blocks = len(q_lens), 12
    emitted = torch.full((num_seqs + 2, width), -1, dtype=torch.int64)
    for r in range(len(emitted)):
        e = int(torch.randint(1, width + 1, (1,), generator=g))
        emitted[r, :e] = torch.randint(0, 100, (e,), generator=g)
    rows = torch.tensor(in_flight, dtype=torch.int64)
    assumed = torch.full((num_seqs,), width, dtype=torch.int64)
    tables = torch.randperm(num_seqs * max_blocks, generator=g).to(torch.int32)
    tables = tables.view(num_seqs, max_blocks)
    qsl = torch.zeros(num_seqs + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    total = int(qsl[-1])
    ends = torch.randint(width + max(q_lens), max_blocks * BLOCK_SIZE, (num_seqs,), generator=g)
    positions = torch.cat([torch.arange(int(end) - q, int(end)) for end, q in zip(ends, q_lens)])
    seq_idx = torch.repeat_interleave(torch.arange(num_seqs), torch.tensor(q_lens))
    slots = tables[seq_idx, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    pad = torch.full((padding,), -7, dtype=torch.int64)  # rows past T: never touched
    inputs = (torch.cat([torch.randint(0, 100, (total,), generator=g), pad]),
              torch.cat([positions, pad]), torch.cat([slots, pad]),
              torch.cat([ends.to(torch.int32), torch.tensor([1], dtype=torch.int32)]))
    return (emitted, rows, assumed, qsl, tables, BLOCK_SIZE), inputs


@pytest.mark.parametrize("q_lens,in_flight", [
    ([5], [0]),
    ([5, 1, 3, 5], [2, -1, 0, 3]),
    ([1, 1, 1], [1, 0, -1]),
    ([20, 2], [1, 0]),  # more rows than one block of the kernel's loop
])
def test_kernel_matches_reference(q_lens, in_flight):
    args, inputs = random_case(q_lens, in_flight)
    got = [t.clone() for t in inputs]
    want = [t.clone() for t in inputs]
    ops.shift_to_verified_triton(*args, *got)
    ops.shift_to_verified_ref(*args, *want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_reference_moves_each_sequence_back_by_what_it_did_not_emit():
    q_lens, in_flight = [5, 2, 3], [1, -1, 0]
    args, inputs = random_case(q_lens, in_flight, seed=4)
    emitted, rows, assumed, qsl, tables, bs = args
    ids, positions, slots, seq_lens = (t.clone() for t in inputs)
    ops.shift_to_verified(*args, ids, positions, slots, seq_lens)
    for b, r in enumerate(in_flight):
        start, end = int(qsl[b]), int(qsl[b + 1])
        tokens = [t for t in emitted[r].tolist() if t >= 0] if r >= 0 else []
        shift = len(tokens) - int(assumed[b]) if r >= 0 else 0
        assert shift <= 0
        for t in range(start, end):
            pos = int(inputs[1][t]) + shift
            assert int(positions[t]) == pos
            assert int(slots[t]) == int(tables[b, pos // bs]) * bs + pos % bs
        assert int(ids[start]) == (tokens[-1] if r >= 0 else int(inputs[0][start]))
        assert ids[start + 1 : end].tolist() == inputs[0][start + 1 : end].tolist()
        assert int(seq_lens[b]) == int(inputs[3][b]) + shift
    # rows past the step and the padding sequence's length are left alone
    assert positions[-3:].tolist() == [-7] * 3 and int(seq_lens[-1]) == 1


def test_no_sequence_and_too_wide():
    args, inputs = random_case([2], [-1])
    empty = torch.zeros(0, dtype=torch.int64)
    ops.shift_to_verified(args[0], empty, empty, torch.zeros(1, dtype=torch.int32), args[4],
                          BLOCK_SIZE, *inputs)
    with pytest.raises(ValueError, match="W <= 128"):
        ops.shift_to_verified(torch.zeros(1, 200, dtype=torch.int64), *args[1:], *inputs)
