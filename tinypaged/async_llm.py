"""AsyncLLM: the engine behind an asyncio API, for the server and streaming clients.

One background thread owns the engine loop: it steps while there is work and sleeps on an event
when there is none. Coroutines submit and abort under a lock (so submission errors are raised
to the caller at once) and receive their outputs through per-request asyncio queues, fed from
the engine thread with `loop.call_soon_threadsafe`.

    engine = AsyncLLM()  # the default model
    async for out in engine.generate("Hi", SamplingParams(max_tokens=8), "req-1"):
        print(out.outputs[0].text)  # cumulative text so far

A failure inside one request ends that request's stream with the exception; the loop goes on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from tinypaged.config import EngineConfig
from tinypaged.engine import Engine, PromptType
from tinypaged.outputs import RequestOutput
from tinypaged.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLM:
    def __init__(self, model: str | None = None, **kwargs: Any):
        self._init(Engine(EngineConfig.from_kwargs(model=model, **kwargs)))

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLM:
        self = cls.__new__(cls)
        self._init(Engine(config))
        return self

    def _init(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self._fatal: BaseException | None = None  # why the loop stopped by itself
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._loop, name="tinypaged-engine", daemon=True)
        self._thread.start()

    # What the server reads.
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
        return self.engine.get_stats()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    async def generate(
        self, prompt: PromptType, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs of one request as tokens arrive; the last has finished=True."""
        if not self.is_running:
            why = f": {self._fatal}" if self._fatal is not None else ""
            raise RuntimeError(f"the engine is not running{why}")
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self.engine.add_request(request_id, prompt, params)
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
        self._wake.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                # Only the newest output matters: skip intermediate ones that piled up.
                while not item.finished and not queue.empty():
                    nxt = queue.get_nowait()
                    if isinstance(nxt, BaseException):
                        raise nxt
                    item = nxt
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._abort_now(request_id)

    async def abort(self, request_id: str) -> None:
        self._abort_now(request_id)

    def _abort_now(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)

    async def shutdown(self) -> None:
        """Stop the loop and the engine's worker processes; every unfinished stream ends with an
        error."""
        self._stopped = True
        self._wake.set()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self.engine.shutdown()

    # ------------------------------------------------------------------ engine thread

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        loop, queue = stream
        if isinstance(item, BaseException) or item.finished:
            self._streams.pop(request_id, None)
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            self.engine.abort_request(request_id)

    def _loop(self) -> None:
        while not self._stopped:
            if not self.engine.has_unfinished_requests():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            with self._lock:
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # a fault in the batch fails its requests, not the loop
                    logger.exception("engine step failed; failing the requests in that step")
                    for request_id in self.engine.fail_running(exc):
                        self._deliver(request_id, exc)
                    if self.engine.is_dead:  # a tensor-parallel rank is gone: stop for good
                        self._fatal, self._stopped = exc, True
                    continue
                for out in outputs:
                    self._deliver(out.request_id, out)
                for request_id, exc in self.engine.pop_request_errors():
                    self._deliver(request_id, exc)
        with self._lock:
            error = self._fatal or RuntimeError("the engine was shut down")
            for request_id in list(self._streams):
                self.engine.abort_request(request_id)
                self._deliver(request_id, error)
