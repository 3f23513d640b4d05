"""Ctrl-C while rank 0 waits in a collective for a worker that does not come.

Python runs a signal's handler in the main thread, between two bytecodes. While rank 0's main
thread waits inside a gloo collective (or, behind an NCCL one, inside a CUDA synchronization)
for a peer that is alive but stuck (stopped, deadlocked, far behind), no bytecode runs and the
KeyboardInterrupt of a Ctrl-C waits as long as the collective does (its timeout: minutes).

The interpreter's C-level handler, though, writes the signal's number to the wakeup fd
(`signal.set_wakeup_fd`) the moment the signal arrives. A thread of ours reads it. On SIGINT,
while Python's own KeyboardInterrupt handler is installed and a step runs in the main thread,
the step gets GRACE_S to end by itself: a healthy one does within milliseconds, the
KeyboardInterrupt surfaces, and the executor stops its workers in order. A step still running
after that calls the executor's `on_stuck`, which kills the workers: the collective then fails
(gloo: the peer's sockets close; NCCL: the executor's watchdog aborts the communicators when it
sees a worker die), the main thread runs bytecode again, and the KeyboardInterrupt surfaces.
Either way the step was lost (a step cut short on one rank leaves the ranks out of step), so
this only ends sooner what the KeyboardInterrupt ends anyway.

    watch = StepWatch(on_stuck)   # in the main thread; inert where it cannot watch
    token = watch.begin()         # around each call that may wait in a collective
    ...
    watch.end(token)

The wakeup fd is the process's one: it is taken only from the main thread and only while no one
else holds it (an asyncio loop's signal handlers do); without it steps are not watched. A
KeyboardInterrupt handler replaced by the application (a server's graceful shutdown), or a step
run in another thread, is left alone.
"""

from __future__ import annotations

import signal
import socket
import threading
import weakref
from collections.abc import Callable

GRACE_S = 1.0  # how long an interrupted step may take to end by itself

_watches: weakref.WeakSet[StepWatch] = weakref.WeakSet()
_writer: socket.socket | None = None  # the wakeup fd's socket, once made (kept for good)


def _read(reader: socket.socket) -> None:
    while data := reader.recv(64):  # one byte per signal that has a Python handler
        if signal.SIGINT in data and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            for watch in list(_watches):
                watch.interrupted()


def _listen() -> bool:
    """Make the wakeup fd ours (main thread only) unless someone else holds it; start the
    thread that reads it (once). True when SIGINTs will reach the watches."""
    global _writer
    if threading.current_thread() is not threading.main_thread():
        return _writer is not None  # cannot be checked from here
    if _writer is None:
        reader, _writer = socket.socketpair()
        _writer.setblocking(False)  # the interpreter requires it: a full buffer must not block
        threading.Thread(target=_read, args=(reader,), name="tinypaged-sigint-watch",
                         daemon=True).start()
    previous = signal.set_wakeup_fd(_writer.fileno(), warn_on_full_buffer=False)
    if previous not in (-1, _writer.fileno()):  # an event loop's: give it back, do without
        signal.set_wakeup_fd(previous)
        return False
    return True


class StepWatch:
    """Calls `on_stuck()` (from its own thread) when a step of the main thread is still running
    GRACE_S after a Ctrl-C."""

    def __init__(self, on_stuck: Callable[[], None]) -> None:
        self.on_stuck = on_stuck
        self.step: object | None = None  # the token of the main thread's step in flight
        if _listen():
            _watches.add(self)

    def begin(self) -> object | None:
        if threading.current_thread() is not threading.main_thread():
            return None
        self.step = token = object()
        return token

    def end(self, token: object | None) -> None:
        if token is not None:
            self.step = None

    def interrupted(self) -> None:
        token = self.step
        if token is None:
            return

        def check() -> None:
            if self.step is token:
                self.on_stuck()

        timer = threading.Timer(GRACE_S, check)
        timer.daemon = True
        timer.start()
