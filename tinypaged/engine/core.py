"""The engine in a process of its own (vLLM's EngineCoreProc and AsyncMPClient), for the server.

With the engine in a thread of the server's process (AsyncLLM), its steps and the event loop's
HTTP work (JSON, SSE, one socket write per token and stream) take turns on one GIL: every torch
op and kernel launch releases it, the event loop grabs it, and the step's host work stretches by
what the loop does meanwhile. At tens of streams that costs the GPU its overlap. Here the engine
runs in a child process and the server's process keeps only the streams:

    server process                                  engine process (spawned)
    generate(): inbox.put(("add", ...))  writer ->  pipe -> between steps: add / abort
    abort():    inbox.put(("abort", id)) thread     Engine.step() (schedule, run, sample,
    per-request asyncio.Queue  <- reader thread <-  pipe <- detokenize, stop checks)
                                                    one message per step: outputs, errors,
                                                    stats

Two pipes and two threads, so neither side can block the other: the writer may wait for the
engine to read, the reader always drains the outputs. A request's prompt ids travel back only
in its first output (the server's copy fills the rest). The engine process ignores SIGINT: the
server drives the shutdown (Ctrl-C reaches the whole process group); it exits when told to, or
when the server's end of the pipe closes (the server died). A dead engine process fails every
open stream and makes `is_running` false (/health answers 503).

`AsyncMPClient` is an AsyncLLM (the same generate / abort / streams), only the engine is
elsewhere; `tinypaged serve` uses it when the engine runs on CUDA (as vLLM,
TINYPAGED_ENABLE_MULTIPROCESSING=0|1 decides otherwise).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import pickle
import queue
import signal
import threading
from typing import Any

from tinypaged import envs
from tinypaged.config import EngineConfig
from tinypaged.engine.async_llm import AsyncLLM
from tinypaged.gc_freeze import freeze_gc_heap

logger = logging.getLogger(__name__)

STARTUP_CHECK_S = 1.0  # how often the server checks that a starting engine process still lives
SHUTDOWN_TIMEOUT_S = 30.0


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


def run_engine_core(config: EngineConfig, inbox: Any, outbox: Any) -> None:
    """The engine process: build the engine, then step while there is work, reading adds and
    aborts between steps and sending one ("step", outputs, errors, stats) message per step."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from tinypaged.engine.engine import Engine

    try:
        engine = Engine(config)
    except BaseException as exc:  # noqa: BLE001 - the server reports it and exits
        outbox.send(("failed", _portable(exc)))
        return
    freeze_gc_heap()  # this process lives as long as the engine (gc_freeze.py)
    outbox.send(("ready", {
        "config": engine.config, "model_name": engine.model_name,
        "model_dir": str(engine.model_dir), "kv_cache_info": engine.kv_cache_info,
        "default_sampling_params": engine.default_sampling_params, "stats": engine.get_stats(),
    }))
    prompt_sent: set[str] = set()
    try:
        while True:
            if not engine.has_unfinished_requests():
                inbox.poll(None)  # idle until a message (or EOF: the server is gone)
            errors: list[tuple[str, BaseException]] = []
            while inbox.poll():
                message = inbox.recv()
                if message[0] == "shutdown":
                    return
                if message[0] == "abort":
                    engine.abort_request(message[1])
                    prompt_sent.discard(message[1])
                    continue
                _, request_id, prompt, params = message
                try:
                    engine.add_request(request_id, prompt, params)
                except Exception as exc:  # noqa: BLE001 - that request's caller gets it
                    errors.append((request_id, _portable(exc)))
            outputs = []
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception as exc:  # a fault in the batch fails its requests only
                    logger.exception("engine step failed; failing the requests in that step")
                    exc = _portable(exc)
                    errors += [(rid, exc) for rid in engine.fail_running()]
                    if engine.is_dead:  # a tensor-parallel rank is gone: stop for good
                        outbox.send(("dead", exc, errors))
                        return
                errors += [(rid, _portable(e)) for rid, e in engine.pop_request_errors()]
            for out in outputs:  # the server holds the prompt after the first output
                if out.request_id in prompt_sent:
                    out.prompt, out.prompt_token_ids = None, None
                else:
                    prompt_sent.add(out.request_id)
                if out.finished:
                    prompt_sent.discard(out.request_id)
            for request_id, _ in errors:
                prompt_sent.discard(request_id)
            if outputs or errors or not engine.has_unfinished_requests():
                outbox.send(("step", outputs, errors, engine.get_stats()))
    except (EOFError, OSError):
        pass  # the server's end of a pipe closed: it is gone
    finally:
        engine.shutdown()


class AsyncMPClient(AsyncLLM):
    """AsyncLLM whose engine runs in a spawned process (see the module's docstring)."""

    def __init__(self, model: str | None = None, **kwargs: Any):
        self._start(EngineConfig.from_kwargs(model=model, **kwargs))

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncMPClient:
        self = cls.__new__(cls)
        self._start(config)
        return self

    def _start(self, config: EngineConfig) -> None:
        ctx = mp.get_context("spawn")  # no CUDA, threads or locks inherited
        core_inbox, self._to_core = ctx.Pipe(duplex=False)
        self._from_core, core_outbox = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=run_engine_core, args=(config, core_inbox, core_outbox),
                                 name="tinypaged-engine-core", daemon=True)
        self._proc.start()
        core_inbox.close()
        core_outbox.close()
        try:
            while not self._from_core.poll(STARTUP_CHECK_S):
                if not self._proc.is_alive():
                    raise EOFError
            kind, info = self._from_core.recv()
        except EOFError:
            self._proc.join()
            raise RuntimeError(f"the engine process exited during startup (exit code "
                               f"{self._proc.exitcode}); its error is in the log above") from None
        except BaseException:
            self._proc.kill()
            raise
        if kind == "failed":
            self._proc.join()
            raise info
        self._config: EngineConfig = info["config"]
        self._model_name: str = info["model_name"]
        self._kv_cache_info: dict = info["kv_cache_info"]
        self._defaults: dict = info["default_sampling_params"]
        self._tokenizer = None
        if not self._config.skip_tokenizer_init:
            from tinypaged.tokenizer.tokenizer import load_tokenizer, tokenizer_path

            self._tokenizer = load_tokenizer(
                tokenizer_path(self._config.tokenizer, info["model_dir"]),
                chat_template=self._config.chat_template,
            )
        self._stats = info["stats"]
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = False
        self._fatal: BaseException | None = None
        self._streams: dict = {}  # request id -> (its loop, its queue)
        self._prompts: dict[str, tuple[str | None, list[int]]] = {}  # for outputs without one
        self._writer = threading.Thread(target=self._write, name="tinypaged-to-core",
                                        daemon=True)
        self._thread = threading.Thread(target=self._read, name="tinypaged-from-core",
                                        daemon=True)
        self._writer.start()
        self._thread.start()

    tokenizer = property(lambda self: self._tokenizer)
    config = property(lambda self: self._config)
    model_name = property(lambda self: self._model_name)
    default_sampling_params = property(lambda self: self._defaults)
    kv_cache_info = property(lambda self: self._kv_cache_info)

    async def _prepare(self, prompt: Any, params: Any) -> Any:
        return prompt  # the engine process tokenizes and checks it when it adds the request

    def _send(self, message: tuple) -> None:
        self._inbox.put(message)

    def _abort_in_engine(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    async def shutdown(self) -> None:
        """Stop the engine process (its tensor-parallel workers with it); every unfinished
        stream ends with an error."""
        import asyncio

        self._stopped = True
        self._inbox.put(("shutdown",))
        run = asyncio.get_running_loop().run_in_executor
        await run(None, self._proc.join, SHUTDOWN_TIMEOUT_S)
        if self._proc.is_alive():
            logger.warning("the engine process did not stop in %gs: killing it",
                           SHUTDOWN_TIMEOUT_S)
            self._proc.kill()
            await run(None, self._proc.join)
        await run(None, self._thread.join)
        await run(None, self._writer.join)

    # ------------------------------------------------------------------ the two threads

    def _write(self) -> None:
        """Forward the event loop's messages to the engine process, registering each stream
        before its request can produce an output."""
        while True:
            message = self._inbox.get()
            try:
                if message[0] == "add":
                    _, request_id, prompt, params, loop, stream = message
                    if request_id in self._streams:
                        error = ValueError(f"request_id {request_id!r} is already in use")
                        self._post(loop, [(None, stream, error)])
                        continue
                    self._streams[request_id] = (loop, stream)
                    message = ("add", request_id, prompt, params)
                elif message[0] == "abort":
                    self._streams.pop(message[1], None)
                    self._prompts.pop(message[1], None)
                self._to_core.send(message)
            except (OSError, ValueError):  # the engine process is gone: the reader reports it
                pass
            except Exception as exc:  # noqa: BLE001 - e.g. a field that does not pickle
                entry = self._streams.pop(message[1], None) if message[0] == "add" else None
                if entry is not None:  # that request fails; the others go on
                    self._post(entry[0], [(None, entry[1], exc)])
            if message[0] == "shutdown":
                return

    def _read(self) -> None:
        """Hand each step's outputs and errors to their streams; on EOF fail them all."""
        try:
            while True:
                message = self._from_core.recv()
                if message[0] == "dead":
                    self._fatal, self._stopped = message[1], True
                    self._deliver(message[2])
                    break
                _, outputs, errors, self._stats = message
                items: list = []
                for out in outputs:
                    if out.prompt_token_ids is None:
                        held = self._prompts.get(out.request_id)
                        if held is None:  # aborted since: nobody reads it any more
                            continue
                        out.prompt, out.prompt_token_ids = held
                    elif not out.finished:
                        self._prompts[out.request_id] = (out.prompt, out.prompt_token_ids)
                    if out.finished:
                        self._prompts.pop(out.request_id, None)
                    items.append((out.request_id, out))
                for request_id, _ in errors:
                    self._prompts.pop(request_id, None)
                self._deliver(items + errors)
        except (EOFError, OSError):
            if not self._stopped:
                self._proc.join(1.0)  # its exit code, when it has one
                self._fatal = RuntimeError(
                    f"the engine process exited (exit code {self._proc.exitcode}); see the log")
                logger.error("%s", self._fatal)
        except Exception as exc:  # a bug here must not leave the streams waiting forever
            logger.exception("reading the engine process's outputs failed")
            self._fatal = exc
        self._stopped = True
        error = self._fatal or RuntimeError("the engine was shut down")
        self._deliver([(rid, error) for rid in list(self._streams)])
