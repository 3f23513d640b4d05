"""EngineCore: the one engine loop, run by a thread of the server's process or by a process of
its own (vLLM's EngineCore and EngineCoreProc).

The loop owns the Engine: nothing else touches its state. It does not know where it runs; only
the transport differs, and that lives in small clients (engine/core_client.py):

    AsyncLLM (the server's event loop)           EngineCore.run() (a thread, or a process)
    generate(): send(AddRequest)       ---->     between steps: apply what arrived, in order
    abort():    send(AbortRequest)     ---->       (add, abort; Shutdown ends the loop)
    shutdown(): send(Shutdown)         ---->     Engine.step(): schedule, run, sample,
                                                   detokenize, stop checks
    per-request asyncio.Queue          <----     one EngineStepOutput per step: outputs,
      (on_output, from a client thread)            errors, stats; EngineStopped at the end

    InprocClient   in: a queue.SimpleQueue;   out: the loop's thread calls on_output itself
    AsyncMPClient  in: writer thread -> pipe; out: pipe -> reader thread calls on_output;
                   the loop runs in a spawned process (`run_engine_core`)

Every request is validated in the same place in both modes: Engine.add_request, called by the
loop. A request it refuses (bad params, too long a prompt, a grammar that does not compile)
fails alone, with the same exception, wherever the loop runs. Errors are sent as they would
arrive through a pipe (`_portable`), so even their type is the same in both modes.

The engine process (`run_engine_core`) ignores SIGINT: the server drives the shutdown (Ctrl-C
reaches the whole process group). It exits when told to, or when the server's end of the pipe
closes (the server died). With the engine in a thread, its steps and the event loop's HTTP work
(JSON, SSE, one socket write per token and stream) take turns on one GIL and stretch each
other. `tinypaged serve` therefore runs the engine in a process on CUDA, in a thread otherwise,
and TINYPAGED_ENABLE_MULTIPROCESSING=0|1 decides instead when set (`use_engine_process`, as
vLLM's VLLM_ENABLE_V1_MULTIPROCESSING).
"""

from __future__ import annotations

import logging
import pickle
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tinypaged import envs
from tinypaged.engine.messages import (
    AbortRequest,
    EngineCoreOutput,
    EngineCoreRequest,
    EngineReady,
    EngineStepOutput,
    EngineStopped,
    Shutdown,
)
from tinypaged.gc_freeze import freeze_gc_heap

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from tinypaged.config import EngineConfig
    from tinypaged.engine.engine import Engine
    from tinypaged.outputs import RequestOutput

logger = logging.getLogger(__name__)


def use_engine_process(device: str | None) -> bool:
    """Whether `serve` runs the engine in its own process: TINYPAGED_ENABLE_MULTIPROCESSING=0|1,
    else when the engine runs on CUDA (a CPU engine is slow enough that its GIL share hardly
    matters, and starting a process costs seconds). `device`: the engine's, None = default."""
    flag = envs.TINYPAGED_ENABLE_MULTIPROCESSING
    if flag is not None:
        return flag
    if device is not None:
        return device.startswith("cuda")
    import torch

    return torch.cuda.device_count() > 0  # NVML: does not initialize CUDA in this process


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any exception type may refuse
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class EngineCore:
    """The engine loop. `recv(block)` returns the next message, or None when `block` is False
    and none is waiting; it raises EOFError when the sending side is gone. `send` takes every
    output message, EngineStopped last."""

    def __init__(
        self,
        engine: Engine,
        recv: Callable[[bool], EngineCoreRequest | None],
        send: Callable[[EngineCoreOutput], None],
    ):
        self.engine = engine
        self.recv = recv
        self.send = send
        self._prompt_sent: set[str] = set()  # requests whose prompt went out in an output

    def run(self) -> None:
        """Step until a Shutdown arrives, the sending side is gone or a tensor-parallel rank
        died; then drop the open requests, stop the engine's workers and send EngineStopped."""
        engine = self.engine
        error: BaseException | None = None
        try:
            while True:
                errors: list[tuple[str, BaseException]] = []
                if not self._apply_messages(errors):
                    break
                outputs: list[RequestOutput] = []
                if engine.has_unfinished_requests():
                    try:
                        outputs = engine.step()
                    except Exception as exc:  # a fault in the batch fails its requests only
                        logger.exception("engine step failed; failing the requests in that step")
                        errors += [(rid, exc) for rid in engine.fail_running()]
                        if engine.is_dead:  # a tensor-parallel rank is gone: stop for good
                            error = exc
                            break
                    errors += engine.pop_request_errors()
                # Idle after this step: send the stats even when nothing moved (an abort).
                if outputs or errors or not engine.has_unfinished_requests():
                    self.send(self._step_output(outputs, errors))
        except EOFError:
            pass  # the server's end of the pipe closed: nobody is listening any more
        except BaseException as exc:  # noqa: BLE001 - a bug here must not leave streams waiting
            logger.exception("the engine loop failed")
            error = exc
        finally:
            stats = None
            try:
                for request_id in list(engine.requests):  # frees their KV blocks
                    engine.abort_request(request_id)
                stats = engine.get_stats()
            finally:
                engine.shutdown()
                self.send(EngineStopped(None if error is None else _portable(error), stats))

    def _apply_messages(self, errors: list[tuple[str, BaseException]]) -> bool:
        """Apply every message that arrived since the last step, in order, waiting for the
        first one when the engine is idle. Refused adds go to `errors`. False at a Shutdown."""
        block = not self.engine.has_unfinished_requests()
        while (message := self.recv(block)) is not None:
            block = False
            if isinstance(message, Shutdown):
                return False
            self._prompt_sent.discard(message.request_id)
            if isinstance(message, AbortRequest):
                self.engine.abort_request(message.request_id)
                continue
            try:
                self.engine.add_request(message.request_id, message.prompt, message.params,
                                        message.lora_request)
            except Exception as exc:  # noqa: BLE001 - the caller gets it (a 400 when ValueError)
                errors.append((message.request_id, exc))
        return True

    def _step_output(
        self, outputs: list[RequestOutput], errors: list[tuple[str, BaseException]]
    ) -> EngineStepOutput:
        """The step's message: each prompt only in its request's first output (messages.py),
        errors that pickle."""
        sent = self._prompt_sent
        for out in outputs:
            if out.request_id in sent:
                out.prompt, out.prompt_token_ids = None, None
            else:
                sent.add(out.request_id)
            if out.finished:
                sent.discard(out.request_id)
        for request_id, _ in errors:
            sent.discard(request_id)
        return EngineStepOutput(
            outputs, [(rid, _portable(e)) for rid, e in errors], self.engine.get_stats()
        )


def run_engine_core(config: EngineConfig, inbox: Connection, outbox: Connection) -> None:
    """The engine process's main (AsyncMPClient spawns it): build the engine, send EngineReady
    (or EngineStopped with the reason it could not start), then run the loop on the pipes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when this process ends
    from tinypaged.engine.pooling_engine import create_engine

    try:
        engine = create_engine(config)
    except BaseException as exc:  # noqa: BLE001 - the server reports it and exits
        outbox.send(EngineStopped(_portable(exc)))
        return
    freeze_gc_heap()  # this process lives as long as the engine (gc_freeze.py)
    outbox.send(EngineReady.of(engine))

    def recv(block: bool) -> Any:
        return inbox.recv() if block or inbox.poll() else None

    def send(message: EngineCoreOutput) -> None:
        try:
            outbox.send(message)
        except OSError:
            pass  # the server is gone; the next recv ends the loop (EOFError)

    EngineCore(engine, recv, send).run()
