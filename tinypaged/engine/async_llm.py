"""AsyncLLM: the engine behind an asyncio API, for the server and streaming clients.

The engine runs its own loop (EngineCore, engine/core.py), in a thread of this process or in a
process of its own (`multiprocess_mode`, what `tinypaged serve` picks on CUDA); a client of
engine/core_client.py carries the typed messages (engine/messages.py) between here and there.
AsyncLLM itself is the same in both modes. A coroutine never waits for a step to end:

    event loop                                      engine loop (thread or process)
    generate(): register the request's queue,
                send AddRequest                -->  between steps: add (tokenize, validate),
    abort():    forget the queue, AbortRequest -->    abort; then Engine.step()
    per-request asyncio.Queue                 <--   one EngineStepOutput per step: outputs
      (loop.call_soon_threadsafe, one call            (snapshots, never live lists), errors,
       per step and event loop)                       stats; EngineStopped at the end

    engine = AsyncLLM()  # the default model, its loop in a thread
    async for out in engine.generate("Hi", SamplingParams(max_tokens=8), "req-1"):
        print(out.outputs[0].text)  # cumulative text so far

A request the engine refuses (a duplicate request id here; bad params, too long a prompt or a
grammar that does not compile in the engine loop) raises from the first `anext` of its stream,
with the same exception in both modes. A failure inside one request ends that request's stream
with the exception; the loop goes on. When the loop ends (shutdown, or a tensor-parallel rank
died, or the engine process exited) every open stream fails and `is_running` turns False.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tinypaged.config import EngineConfig
from tinypaged.engine.client import EngineClient
from tinypaged.engine.core_client import EngineCoreClient, make_client
from tinypaged.engine.messages import (
    AbortRequest,
    AddRequest,
    EngineCoreOutput,
    EngineStopped,
)
from tinypaged.outputs import RequestOutput
from tinypaged.sampling.params import SamplingParams

if TYPE_CHECKING:
    from tinypaged.engine.engine import Engine, PromptType

_Item = RequestOutput | BaseException


@dataclass(slots=True)
class _Stream:
    """One request's way back to its caller."""

    loop: asyncio.AbstractEventLoop  # the caller's event loop
    queue: asyncio.Queue  # its outputs and, at the end, maybe an exception
    prompt: str | None = None  # from the first output: later ones come without (messages.py)
    prompt_token_ids: list[int] | None = None


class AsyncLLM(EngineClient):
    def __init__(self, model: str | None = None, *, multiprocess_mode: bool = False,
                 **kwargs: Any):
        self._attach(make_client(EngineConfig.from_kwargs(model=model, **kwargs),
                                 multiprocess_mode))

    @classmethod
    def from_config(cls, config: EngineConfig, multiprocess_mode: bool = False) -> AsyncLLM:
        self = cls.__new__(cls)
        self._attach(make_client(config, multiprocess_mode))
        return self

    @classmethod
    def from_client(cls, client: EngineCoreClient) -> AsyncLLM:
        """Around an engine client already built (dp/ starts several at once)."""
        self = cls.__new__(cls)
        self._attach(client)
        return self

    def _attach(self, client: EngineCoreClient) -> None:
        self.core_client = client
        # The event loop adds and forgets streams, the client's thread delivers to them and
        # removes the finished ones: the lock keeps each of those steps whole.
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self._fatal: BaseException | None = None  # why the loop stopped by itself
        self._stats = client.ready.stats  # a fresh dict after every step: read without a lock
        client.start(self._on_output)

    # The EngineClient interface (client.py): what the server, CLI and bench read.
    @property
    def tokenizer(self):
        return self.core_client.tokenizer

    @property
    def config(self) -> EngineConfig:
        return self.core_client.ready.config

    @property
    def model_name(self) -> str:
        return self.core_client.ready.model_name

    @property
    def default_sampling_params(self) -> dict:
        """SamplingParams defaults from the model's generation_config.json."""
        return self.core_client.ready.default_sampling_params

    @property
    def kv_cache_info(self) -> dict:
        return self.core_client.ready.kv_cache_info

    def get_stats(self) -> dict:
        """The engine's queue lengths and KV usage as of its last step (never blocks)."""
        return self._stats

    @property
    def is_running(self) -> bool:
        return not self._stopped

    @property
    def engine(self) -> Engine | None:
        """The Engine when its loop runs in a thread of this process (for tests and
        benchmarks that look inside); None in multiprocess mode."""
        return self.core_client.engine

    async def generate(
        self, prompt: PromptType, params: SamplingParams, request_id: str,
        lora_request: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs of one request as tokens arrive; the last has finished=True.
        A request the engine refuses raises ValueError before the first output."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:  # a stop that comes later fails this stream too
            self._check_running()
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = stream
        self.core_client.send(AddRequest(request_id, prompt, params, lora_request))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                # Only the newest output matters: skip intermediate ones that piled up.
                while not isinstance(item, BaseException) and not item.finished:
                    if stream.queue.empty():
                        break
                    item = stream.queue.get_nowait()
                if isinstance(item, BaseException):
                    finished = True  # the engine has already dropped the request
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._abort(request_id, stream)

    async def abort(self, request_id: str) -> None:
        """Drop a request (at the engine's next step boundary); unknown ids are a no-op."""
        self._abort(request_id)

    async def shutdown(self) -> None:
        """Stop the engine loop and the engine's worker processes; every unfinished stream ends
        with an error."""
        with self._lock:
            self._stopped = True
        await asyncio.get_running_loop().run_in_executor(None, self.core_client.shutdown)

    def _check_running(self) -> None:
        if not self.is_running:
            why = f": {self._fatal}" if self._fatal is not None else ""
            raise RuntimeError(f"the engine is not running{why}")

    def _abort(self, request_id: str, stream: _Stream | None = None) -> None:
        """Forget the request's stream (only `stream`, when given: the id may be in use by a
        newer request by now) and tell the engine loop to drop it."""
        with self._lock:
            if stream is None or self._streams.get(request_id) is stream:
                self._streams.pop(request_id, None)
        self.core_client.send(AbortRequest(request_id))

    # ------------------------------------------------------------------ the client's thread

    def _on_output(self, message: EngineCoreOutput) -> None:
        """Take one message of the engine loop: hand outputs and errors to their streams."""
        if message.stats is not None:
            self._stats = message.stats
        if isinstance(message, EngineStopped):
            with self._lock:
                self._fatal, self._stopped = message.error, True  # before the callers hear
                streams, self._streams = self._streams, {}
            error = message.error or RuntimeError("the engine was shut down")
            self._post([(rid, stream, error) for rid, stream in streams.items()])
            return
        items: list[tuple[str, _Stream, _Item]] = []
        with self._lock:
            for out in message.outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:  # aborted since: nobody reads it any more
                    continue
                if out.prompt_token_ids is None:
                    out.prompt, out.prompt_token_ids = stream.prompt, stream.prompt_token_ids
                else:
                    stream.prompt, stream.prompt_token_ids = out.prompt, out.prompt_token_ids
                if out.finished:
                    del self._streams[out.request_id]
                items.append((out.request_id, stream, out))
            for request_id, error in message.errors:
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    items.append((request_id, stream, error))
        self._post(items)

    def _post(self, items: list[tuple[str, _Stream, _Item]]) -> None:
        """Put each item on its stream's queue: one thread-safe call per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, _Item]]] = {}
        for _, stream, item in items:
            by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the caller's loop is closed: nobody is listening any more
                for request_id, stream, _ in items:
                    if stream.loop is loop:
                        self._abort(request_id, stream)


def _put_all(batch: list[tuple[asyncio.Queue, _Item]]) -> None:
    for q, item in batch:
        q.put_nowait(item)
