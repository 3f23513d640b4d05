"""One writer, N readers: the engine's steps to its tensor-parallel workers through shared memory.

Over a pipe, each step costs a write() system call per worker and, on the worker's side, a wake-up
from a blocking read (the scheduler's latency: tens of microseconds, more on a busy host). Here
rank 0 writes the step once into a ring of slots in a file under /dev/shm that every rank maps,
and each worker, which polls while it waits, sees it within microseconds (the idea of vLLM's
shm_broadcast MessageQueue).

    [ reader r: int64 ack, int64 sleeping, ... (its own 64-byte line) ] for r in 0..N-1
    [ slot 0: int64 seq, int64 nbytes, ... (64 bytes), payload (SLOT_BYTES) ]
    [ slot 1 ] ... [ slot NUM_SLOTS - 1 ]

Message n (1, 2, ...) goes to slot (n - 1) % NUM_SLOTS. The writer waits until every reader's ack
is >= n - NUM_SLOTS (the slot's previous message is consumed), writes the payload and its
length, then publishes by writing seq = n last. A reader waiting for message n polls slot seq
until it reads n, copies the payload out, then writes its ack = n. Stores become visible in
program order on x86 (TSO); the lock round trip before each publish and after each read is a
full memory barrier elsewhere. A payload larger than a slot travels over the pipe instead, its
slot saying so with nbytes = -1.

Waiting. A reader yields the core (os.sched_yield) between polls for up to SPIN_S, longer than
a GPU step, so that a busy engine's steps arrive within microseconds. Then it sets its sleeping
flag and blocks on its pipe; the writer, after publishing, sends an empty wake-up message to
every reader whose flag it sees. (Reader: flag, barrier, check seq; writer: seq, barrier, check
flag: at least one of them sees the other's store, so no wake-up is lost.) An idle engine's
workers thus cost no CPU, and a wake-up costs one pipe message only after an idle spell.
Polling needs a free core per worker (as on a GPU host): where ranks outnumber free cores, a
blocking read wins (benchmarks/RESULTS-log.md names the script that measured both).
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

NUM_SLOTS = 4
SLOT_BYTES = 1 << 20  # a decode step of 256 sequences is ~150 KiB; larger steps take the pipe
LINE = 64  # bytes: one cache line per reader and per slot header, never shared by two writers
SPIN_S = 0.1  # how long a waiting reader polls before it sleeps on its pipe
IDLE_POLL_S = 1.0  # a sleeping reader re-checks this often all the same


class ShmBroadcast:
    """Create it in rank 0 with the number of readers; pass `path` to each reader, which calls
    `ShmBroadcast.attach(path, num_readers, reader)`; rank 0 `unlink()`s the file once all have
    attached."""

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
        self.words = memoryview(self.buffer).cast("q")  # the whole file as int64 words
        self.ack_words = [r * LINE // 8 for r in range(num_readers)]  # reader r's ack
        base = LINE * num_readers
        self.slot_offsets = [base + i * (LINE + SLOT_BYTES) for i in range(NUM_SLOTS)]
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
        offset = self.slot_offsets[(n - 1) % NUM_SLOTS]
        words = self.words
        while any(words[a] < n - NUM_SLOTS for a in self.ack_words):
            check()
            os.sched_yield()
        fits = len(payload) <= SLOT_BYTES
        if fits:
            self.buffer[offset + LINE:offset + LINE + len(payload)] = payload
        words[offset // 8 + 1] = len(payload) if fits else -1
        self._barrier()
        words[offset // 8] = n  # publish
        self.count = n
        self._barrier()
        for r, a in enumerate(self.ack_words):
            if words[a + 1]:  # asleep on its pipe: wake it
                conn_of(r).send_bytes(b"")
        if not fits:  # after publishing (and any wake-up): readers read the pipe in order
            for r in range(self.num_readers):
                conn_of(r).send_bytes(payload)

    def recv(self, conn: Connection) -> bytes:
        """The next message (reader side), waiting as long as it takes."""
        n = self.count + 1
        offset = self.slot_offsets[(n - 1) % NUM_SLOTS]
        words, seq, ack = self.words, offset // 8, self.ack_words[self.reader]
        began = time.monotonic()
        while words[seq] != n:
            if time.monotonic() - began < SPIN_S:
                os.sched_yield()
                continue
            words[ack + 1] = 1  # sleeping
            self._barrier()
            # Until message n is published only empty wake-ups can be in the pipe.
            if words[seq] != n and conn.poll(IDLE_POLL_S):
                conn.recv_bytes()
            words[ack + 1] = 0
        self._barrier()
        nbytes = words[seq + 1]
        if nbytes < 0:
            while not (payload := conn.recv_bytes()):  # skip wake-ups that came late
                pass
        else:
            payload = self.buffer[offset + LINE:offset + LINE + nbytes]
        self._barrier()
        words[ack] = n
        self.count = n
        return payload
