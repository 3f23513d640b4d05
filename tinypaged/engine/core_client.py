"""The transport between AsyncLLM and the engine loop (EngineCore): one interface, two clients
(vLLM's EngineCoreClient, InprocClient and AsyncMPClient).

    InprocClient   the loop in a thread of this process. Messages go in through a
                   queue.SimpleQueue; the loop's thread hands each output to on_output itself.
    AsyncMPClient  the loop in a spawned process (`run_engine_core`). Two pipes and two threads
                   here, so neither side can block the other: the writer may wait for the
                   engine to read, the reader always drains the outputs.

What AsyncLLM may rely on, whichever it got from `make_client`:

    client.ready             EngineReady: config, model name, KV cache layout, defaults, stats
    client.tokenizer         the model's tokenizer (None with skip_tokenizer_init)
    client.start(on_output)  from now on every output message goes to on_output, from a thread
                             of the client's; EngineStopped comes last, exactly once
    client.send(message)     never blocks: the event loop calls it
    client.shutdown()        Shutdown, then wait for the loop to end (blocks)
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tinypaged.engine.core import EngineCore, run_engine_core
from tinypaged.engine.messages import (
    AddRequest,
    EngineCoreOutput,
    EngineCoreRequest,
    EngineReady,
    EngineStepOutput,
    EngineStopped,
    Shutdown,
)

if TYPE_CHECKING:
    from tinypaged.config import EngineConfig
    from tinypaged.engine.engine import Engine

logger = logging.getLogger(__name__)

STARTUP_CHECK_S = 1.0  # how often we check that a starting engine process still lives
SHUTDOWN_TIMEOUT_S = 30.0

OnOutput = Callable[[EngineCoreOutput], None]


class EngineCoreClient(ABC):
    """Where the engine loop runs and how messages reach it (see the module's docstring)."""

    ready: EngineReady
    tokenizer: Any
    engine: Engine | None = None  # the Engine itself, when it lives in this process

    @abstractmethod
    def start(self, on_output: OnOutput) -> None:
        """Start delivering output messages to `on_output`."""

    @abstractmethod
    def send(self, message: EngineCoreRequest) -> None:
        """Hand a message to the loop; never blocks."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the loop and wait for it (idempotent)."""


def make_client(config: EngineConfig, multiprocess_mode: bool) -> EngineCoreClient:
    """The engine loop in a spawned process (`multiprocess_mode`) or in a thread of this one."""
    if config.data_parallel_size > 1:
        raise ValueError("AsyncLLM runs one engine: for data_parallel_size > 1 use "
                         "tinypaged.dp.client.DPAsyncLLM (what `serve -dp N` does)")
    if multiprocess_mode:
        return AsyncMPClient(config)
    from tinypaged.engine.pooling_engine import create_engine

    return InprocClient(create_engine(config))


class InprocClient(EngineCoreClient):
    """The engine loop in a thread of this process."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.ready = EngineReady.of(engine)
        self.tokenizer = engine.tokenizer
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None

    def start(self, on_output: OnOutput) -> None:
        core = EngineCore(self.engine, self._recv, on_output)
        self.thread = threading.Thread(target=core.run, name="tinypaged-engine", daemon=True)
        self.thread.start()

    def _recv(self, block: bool) -> EngineCoreRequest | None:
        try:
            return self._inbox.get(block)
        except queue.Empty:
            return None

    def send(self, message: EngineCoreRequest) -> None:
        self._inbox.put(message)

    def shutdown(self) -> None:
        self._inbox.put(Shutdown())
        if self.thread is not None:
            self.thread.join()


class AsyncMPClient(EngineCoreClient):
    """The engine loop in a spawned process; returns once the engine there is built."""

    def __init__(self, config: EngineConfig, env: dict[str, str] | None = None):
        """`env`: variables set in the engine process before anything else (dp/ gives each
        engine its CUDA_VISIBLE_DEVICES)."""
        ctx = mp.get_context("spawn")  # no CUDA, threads or locks inherited
        core_inbox, self._to_core = ctx.Pipe(duplex=False)
        self._from_core, core_outbox = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_run_engine_core_in, args=(env or {}, config, core_inbox,
                                                                  core_outbox),
                                name="tinypaged-engine-core", daemon=True)
        self.proc.start()
        core_inbox.close()
        core_outbox.close()
        self.ready = self._wait_until_ready()
        self.tokenizer = None
        if not self.ready.config.skip_tokenizer_init:  # our own copy, to tokenize chat turns
            from tinypaged.tokenizer.tokenizer import load_tokenizer, tokenizer_path

            self.tokenizer = load_tokenizer(
                tokenizer_path(self.ready.config.tokenizer, self.ready.model_dir),
                chat_template=self.ready.config.chat_template,
            )
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # drained by the writer
        self._closing = False
        self.writer: threading.Thread | None = None
        self.reader: threading.Thread | None = None

    def _wait_until_ready(self) -> EngineReady:
        try:
            while not self._from_core.poll(STARTUP_CHECK_S):
                if not self.proc.is_alive():
                    raise EOFError
            message = self._from_core.recv()
        except EOFError:
            self.proc.join()
            raise RuntimeError(f"the engine process exited during startup (exit code "
                               f"{self.proc.exitcode}); its error is in the log above") from None
        except BaseException:
            self.proc.kill()
            raise
        if isinstance(message, EngineStopped):  # the engine could not be built
            self.proc.join()
            raise message.error
        return message

    def start(self, on_output: OnOutput) -> None:
        self.writer = threading.Thread(target=self._write, args=(on_output,),
                                       name="tinypaged-to-core", daemon=True)
        self.reader = threading.Thread(target=self._read, args=(on_output,),
                                       name="tinypaged-from-core", daemon=True)
        self.writer.start()
        self.reader.start()

    def send(self, message: EngineCoreRequest) -> None:
        self._outbox.put(message)

    def shutdown(self) -> None:
        self._closing = True
        self._outbox.put(Shutdown())
        self.proc.join(SHUTDOWN_TIMEOUT_S)
        if self.proc.is_alive():
            logger.warning("the engine process did not stop in %gs: killing it",
                           SHUTDOWN_TIMEOUT_S)
            self.proc.kill()
            self.proc.join()
        for thread in (self.reader, self.writer):
            if thread is not None:
                thread.join()

    def _write(self, on_output: OnOutput) -> None:
        """Forward the queued messages to the engine process until the Shutdown."""
        while True:
            message = self._outbox.get()
            try:
                self._to_core.send(message)
            except OSError:
                pass  # the engine process is gone: the reader reports it
            except Exception as exc:  # noqa: BLE001 - it did not pickle: that request fails
                if isinstance(message, AddRequest):
                    on_output(EngineStepOutput([], [(message.request_id, exc)], None))
            if isinstance(message, Shutdown):
                return

    def _read(self, on_output: OnOutput) -> None:
        """Hand every message of the engine process to on_output; when its pipe ends without
        an EngineStopped (the process died), make one."""
        try:
            while True:
                message = self._from_core.recv()
                on_output(message)
                if isinstance(message, EngineStopped):
                    return
        except (EOFError, OSError):
            error = None
            if not self._closing:
                self.proc.join(1.0)  # its exit code, when it has one
                error = RuntimeError(
                    f"the engine process exited (exit code {self.proc.exitcode}); see the log")
                logger.error("%s", error)
        except Exception as exc:  # noqa: BLE001 - a bug must not leave the streams waiting
            logger.exception("reading the engine process's outputs failed")
            error = exc
        on_output(EngineStopped(error))


def _run_engine_core_in(env: dict[str, str], config: EngineConfig, inbox, outbox) -> None:
    """run_engine_core with `env` set first (before CUDA reads CUDA_VISIBLE_DEVICES)."""
    os.environ.update(env)
    run_engine_core(config, inbox, outbox)
