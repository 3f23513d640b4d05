"""AsyncLLM: the engine behind an asyncio API, for the server and streaming clients.

One background thread owns the engine: only it ever touches the engine's state. The event loop
and the engine thread talk through queues, so a coroutine never waits for a step to end:

    event loop                                   engine thread
    generate(): tokenize + validate (a worker    between steps: drain the inbox (add the new
      thread), then inbox.put(("add", ...))  ->    requests, abort the cancelled ones), step,
    abort():    inbox.put(("abort", id))     ->    publish a stats snapshot
    per-request asyncio.Queue               <-   outputs (snapshots, never live lists) and
                                                   errors, via loop.call_soon_threadsafe

    engine = AsyncLLM()  # the default model
    async for out in engine.generate("Hi", SamplingParams(max_tokens=8), "req-1"):
        print(out.outputs[0].text)  # cumulative text so far

What can be checked without the engine's state (tokenizing, token ids and sampling fields against
the model) is checked before the hand-over and raised to the caller at once; what only the engine
thread can find (a duplicate request id, a prompt the KV cache can never hold) comes back through
the request's queue and is raised from the first `anext`. A failure inside one request ends that
request's stream with the exception; the loop goes on.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from typing import Any

from tinypaged.config import EngineConfig
from tinypaged.engine.client import EngineClient
from tinypaged.engine.engine import Engine, PromptType
from tinypaged.outputs import RequestOutput
from tinypaged.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

_Item = RequestOutput | BaseException


class AsyncLLM(EngineClient):
    def __init__(self, model: str | None = None, **kwargs: Any):
        self._init(Engine(EngineConfig.from_kwargs(model=model, **kwargs)))

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLM:
        self = cls.__new__(cls)
        self._init(Engine(config))
        return self

    def _init(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # ("add", ...) | ("abort", id)
        self._wake = threading.Event()
        self._stopped = False
        self._fatal: BaseException | None = None  # why the loop stopped by itself
        # request id -> (its caller's loop, its queue); read and written by the engine thread only
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stats = engine.get_stats()  # a fresh dict after every step: read without a lock
        self._thread = threading.Thread(target=self._loop, name="tinypaged-engine", daemon=True)
        self._thread.start()

    # The EngineClient interface (client.py): what the server, CLI and bench read.
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def default_sampling_params(self) -> dict:
        """SamplingParams defaults from the model's generation_config.json."""
        return self.engine.default_sampling_params

    @property
    def kv_cache_info(self) -> dict:
        return self.engine.kv_cache_info

    def get_stats(self) -> dict:
        """The engine's queue lengths and KV usage as of its last step (never blocks)."""
        return self._stats

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    async def generate(
        self, prompt: PromptType, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs of one request as tokens arrive; the last has finished=True.
        A request the engine refuses raises ValueError before the first output."""
        self._check_running()
        loop = asyncio.get_running_loop()
        prompt = await self._prepare(prompt, params)
        self._check_running()
        stream: asyncio.Queue = asyncio.Queue()
        self._send(("add", request_id, prompt, params, loop, stream))
        # Sent after the engine thread's last look at the inbox: nobody would ever answer.
        self._check_running()
        finished = False
        try:
            while True:
                item = await stream.get()
                # Only the newest output matters: skip intermediate ones that piled up.
                while not isinstance(item, BaseException) and not item.finished:
                    if stream.empty():
                        break
                    item = stream.get_nowait()
                if isinstance(item, BaseException):
                    finished = True  # the engine has already dropped the request
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._send(("abort", request_id))

    async def _prepare(self, prompt: PromptType, params: SamplingParams) -> Any:
        # Tokenizing a long prompt takes a while: a worker thread does it, not the event loop.
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.engine.prepare_prompt, prompt, params)

    async def abort(self, request_id: str) -> None:
        """Drop a request (at the engine's next step boundary); unknown ids are a no-op."""
        self._send(("abort", request_id))

    async def shutdown(self) -> None:
        """Stop the loop and the engine's worker processes; every unfinished stream ends with an
        error."""
        self._stopped = True
        self._wake.set()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self.engine.shutdown()

    def _check_running(self) -> None:
        if not self.is_running:
            why = f": {self._fatal}" if self._fatal is not None else ""
            raise RuntimeError(f"the engine is not running{why}")

    def _send(self, message: tuple) -> None:
        self._inbox.put(message)
        self._wake.set()

    # ------------------------------------------------------------------ engine thread

    def _drain_inbox(self) -> None:
        """Apply what the event loop sent since the last step, in order."""
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if message[0] == "abort":
                self._streams.pop(message[1], None)
                self.engine.abort_request(message[1])
                continue
            _, request_id, prompt, params, loop, stream = message
            if request_id in self._streams:
                error = ValueError(f"request_id {request_id!r} is already in use")
                self._post(loop, [(None, stream, error)])
                continue
            try:
                self.engine.add_request(request_id, prompt, params)
            except Exception as exc:  # noqa: BLE001 - the caller gets it (a 400 when ValueError)
                self._post(loop, [(None, stream, exc)])
                continue
            self._streams[request_id] = (loop, stream)

    def _deliver(self, items: list[tuple[str, _Item]]) -> None:
        """Hand outputs and errors to their streams: one thread-safe call per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, item in items:
            entry = self._streams.get(request_id)
            if entry is None:
                continue
            if isinstance(item, BaseException) or item.finished:
                self._streams.pop(request_id, None)
            by_loop.setdefault(entry[0], []).append((request_id, entry[1], item))
        for loop, batch in by_loop.items():
            self._post(loop, batch)

    def _post(self, loop: asyncio.AbstractEventLoop, batch: list[tuple]) -> None:
        """Put each (request id or None, queue, item) of `batch` on its queue, inside `loop`."""
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            for request_id, _, _ in batch:
                if request_id is not None:
                    self._streams.pop(request_id, None)
                    self._abort_in_engine(request_id)

    def _abort_in_engine(self, request_id: str) -> None:
        self.engine.abort_request(request_id)  # the engine thread only

    def _loop(self) -> None:
        while not self._stopped:
            self._drain_inbox()
            if not self.engine.has_unfinished_requests():
                self._stats = self.engine.get_stats()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a fault in the batch fails its requests, not the loop
                logger.exception("engine step failed; failing the requests in that step")
                failed = self.engine.fail_running()
                if self.engine.is_dead:  # a tensor-parallel rank is gone: stop for good
                    self._fatal, self._stopped = exc, True  # before the callers hear of it
                self._deliver([(rid, exc) for rid in failed])
                continue
            items: list[tuple[str, _Item]] = [(out.request_id, out) for out in outputs]
            self._deliver(items + self.engine.pop_request_errors())
            self._stats = self.engine.get_stats()
        error = self._fatal or RuntimeError("the engine was shut down")
        self._drain_inbox()
        for request_id in list(self._streams):
            self.engine.abort_request(request_id)
        self._deliver([(rid, error) for rid in list(self._streams)])
        self._stats = self.engine.get_stats()


def _put_all(batch: list[tuple[str | None, asyncio.Queue, _Item]]) -> None:
    for _, stream, item in batch:
        stream.put_nowait(item)
