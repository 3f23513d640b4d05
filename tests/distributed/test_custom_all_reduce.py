"""The custom all-reduce on CPU: the Triton kernel under the interpreter with forked processes
standing in for the ranks (shared-memory buffers play the peer-mapped GPU buffers: the kernel
only sees addresses), the abort path, and the rules that choose it over NCCL."""

import multiprocessing

import pytest
import torch

from tinypaged.distributed import custom_all_reduce as car
from tinypaged.kernels.all_reduce import all_reduce_ref, custom_all_reduce

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")

NUM_PROGRAMS, BLOCK, MAX_SIZE = 4, 64, 4096  # small: the interpreter runs every program


def partial(rank: int, call: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * call + rank)
    return torch.randn(numel, generator=gen).to(dtype)


def make_buffers(world_size: int) -> list[torch.Tensor]:
    nbytes = car.buffer_bytes(world_size, MAX_SIZE, NUM_PROGRAMS)
    return [torch.zeros(nbytes, dtype=torch.uint8).share_memory_() for _ in range(world_size)]


def run_rank(rank, buffers, calls, two_shot_min_size, results) -> None:
    ca = car.CustomAllreduce([b.data_ptr() for b in buffers], rank, torch.device("cpu"),
                             MAX_SIZE, NUM_PROGRAMS, BLOCK, two_shot_min_size=two_shot_min_size)
    outs = []
    for call, (numel, dtype) in enumerate(calls):
        x = partial(rank, call, numel, dtype)
        assert ca.fits(x)
        outs.append(ca.all_reduce(x).numpy().copy())  # in place: the result is x
    results.put((rank, outs, ca.counters.tolist()))


F32, F16 = torch.float32, torch.float16


# Sizes below one block, of several regions per program, up to the whole buffer; more calls
# than two, so that both halves of every buffer are reused. With 3 ranks the calls of 1000 bytes
# and more go two-shot, the others one-shot.
@pytest.mark.parametrize(("world_size", "two_shot_min_size", "calls"), [
    (2, None, [(10, F32), (1000, F32), (MAX_SIZE // 4, F32), (300, F16), (MAX_SIZE // 2, F16),
               (64, F32)]),
    (3, 1000, [(10, F32), (700, F32), (300, F16), (600, F16), (64, F32)]),
], ids=["2 ranks one-shot", "3 ranks one-shot and two-shot mixed"])
def test_kernels_sum_across_processes(world_size, two_shot_min_size, calls):
    buffers = make_buffers(world_size)
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=run_rank, args=(r, buffers, calls, two_shot_min_size, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    got = dict((r, (outs, counters)) for r, outs, counters in
               (results.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for call, (numel, dtype) in enumerate(calls):
        want = all_reduce_ref([partial(r, call, numel, dtype) for r in range(world_size)])
        for r in range(world_size):  # every rank gets the reference's bits
            torch.testing.assert_close(torch.from_numpy(got[r][0][call]), want, atol=0, rtol=0)
    assert all(got[r][1] == [len(calls)] * NUM_PROGRAMS for r in range(world_size))


def test_abort_ends_a_wait_for_a_peer_that_never_comes():
    buffers = make_buffers(2)
    ca = car.CustomAllreduce([b.data_ptr() for b in buffers], 0, torch.device("cpu"),
                             MAX_SIZE, NUM_PROGRAMS, BLOCK)
    ca.abort()  # rank 1 never runs: without the flag this call would spin forever
    x = torch.ones(100)
    for two_shot in (False, True):
        custom_all_reduce(x, x, ca.ptrs, ca.counters, 0, ca.flags_bytes // 4, MAX_SIZE // 4,
                          two_shot=two_shot, block=BLOCK, abort_every=4)
    assert ca.counters.tolist() == [2] * NUM_PROGRAMS


def test_reference_sums_in_rank_order_in_fp32():
    parts = [torch.tensor([1.0, 2.0**-9], dtype=torch.bfloat16)] * 2 + [
        torch.tensor([0.0, 2.0**-9], dtype=torch.bfloat16)]
    # bf16 would lose the small terms one at a time (1 + 2^-9 rounds to 1); fp32 keeps them
    got = all_reduce_ref(parts)
    assert got.dtype == torch.bfloat16
    assert got.tolist() == [2.0, 3 * 2.0**-9]


def test_fits_takes_small_contiguous_float_tensors_only():
    buffers = make_buffers(2)
    ca = car.CustomAllreduce([b.data_ptr() for b in buffers], 0, torch.device("cpu"),
                             MAX_SIZE, NUM_PROGRAMS, BLOCK)
    assert ca.fits(torch.zeros(MAX_SIZE // 2, dtype=torch.float16))
    assert not ca.fits(torch.zeros(MAX_SIZE // 2 + 1, dtype=torch.float16))  # over max_size
    assert not ca.fits(torch.zeros(8, 8)[:, ::2])  # not contiguous
    assert not ca.fits(torch.zeros(8, dtype=torch.int32))


def test_unsupported_reason():
    full = [[True, True], [True, True]]
    assert car.unsupported_reason("cuda", 2, False, full) is None
    assert "disabled" in car.unsupported_reason("cuda", 2, True, full)
    assert "cpu" in car.unsupported_reason("cpu", 2, False, full)
    assert "single rank" in car.unsupported_reason("cuda", 1, False, [[True]])
    no_p2p = [[True, True, True], [True, True, False], [True, True, True]]
    assert "(1, 2)" in car.unsupported_reason("cuda", 3, False, no_p2p)
    # a second TP engine in one process: rank 0 made one rendezvous, its fresh workers none
    assert car.unsupported_reason("cuda", 2, False, full, [0, 0]) is None
    assert car.unsupported_reason("cuda", 2, False, full, [1, 1]) is None
    assert "[1, 0] symmetric-memory rendezvous" in car.unsupported_reason(
        "cuda", 2, False, full, [1, 0])


def test_buffer_layout_keeps_regions_aligned():
    assert car.flags_bytes(2, 64) == 512 and car.flags_bytes(8, 3) == 256
    assert car.buffer_bytes(2, 2**20, 64) == 512 + 4 * 2**20
    with pytest.raises(ValueError, match="multiple of 256"):
        car.buffer_bytes(2, 1000, 64)


def test_all_reduce_takes_the_custom_path_when_the_message_fits(monkeypatch):
    from tinypaged.distributed import parallel_state as distributed

    class Custom:
        def fits(self, x):
            return x.numel() <= 4

        def all_reduce(self, x):
            return x.mul_(10)  # stands for the kernel

    def nccl(x, group=None):
        x.add_(1)

    monkeypatch.setattr(distributed, "_CUSTOM_AR", Custom())
    monkeypatch.setattr(distributed, "_GROUP_DEVICE", torch.device("cpu"))
    monkeypatch.setattr(torch.distributed, "all_reduce", nccl)
    assert distributed.custom_all_reduce_enabled()
    assert distributed.all_reduce(torch.ones(4)).tolist() == [10.0] * 4
    assert distributed.all_reduce(torch.ones(5)).tolist() == [2.0] * 5
