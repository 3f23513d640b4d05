"""The custom all-reduce against NCCL on N GPUs: correctness first, then microseconds per call.

One process per GPU (forked before CUDA is initialized), joined through `distributed.init_tp`
as the engine's ranks are, so `distributed.all_reduce` takes the custom path wherever it fits.

1. Correctness, bf16 [rows, hidden] with random values per rank: `distributed.all_reduce`
   against NCCL's `torch.distributed.all_reduce` of the same input (max |difference|, and
   whether the bits are equal), and whether every rank got the same bits; the same for the
   two-shot kernel (forced, whatever the size); then a CUDA graph of three calls (1 x hidden,
   256 x hidden, 1 x hidden again) replayed on fresh inputs.
2. Microseconds per call, rank 0's view, each rows x hidden: eager (100 calls back to back)
   and inside a CUDA graph (20 calls per graph, 10 replays), custom vs NCCL (and two-shot).
3. --sweep: the custom kernel's launch settings (programs, block, warps) at a few sizes, in
   graphs, each with its own buffers.
4. --abort-check: rank 0 all-reduces alone (its peer never comes, as if it had died) and
   another thread calls abort() after 1 s: how long until the kernel returned.

    PYTHONPATH=. python benchmarks/all_reduce.py --tp 2 --sweep
Every process ends within --timeout seconds (the parent kills what is left).
"""

from __future__ import annotations

import argparse
import os
import socket
import threading
import time

# NVLink multicast stays off (device README: it can take a shared host's GPUs down for a day).
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402

from tinypaged.distributed import parallel_state as distributed  # noqa: E402

# (num_programs, block, num_warps); the first is the default on an H200 (132 SMs)
SWEEP = [(132, 4096, 16), (132, 8192, 16), (264, 4096, 16), (264, 2048, 8), (132, 4096, 8),
         (66, 8192, 16)]


def timed_us(fn, calls: int, graph: bool) -> float:
    """Microseconds per call of fn(): `calls` calls back to back, or 10 replays of a graph of
    `calls` calls."""
    for _ in range(3):
        fn()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        g.replay()
        torch.cuda.synchronize()
        torch.distributed.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / (10 * calls)
    torch.cuda.synchronize()
    torch.distributed.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def same_on_every_rank(t: torch.Tensor) -> bool:
    gathered = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(gathered, t)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def correctness(rank: int, rows_list: list[int], hidden: int, two_shot) -> list[str]:
    dist = torch.distributed
    lines = []
    for repeat in range(2):  # twice: every size again, so both halves of the buffers are reused
        for rows in rows_list:
            gen = torch.Generator("cuda").manual_seed(1000 * rows + 10 * repeat + rank)
            x = torch.randn(rows, hidden, device="cuda", generator=gen).to(torch.bfloat16)
            want, got, got2 = x.clone(), x.clone(), x.clone()
            dist.all_reduce(want)
            distributed.all_reduce(got)
            two_shot.all_reduce(got2)
            diff = (got.float() - want.float()).abs().max().item()
            agree = same_on_every_rank(got) and same_on_every_rank(got2)
            if repeat == 1:
                lines.append(f"| {rows} x {hidden} | {diff:.3g} | {torch.equal(got, want)} | "
                             f"{torch.equal(got2, want)} | {agree} |")
    # a CUDA graph: three calls, replayed on fresh inputs
    a = torch.zeros(1, hidden, device="cuda", dtype=torch.bfloat16)
    b = torch.zeros(256, hidden, device="cuda", dtype=torch.bfloat16)
    distributed.all_reduce(a), distributed.all_reduce(b)  # compiled before the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        distributed.all_reduce(a)
        distributed.all_reduce(b)
        distributed.all_reduce(a)
    worst, agree = 0.0, True
    for replay in range(5):
        gen = torch.Generator("cuda").manual_seed(77 * replay + rank)
        a.copy_(torch.randn(a.shape, device="cuda", generator=gen))
        b.copy_(torch.randn(b.shape, device="cuda", generator=gen))
        want_a, want_b = a.clone(), b.clone()
        dist.all_reduce(want_a), dist.all_reduce(want_b), dist.all_reduce(want_a)
        g.replay()
        worst = max(worst, (a.float() - want_a.float()).abs().max().item(),
                    (b.float() - want_b.float()).abs().max().item())
        agree = agree and same_on_every_rank(a) and same_on_every_rank(b)
    lines.append(f"| CUDA graph, 3 calls, 5 replays | {worst:.3g} | {worst == 0.0} | | {agree} |")
    del g
    return lines


def timings(rows_list: list[int], hidden: int, two_shot) -> list[str]:
    lines = []
    for rows in rows_list:
        x = torch.zeros(rows, hidden, device="cuda", dtype=torch.bfloat16)
        t = {}
        for name, fn in (("custom", lambda x=x: distributed.all_reduce(x)),
                         ("nccl", lambda x=x: torch.distributed.all_reduce(x))):
            t[name, "eager"] = timed_us(fn, 100, graph=False)
            t[name, "graph"] = timed_us(fn, 20, graph=True)
        two = timed_us(lambda x=x: two_shot.all_reduce(x), 20, graph=True)
        kib = rows * hidden * 2 / 1024
        lines.append(
            f"| {rows} x {hidden} ({kib:.0f} KiB) | {t['custom', 'graph']:.1f} | "
            f"{t['nccl', 'graph']:.1f} | {t['nccl', 'graph'] / t['custom', 'graph']:.2f}x | "
            f"{two:.1f} | {t['custom', 'eager']:.1f} | {t['nccl', 'eager']:.1f} |")
    return lines


def sweep(rank: int, rows_list: list[int], hidden: int) -> list[str]:
    from tinypaged.distributed.custom_all_reduce import create_custom_all_reduce

    lines = []
    device = torch.device("cuda", torch.cuda.current_device())
    for num_programs, block, num_warps in SWEEP:
        ca = create_custom_all_reduce(device, num_programs=num_programs, block=block,
                                      num_warps=num_warps)
        cells = []
        for rows in rows_list:
            gen = torch.Generator("cuda").manual_seed(rows + rank)
            x = torch.randn(rows, hidden, device="cuda", generator=gen).to(torch.bfloat16)
            want = x.clone()
            torch.distributed.all_reduce(want)
            ok = torch.equal(ca.all_reduce(x), want)
            x.zero_()
            us = timed_us(lambda ca=ca, x=x: ca.all_reduce(x), 20, graph=True)
            cells.append(f"{us:.1f}"
                         + ("" if ok else " WRONG"))
        lines.append(f"| {num_programs} | {block} | {num_warps} | " + " | ".join(cells) + " |")
        del ca
        torch.cuda.synchronize()
    return lines


def abort_check(rank: int, hidden: int) -> list[str]:
    """Rank 0 waits in the kernel for peers that never come until another thread aborts
    (what the engine's watchdog does through distributed.abort_tp when a worker dies)."""
    from tinypaged.distributed.custom_all_reduce import create_custom_all_reduce

    ca = create_custom_all_reduce(torch.device("cuda", torch.cuda.current_device()))
    line = []
    if rank == 0:
        x = torch.zeros(256, hidden, device="cuda", dtype=torch.bfloat16)
        threading.Timer(1.0, ca.abort).start()
        start = time.monotonic()
        ca.all_reduce(x)
        torch.cuda.synchronize()
        line = ["", f"abort check: rank 0's lone all-reduce returned "
                f"{time.monotonic() - start - 1.0:.3f} s after abort()"]
    torch.distributed.barrier()
    return line


def worker(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    from tinypaged.distributed.custom_all_reduce import create_custom_all_reduce

    torch.cuda.set_device(rank)
    distributed.init_tp(rank, world_size, "nccl", f"tcp://127.0.0.1:{port}")
    device = torch.device("cuda", rank)
    two_shot = create_custom_all_reduce(device, two_shot_min_size=0)
    out = [f"{world_size} ranks; custom all-reduce enabled: "
           f"{distributed.custom_all_reduce_enabled()}", "",
           "| message (bf16) | max abs diff vs NCCL | bits equal to NCCL | two-shot: equal | "
           "same on every rank |", "|---|---|---|---|---|"]
    out += correctness(rank, args.rows, args.hidden, two_shot)
    out += ["", "| message | custom, graph us | NCCL, graph us | speedup | two-shot, graph us | "
            "custom, eager us | NCCL, eager us |", "|---|---|---|---|---|---|---|"]
    out += timings(args.rows, args.hidden, two_shot)
    if args.sweep:
        sizes = [1, 256, 2048]
        out += ["", "| programs | block | warps | " + " | ".join(
            f"{r} x {args.hidden} graph us" for r in sizes) + " |", "|---|---|---|---|---|---|---|"]
        out += sweep(rank, sizes, args.hidden)
    if args.abort_check:
        out += abort_check(rank, args.hidden)
    if rank == 0:
        print("\n".join(out), flush=True)
    torch.cuda.synchronize()
    distributed.leave_tp(graceful=True)
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--rows", type=int, nargs="+",
                        default=[1, 8, 64, 256, 512, 1024, 2048])
    parser.add_argument("--sweep", action="store_true", help="try the kernel's launch settings")
    parser.add_argument("--abort-check", action="store_true", help="a lone rank, then abort")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = torch.multiprocessing.get_context("fork")  # CUDA is not initialized here
    procs = [ctx.Process(target=worker, args=(r, args.tp, port, args)) for r in range(args.tp)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p in procs]
    print(f"exit codes {codes}" + (f"; killed after {args.timeout:.0f} s: {hung}" if hung else ""))
    raise SystemExit(0 if all(c == 0 for c in codes) else 1)


if __name__ == "__main__":
    main()
