"""How fast a step reaches the tensor-parallel workers: one pipe per worker (before) against the
shared-memory ring (tinypaged/distributed/shm_broadcast.py, now), on the CPU, no GPU needed.

Rank 0 sends a packed step (tp_worker.pack_step: a decode batch of --batch sequences with
--blocks blocks each) every --gap-us microseconds (a sleep: the engine's work between steps), to N
forked readers that wait for it the way workers do (blocked in recv on a pipe, polling the
ring). Each message carries its send time (time.perf_counter_ns, the same clock in every
process); each reader records when it had the whole payload. Printed: the writer's cost per
send and the one-way latency percentiles, per channel and reader count.

    PYTHONPATH=. python benchmarks/tp_channel.py --readers 1 3 --messages 2000
"""

from __future__ import annotations

import argparse
import multiprocessing
import struct
import time

import numpy as np

from tinypaged.distributed.shm_broadcast import ShmBroadcast
from tinypaged.worker.model_runner import StepInput
from tinypaged.worker.tp_worker import pack_step


def decode_step(batch: int, blocks: int) -> bytes:
    rng = np.random.default_rng(0)
    seq_lens = rng.integers(blocks * 16 - 15, blocks * 16, batch).astype(np.int32)
    step = StepInput(
        input_ids=rng.integers(0, 128000, batch), positions=seq_lens.astype(np.int64) - 1,
        slot_mapping=rng.integers(0, 10**6, batch), query_start_loc=np.arange(batch + 1,
                                                                              dtype=np.int32),
        seq_lens=seq_lens, block_tables=rng.integers(0, 10**5, (batch, blocks)).astype(np.int32),
        logits_indices=np.arange(batch), max_query_len=1, max_seq_len=int(seq_lens.max()),
    )
    return pack_step(step)


def pipe_reader(conn, report) -> None:
    latencies = []
    while payload := conn.recv_bytes():
        latencies.append(time.perf_counter_ns() - struct.unpack_from("q", payload)[0])
    report.send(latencies)


def shm_reader(path: str, readers: int, rank: int, conn, report) -> None:
    ring = ShmBroadcast.attach(path, readers, rank)
    latencies = []
    while payload := ring.recv(conn):
        latencies.append(time.perf_counter_ns() - struct.unpack_from("q", payload)[0])
    report.send(latencies)


def measure(channel: str, readers: int, payload: bytes, messages: int, gap_s: float) -> dict:
    ctx = multiprocessing.get_context("fork")
    pipes = [ctx.Pipe() for _ in range(readers)]
    reports = [ctx.Pipe(duplex=False) for _ in range(readers)]
    ring = ShmBroadcast(readers) if channel == "shm" else None
    procs = []
    for r in range(readers):
        args = ((ring.path, readers, r) if ring else ()) + (pipes[r][1], reports[r][1])
        procs.append(ctx.Process(target=shm_reader if ring else pipe_reader, args=args))
        procs[-1].start()
    body = bytearray(payload)
    send_ns = []

    def no_wait() -> None:
        pass

    time.sleep(0.5)  # every reader is up and waiting
    for i in range(messages + 1):
        last = i == messages
        struct.pack_into("q", body, 0, time.perf_counter_ns())
        message = b"" if last else bytes(body)
        start = time.perf_counter_ns()
        if ring:
            ring.send(message, lambda r: pipes[r][0], no_wait)
        else:
            for conn, _ in pipes:
                conn.send_bytes(message)
        send_ns.append(time.perf_counter_ns() - start)
        time.sleep(gap_s)  # the engine's own work between two steps
    latencies = np.concatenate([np.asarray(recv.recv()[100:]) for recv, _ in reports])  # warm
    for p in procs:
        p.join()
    if ring:
        ring.unlink()
    p50, p90, p99 = np.percentile(latencies / 1e3, [50, 90, 99])
    return dict(channel=channel, readers=readers, bytes=len(payload),
                send_us=float(np.median(send_ns[100:-1]) / 1e3), p50=p50, p90=p90, p99=p99)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--readers", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--blocks", type=int, default=64, help="KV blocks per sequence")
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--gap-us", type=float, default=1000.0)
    args = parser.parse_args()
    print("| channel | readers | step bytes | send us (writer) | one-way p50 us | p90 | p99 |")
    print("|---|---|---|---|---|---|---|")
    for batch in args.batch:
        payload = decode_step(batch, args.blocks)
        for readers in args.readers:
            for channel in ("pipe", "shm"):
                m = measure(channel, readers, payload, args.messages, args.gap_us / 1e6)
                print(f"| {m['channel']} | {m['readers']} | {m['bytes']} | {m['send_us']:.1f} | "
                      f"{m['p50']:.1f} | {m['p90']:.1f} | {m['p99']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
