"""LoRA shrink and expand under the Triton interpreter: kernels vs the torch references, and the
references vs a per-token loop that reads each token's own adapter (no segments)."""

import pytest
import torch

from tinypaged.kernels.lora_expand import (
    lora_add_ref,
    lora_add_triton,
    lora_expand_ref,
    lora_expand_triton,
)
from tinypaged.kernels.lora_shrink import (
    lora_segments,
    lora_shrink_ref,
    lora_shrink_triton,
    shrink_splits,
)

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")

DTYPES = [torch.float32, torch.float16]


def tol(dtype):
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-3, "rtol": 3e-3}


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


def random_slots(num_tokens, num_slots, seed):
    """Slots in [-1, num_slots): every slot and 'no adapter' drawn, in shuffled order."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1, num_slots, (num_tokens,), generator=g, dtype=torch.int32)


def test_segments_group_tokens_by_slot():
    slots = torch.tensor([2, -1, 0, 2, 0, -1, 2], dtype=torch.int32)
    sorted_ids, start, length = lora_segments(slots, 3)
    assert length.tolist() == [2, 0, 3]
    assert start.tolist() == [0, 2, 2]
    assert sorted_ids[:5].tolist() == [2, 4, 0, 3, 6]  # stable within a slot
    assert sorted(sorted_ids[5:].tolist()) == [1, 5]  # no adapter: after every segment


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,k,n,split_k", [(5, 64, 48, 1), (40, 96, 16, 3),
                                                    (70, 300, 32, None)])
def test_lora_shrink(dtype, num_tokens, k, n, split_k):
    num_slots = 3
    x, a = randn(num_tokens, k, dtype=dtype), randn(num_slots, n, k, dtype=dtype, seed=1)
    slots = random_slots(num_tokens, num_slots, seed=num_tokens)
    meta = lora_segments(slots, num_slots)
    split_k = split_k or shrink_splits(num_tokens, k)
    untouched = -7.0
    got = lora_shrink_triton(x, a, *meta, torch.full((split_k, num_tokens, n), untouched))
    want = lora_shrink_ref(x, a, *meta, torch.full((split_k, num_tokens, n), untouched))
    for t, s in enumerate(slots.tolist()):  # independent: token by token
        if s >= 0:
            expect = x[t].double() @ a[s].double().T
            torch.testing.assert_close(want[:, t].sum(0).double(), expect, **tol(torch.float32))
    mine = slots >= 0
    torch.testing.assert_close(got[:, mine].sum(0), want[:, mine].sum(0), **tol(dtype))
    assert (got[:, ~mine] == untouched).all() and (want[:, ~mine] == untouched).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,rank,offsets,splits", [(6, 16, (0, 64, 96, 128), 3),
                                                            (37, 8, (0, 80), 1),
                                                            (20, 40, (0, 24, 48), 2),
                                                            (9, 200, (0, 40), 5)])
def test_lora_expand(dtype, num_tokens, rank, offsets, splits):
    num_slots, shards = 4, len(offsets) - 1
    y0 = randn(num_tokens, offsets[-1], dtype=dtype, seed=2)
    h = randn(splits, num_tokens, shards * rank, seed=3)  # partial sums of the shrink
    b = randn(num_slots, offsets[-1], rank, dtype=dtype, seed=4, scale=0.5)
    slots = random_slots(num_tokens, num_slots, seed=rank)
    meta = lora_segments(slots, num_slots)
    got = lora_expand_triton(y0.clone(), h, b, *meta, offsets)
    want = lora_expand_ref(y0.clone(), h, b, *meta, offsets)
    for t, slot in enumerate(slots.tolist()):
        expect = y0[t].double().clone()
        if slot >= 0:
            for s in range(shards):
                lo, hi = offsets[s], offsets[s + 1]
                hs = h[:, t, s * rank : (s + 1) * rank].sum(0).to(dtype).double()
                expect[lo:hi] += b[slot, lo:hi].double() @ hs
        torch.testing.assert_close(want[t].double(), expect, **tol(dtype))
    torch.testing.assert_close(got, want, **tol(dtype))
    assert torch.equal(got[slots < 0], y0[slots < 0])  # tokens of no adapter: untouched


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the NaN rows
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,rank,offsets", [(6, 16, (0, 64, 96, 128)), (3, 8, (0, 1100))])
def test_split_expand_equals_the_expand(dtype, num_tokens, rank, offsets):
    """The delta stored by lora_expand(accumulate=False), then lora_add into y: the same values
    as the one-kernel expand, bit for bit (one fp32 sum, rounded once), in each implementation;
    the delta's rows of tokens of no adapter are never read."""
    num_slots, shards = 3, len(offsets) - 1
    y0 = randn(num_tokens, offsets[-1], dtype=dtype, seed=2)
    h = randn(2, num_tokens, shards * rank, seed=3)
    b = randn(num_slots, offsets[-1], rank, dtype=dtype, seed=4, scale=0.5)
    slots = torch.tensor([1, -1, 0, 2, 0, -1][:num_tokens], dtype=torch.int32)
    meta = lora_segments(slots, num_slots)
    has = torch.cat([(slots >= 0).to(torch.int32), torch.ones(4, dtype=torch.int32)])  # [>= T]
    for expand, add in ((lora_expand_ref, lora_add_ref), (lora_expand_triton, lora_add_triton)):
        whole = expand(y0.clone(), h, b, *meta, offsets)
        delta = torch.full((num_tokens, offsets[-1]), float("nan"))  # unwritten rows: NaN
        expand(delta, h, b, *meta, offsets, accumulate=False)
        assert delta[slots >= 0].isfinite().all()
        split = add(y0.clone(), delta, has)
        assert torch.equal(split, whole)
        assert torch.equal(split[slots < 0], y0[slots < 0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_kernels_on_uneven_segments(dtype):
    """One slot with several row tiles, an empty slot, a short one and tokens of no adapter, in
    mixed order: each program must find its own slot's tile (slot_tile) and nothing else."""
    slots = torch.tensor([1] * 40 + [2] * 5 + [-1] * 3, dtype=torch.int32)
    slots = slots[torch.randperm(len(slots), generator=torch.Generator().manual_seed(0))]
    num_tokens, num_slots, k, rank, offsets = len(slots), 4, 64, 16, (0, 32, 48)
    meta = lora_segments(slots, num_slots)
    x = randn(num_tokens, k, dtype=dtype)
    a = randn(num_slots, 2 * rank, k, dtype=dtype, seed=1)
    b = randn(num_slots, offsets[-1], rank, dtype=dtype, seed=2, scale=0.5)
    split_k = shrink_splits(num_tokens, k)
    h = lora_shrink_triton(x, a, *meta, torch.full((split_k, num_tokens, 2 * rank), -7.0))
    want_h = lora_shrink_ref(x, a, *meta, torch.full((split_k, num_tokens, 2 * rank), -7.0))
    mine = slots >= 0
    torch.testing.assert_close(h[:, mine].sum(0), want_h[:, mine].sum(0), **tol(dtype))
    y0 = randn(num_tokens, offsets[-1], dtype=dtype, seed=3)
    got = lora_expand_triton(y0.clone(), want_h, b, *meta, offsets)
    torch.testing.assert_close(got, lora_expand_ref(y0.clone(), want_h, b, *meta, offsets),
                               **tol(dtype))
    assert torch.equal(got[~mine], y0[~mine])


@pytest.fixture
def tiles(monkeypatch):
    """Force one LORA_TILES row on every batch size: (BLOCK_M, shrink BLOCK_N, BLOCK_K, programs,
    expand BLOCK_N, TILES), so small interpreter cases reach the loops that only large batches
    take with the tuned table."""
    from tinypaged.kernels import lora_shrink

    def force(block_m, shrink_n, block_k, programs, expand_n, tiles):
        monkeypatch.setattr(lora_shrink, "LORA_TILES",
                            ((1 << 62, block_m, shrink_n, block_k, programs, expand_n, tiles),))
    return force


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offsets,expand_n,tiles_per_program,splits", [
    ((0, 300), 16, 4, 1),  # 19 column tiles: 5 groups, the last one of 3 tiles, the last ragged
    ((0, 64, 80, 96), 16, 8, 9),  # qkv-like: shard 0 is one full group, shards 1-2 one tile each
    ((0, 100, 200), 32, 2, 40),  # gate-up-like: 4 tiles a shard, 2 groups each; 40 planes
    ((0, 40), 16, 8, 64),  # one group past the shard's end; 64 planes in several loads
    ((0, 64, 128), 16, 4, 5),  # every group ends inside its shard
])
def test_lora_expand_column_groups(dtype, tiles, offsets, expand_n, tiles_per_program, splits):
    """Each program sums its rows' planes once and loops over up to TILES column tiles of one
    shard: uneven segments over several row tiles, an empty slot, tokens of no adapter."""
    tiles(16, 16, 16, 64, expand_n, tiles_per_program)
    slots = torch.tensor([0] * 35 + [2] * 3 + [3] * 17 + [-1] * 5, dtype=torch.int32)  # 1: empty
    slots = slots[torch.randperm(len(slots), generator=torch.Generator().manual_seed(1))]
    num_tokens, num_slots, rank, shards = len(slots), 4, 16, len(offsets) - 1
    meta = lora_segments(slots, num_slots)
    assert meta[2].tolist() == [35, 0, 3, 17]
    y0 = randn(num_tokens, offsets[-1], dtype=dtype, seed=2)
    h = randn(splits, num_tokens, shards * rank, seed=3, scale=0.3)
    b = randn(num_slots, offsets[-1], rank, dtype=dtype, seed=4, scale=0.5)
    got = lora_expand_triton(y0.clone(), h, b, *meta, offsets)
    want = lora_expand_ref(y0.clone(), h, b, *meta, offsets)
    torch.testing.assert_close(got, want, **tol(dtype))
    assert torch.equal(got[slots < 0], y0[slots < 0])


@pytest.mark.parametrize("block_m,shrink_n,block_k,programs", [(16, 16, 32, 64), (32, 16, 16, 8)])
def test_lora_shrink_expand_chain_tiles(tiles, block_m, shrink_n, block_k, programs):
    """Shrink then expand at forced tiles (split-K from the program target, N tiles of one rank)
    against the references chained the same way."""
    tiles(block_m, shrink_n, block_k, programs, 16, 3)
    slots = torch.tensor([1] * 21 + [0] * 2 + [-1] * 4, dtype=torch.int32)
    slots = slots[torch.randperm(len(slots), generator=torch.Generator().manual_seed(2))]
    num_tokens, num_slots, k, rank, offsets = len(slots), 3, 160, 16, (0, 48, 72, 96)
    meta = lora_segments(slots, num_slots)
    x = randn(num_tokens, k)
    a = randn(num_slots, 3 * rank, k, seed=1)
    b = randn(num_slots, offsets[-1], rank, seed=2, scale=0.5)
    split_k = shrink_splits(num_tokens, k)
    assert split_k > 1
    h = lora_shrink_triton(x, a, *meta, torch.full((split_k, num_tokens, 3 * rank), -7.0))
    want_h = lora_shrink_ref(x, a, *meta, torch.full((1, num_tokens, 3 * rank), -7.0))
    y0 = randn(num_tokens, offsets[-1], seed=3)
    got = lora_expand_triton(y0.clone(), h, b, *meta, offsets)
    torch.testing.assert_close(got, lora_expand_ref(y0.clone(), want_h, b, *meta, offsets),
                               **tol(torch.float32))


def test_lora_kernels_one_slot():
    """max_loras = 1: slot_tile's vector of segment lengths has a single lane."""
    slots = torch.tensor([0, -1, 0, 0, -1], dtype=torch.int32)
    meta = lora_segments(slots, 1)
    x, a = randn(5, 64), randn(1, 16, 64, seed=1)
    b, y0 = randn(1, 40, 16, seed=2), randn(5, 40, seed=3)
    h = lora_shrink_triton(x, a, *meta, torch.zeros(3, 5, 16))
    want_h = lora_shrink_ref(x, a, *meta, torch.zeros(3, 5, 16))
    torch.testing.assert_close(h.sum(0), want_h.sum(0), **tol(torch.float32))
    got = lora_expand_triton(y0.clone(), h, b, *meta, (0, 40))
    torch.testing.assert_close(got, lora_expand_ref(y0.clone(), want_h, b, *meta, (0, 40)),
                               **tol(torch.float32))


def test_one_compiled_kernel_per_tile_row():
    """The constexprs (what Triton compiles a kernel for) of both launches depend on the
    LORA_TILES row and the layer, never on the batch size itself: a server that meets a new
    number of tokens in a step reuses a compiled kernel instead of stalling on the compiler."""
    from tinypaged.kernels.lora_expand import expand_launch
    from tinypaged.kernels.lora_shrink import LORA_TILES, lora_tiles, shrink_launch

    for k, n, offsets in [(4096, 48, (0, 4096, 5120, 6144)), (14336, 16, (0, 4096))]:
        shrink, expand = set(), set()
        for num_tokens in range(1, 4097):
            split_k = shrink_splits(num_tokens, k)
            row = lora_tiles(num_tokens)
            shrink.add((row, tuple(shrink_launch(num_tokens, k, n, 4, split_k)[1].items())))
            expand.add((row, tuple(expand_launch(num_tokens, 4, 16, split_k, offsets,
                                                 row)[2].items())))
        assert len(shrink) == len(expand) == len(LORA_TILES)
