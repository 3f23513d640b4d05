"""The shared-memory ring that carries each step to the tensor-parallel workers
(tinypaged/distributed/shm_broadcast.py): every reader gets every message in order, through many
wraps of the ring; the writer never overwrites a slot a reader has not consumed; a payload larger
than a slot travels over the pipe; the file can be unlinked once mapped. (Across processes it
carries every step of tests/distributed/test_tp.py.)"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

import pytest

from tinypaged.distributed.shm_broadcast import NUM_SLOTS, SLOT_BYTES, ShmBroadcast


class Lagging(Exception):
    pass


def refuse_to_wait() -> None:
    raise Lagging


@pytest.fixture
def ring():
    writer = ShmBroadcast(2)
    readers = [ShmBroadcast.attach(writer.path, 2, r) for r in range(2)]
    writer.unlink()  # the mappings stay valid
    assert not os.path.exists(writer.path)
    pipes = [multiprocessing.Pipe() for _ in range(2)]
    yield writer, readers, pipes
    for a, b in pipes:
        a.close()
        b.close()


def test_every_reader_gets_every_message_in_order_across_wraps(ring):
    writer, readers, pipes = ring
    messages = [os.urandom(n) for n in (0, 1, 7, 100, 4096) * (3 * NUM_SLOTS)]
    got: list[list[bytes]] = [[], []]
    for i, message in enumerate(messages):
        writer.send(message, lambda r: pipes[r][0], refuse_to_wait)
        # reader 0 keeps up; reader 1 reads in bursts, NUM_SLOTS - 1 messages behind
        got[0].append(readers[0].recv(pipes[0][1]))
        if i % (NUM_SLOTS - 1) == NUM_SLOTS - 2:
            got[1] += [readers[1].recv(pipes[1][1]) for _ in range(NUM_SLOTS - 1)]
    got[1] += [readers[1].recv(pipes[1][1]) for _ in range(len(messages) - len(got[1]))]
    assert got == [messages, messages]


def test_the_writer_never_overwrites_an_unread_slot(ring):
    writer, readers, pipes = ring
    for i in range(NUM_SLOTS):
        writer.send(bytes([i]), lambda r: pipes[r][0], refuse_to_wait)
        assert readers[0].recv(pipes[0][1]) == bytes([i])
    with pytest.raises(Lagging):  # reader 1 has read nothing: every slot is still its
        writer.send(b"too soon", lambda r: pipes[r][0], refuse_to_wait)
    assert readers[1].recv(pipes[1][1]) == bytes([0])  # frees the oldest slot
    writer.send(b"now", lambda r: pipes[r][0], refuse_to_wait)
    expected = [bytes([i]) for i in range(1, NUM_SLOTS)] + [b"now"]
    assert [readers[1].recv(pipes[1][1]) for _ in range(NUM_SLOTS)] == expected
    assert readers[0].recv(pipes[0][1]) == b"now"


def test_a_payload_larger_than_a_slot_takes_the_pipe(ring):
    writer, readers, pipes = ring
    big = os.urandom(SLOT_BYTES + 1)
    got: list[list[bytes]] = [[], []]

    def read(r: int) -> None:  # as a worker would: the writer blocks until the pipe is read
        got[r] += [readers[r].recv(pipes[r][1]) for _ in range(2)]

    threads = [threading.Thread(target=read, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    writer.send(big, lambda r: pipes[r][0], refuse_to_wait)
    writer.send(b"small", lambda r: pipes[r][0], refuse_to_wait)
    for t in threads:
        t.join(10.0)
    assert got == [[big, b"small"], [big, b"small"]]
    assert not pipes[0][1].poll(0) and not pipes[1][1].poll(0)


def test_no_readers_is_a_ring_nobody_reads():
    writer = ShmBroadcast(0)  # a one-rank group
    writer.unlink()
    for i in range(3 * NUM_SLOTS):
        writer.send(bytes([i]), lambda r: None, refuse_to_wait)


def test_sleeping_readers_are_woken_by_the_writer(ring, monkeypatch):
    import tinypaged.distributed.shm_broadcast as shm

    monkeypatch.setattr(shm, "SPIN_S", 0.01)  # sleep on the pipe almost at once...
    monkeypatch.setattr(shm, "IDLE_POLL_S", 60.0)  # ...so that only the wake-up can end it
    writer, readers, pipes = ring
    messages = [b"first", os.urandom(SLOT_BYTES + 1), b"third"]  # one over the pipe
    got: list[list[bytes]] = [[], []]

    def read(r: int) -> None:
        for _ in messages:
            got[r].append(readers[r].recv(pipes[r][1]))

    threads = [threading.Thread(target=read, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for i, message in enumerate(messages):
        time.sleep(0.2)  # both readers are asleep on their pipes by now
        sent = time.monotonic()
        writer.send(message, lambda r: pipes[r][0], refuse_to_wait)
        while min(map(len, got)) <= i:
            assert time.monotonic() - sent < 5.0, "a sleeping reader was not woken"
            time.sleep(0.001)
    for t in threads:
        t.join(5.0)
    assert got == [messages, messages]
