"""One writer, N readers: the engine's steps to its tensor-parallel workers through shared memory.

Over a pipe, each step costs a write() system call per worker and, on the worker's side, a wake-up
from a blocking read (the scheduler's latency: tens of microseconds, more on a busy host). Here
rank 0 writes the step once into a ring of slots in a file under /dev/shm that every rank maps,
and each worker, which polls while it waits, sees it within a microsecond or two (the idea of
vLLM's shm_broadcast MessageQueue).

    [ acks: int64 per reader, each on its own 64-byte line ]   messages reader r has consumed
    [ slot 0: int64 seq, int64 nbytes, ..., payload (SLOT_BYTES) ]
    [ slot 1 ] ... [ slot NUM_SLOTS - 1 ]

Message n (1, 2, ...) goes to slot (n - 1) % NUM_SLOTS. The writer waits until every reader's ack
is >= n - NUM_SLOTS (the slot's previous message is consumed), writes the payload and its
length, then publishes by writing seq = n last. A reader waiting for message n polls slot seq
until it reads n, copies the payload out, then writes its ack = n. Stores become visible in
program order on x86 (TSO); the lock round trip before each publish and after each read is a
full memory barrier elsewhere. A payload larger than a slot travels over the pipe instead, its
slot saying so with nbytes = -1.

Waiting readers first yield the core (os.sched_yield) and, once idle for a while, sleep in short
naps, so that an idle engine costs no CPU and a busy one answers within microseconds.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import numpy as np

NUM_SLOTS = 4
SLOT_BYTES = 1 << 20  # a decode step of 256 sequences is ~150 KiB; larger steps take the pipe
LINE = 64  # bytes: one cache line per counter, so that ranks never write the same line
SPIN_S = 0.05  # a reader waiting longer than this naps between polls
NAP_S = 0.0005


class ShmBroadcast:
    """Create it in rank 0 with the number of readers; pass `path` to each reader, which calls
    `ShmBroadcast.attach(path, reader)`; rank 0 `unlink()`s the file once all have attached."""

    def __init__(self, num_readers: int, path: str | None = None, reader: int = -1) -> None:
        self.num_readers, self.reader = num_readers, reader
        size = LINE * num_readers + NUM_SLOTS * (LINE + SLOT_BYTES)
        if path is None:  # the writer creates the file
            folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
            fd, path = tempfile.mkstemp(prefix="tinypaged-tp-", dir=folder)
            os.ftruncate(fd, size)
        else:
            fd = os.open(path, os.O_RDWR)
        self.path = path
        self.buffer = mmap.mmap(fd, size)
        os.close(fd)
        self.acks = np.frombuffer(self.buffer, np.int64, num_readers * LINE // 8).reshape(
            num_readers, LINE // 8)[:, 0]  # [num_readers]: messages consumed by each reader
        base = LINE * num_readers
        self.slot_offsets = [base + i * (LINE + SLOT_BYTES) for i in range(NUM_SLOTS)]
        self.headers = [np.frombuffer(self.buffer, np.int64, 2, off) for off in self.slot_offsets]
        self.count = 0  # messages written (writer) or read (reader) so far
        self._fence = threading.Lock()

    @classmethod
    def attach(cls, path: str, num_readers: int, reader: int) -> ShmBroadcast:
        return cls(num_readers, path, reader)

    def unlink(self) -> None:
        """Remove the file; the mappings stay valid (call once every reader has attached)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _barrier(self) -> None:
        with self._fence:
            pass

    def send(self, payload: bytes, conn_of: Callable[[int], Connection],
             check: Callable[[], None]) -> None:
        """Publish `payload` to every reader. `conn_of(r)`: reader r's pipe, for a payload too
        big for a slot. `check()` runs while waiting for a free slot and raises when a reader
        is dead, so that the writer never waits for an ack that cannot come."""
        n = self.count + 1
        slot = (n - 1) % NUM_SLOTS
        while int(self.acks.min(initial=n)) < n - NUM_SLOTS:
            check()
            os.sched_yield()
        header, start = self.headers[slot], self.slot_offsets[slot] + LINE
        fits = len(payload) <= SLOT_BYTES
        if fits:
            self.buffer[start:start + len(payload)] = payload
        header[1] = len(payload) if fits else -1
        self._barrier()
        header[0] = n  # publish
        self.count = n
        if not fits:  # after publishing: the readers are to be waiting on their pipes
            for r in range(self.num_readers):
                conn_of(r).send_bytes(payload)

    def recv(self, conn: Connection) -> bytes:
        """The next message (reader side), waiting as long as it takes."""
        n = self.count + 1
        slot = (n - 1) % NUM_SLOTS
        header, start = self.headers[slot], self.slot_offsets[slot] + LINE
        began = time.monotonic()
        while header[0] != n:
            if time.monotonic() - began < SPIN_S:
                os.sched_yield()
            else:
                time.sleep(NAP_S)
        self._barrier()
        nbytes = int(header[1])
        payload = conn.recv_bytes() if nbytes < 0 else self.buffer[start:start + nbytes]
        self._barrier()
        self.acks[self.reader] = n
        self.count = n
        return payload
