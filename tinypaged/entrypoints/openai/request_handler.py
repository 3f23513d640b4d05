"""Running one request against the engine: its SamplingParams, disconnects, the answer or stream.

The HTTP side (routes, auth, admission, shutdown) is api_server.py; this file takes over once a
request is parsed and its prompts tokenized. One HTTP request becomes one engine request per
prompt (the `n` samples of a prompt share it); `Generation` merges their outputs into one stream
of (prompt index, cumulative RequestOutput). Before answering, `respond` waits for the first
output: a request the engine refuses at submission still gets a proper 400, not a broken stream.
While it waits, generates or streams, a watcher listens for the client's disconnect and aborts
the engine requests at once, which frees their KV blocks. An exception inside one request ends
that request only (api_server.py turns it into a 500, or an error event when the stream has
already begun).

A stream is server-sent events: one `data: {json}` line and a blank line per chunk, the last
one `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tinypaged.entrypoints.openai.errors import APIError, bad_request, error_body, field_error
from tinypaged.entrypoints.openai.metrics import ServerMetrics
from tinypaged.entrypoints.openai.protocol import GenerationRequest
from tinypaged.entrypoints.openai.response_bodies import ResponseBuilder

if TYPE_CHECKING:
    from tinypaged.engine.client import EngineClient
    from tinypaged.sampling.params import SamplingParams

logger = logging.getLogger(__name__)


def sse(data: dict | str) -> bytes:
    """One server-sent event: `data: {json}` and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def build_sampling_params(
    req: GenerationRequest,
    prompt_len: int,
    prompt_param: str,
    max_model_len: int,
    defaults: dict | None = None,
) -> SamplingParams:
    """The SamplingParams of one prompt; a prompt or max_tokens over the context is a 400.

    Without max_tokens the answer may fill the rest of the context (completions: 16 tokens, as
    OpenAI). `defaults` (the model's generation_config sampling) fill the fields the request left
    out; their max_tokens caps the request's, as in vLLM."""
    defaults = dict(defaults or {})
    cap = defaults.pop("max_tokens", None)
    limit = max_model_len
    if prompt_len >= limit:
        raise bad_request(
            prompt_param,
            f"the prompt has {prompt_len} tokens but the model's context (max_model_len) "
            f"is {limit} tokens; shorten the prompt",
            code="context_length_exceeded",
        )
    if req.max_tokens is not None:
        max_tokens = req.max_tokens
    else:
        max_tokens = min(req.default_max_tokens or limit, limit - prompt_len)
    if cap is not None:
        max_tokens = min(max_tokens, cap)
    if prompt_len + max_tokens > limit:
        raise bad_request(
            req.max_tokens_param,
            f"{prompt_len} prompt tokens + {req.max_tokens_param}={max_tokens} exceed the "
            f"model's context (max_model_len) of {limit} tokens; ask for at most "
            f"{limit - prompt_len}",
            code="context_length_exceeded",
        )
    return req.to_sampling_params(max_tokens, defaults)


class _ClientGone(Exception):
    pass


async def _wait_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable) -> Any:
    """Await `work`, or raise _ClientGone as soon as the client hangs up."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this coroutine is cancelled: leave no task behind
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise _ClientGone()
    return task.result()


class Generation:
    """The engine requests of one HTTP request (one per prompt), merged into one output stream.

    `on_close(gen)` runs once, after `close` has aborted what had not finished (the server's
    bookkeeping of requests in flight).
    """

    def __init__(
        self,
        engine: EngineClient,
        metrics: ServerMetrics,
        request_id: str,
        prompts: list[list[int]],
        params: list,
        on_close: Callable[[Generation], None],
        lora_request: Any = None,
    ):
        self.engine = engine
        self.lora_request = lora_request
        self.on_close = on_close
        self.engine_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self.finished = [False] * len(prompts)
        self.trackers = [metrics.track(p) for p in params]
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks = [
            asyncio.create_task(self._pump(i, ids, p))
            for i, (ids, p) in enumerate(zip(prompts, params))
        ]
        self.closed = False

    async def _pump(self, i: int, prompt_ids: list[int], params) -> None:
        try:
            lora = {} if self.lora_request is None else {"lora_request": self.lora_request}
            stream = self.engine.generate(
                {"prompt_token_ids": prompt_ids}, params, self.engine_ids[i], **lora
            )
            async for out in stream:
                self.trackers[i].observe(out)
                self.finished[i] = out.finished
                self.queue.put_nowait((i, out))
            if not self.finished[i]:
                raise RuntimeError(f"the engine ended request {self.engine_ids[i]} unfinished")
        except Exception as exc:  # noqa: BLE001 - the reader decides: 400, 500 or an error event
            self.queue.put_nowait((i, exc))

    async def next(self) -> tuple[int, Any] | None:
        """The next (prompt index, cumulative RequestOutput); None once every prompt finished."""
        while not all(self.finished) or not self.queue.empty():
            i, item = await self.queue.get()
            if isinstance(item, Exception):
                raise item
            return i, item
        return None

    def stop(self, error: Exception) -> None:
        """End this generation for its reader with `error` (the server's shutdown)."""
        self.queue.put_nowait((-1, error))

    async def close(self) -> None:
        """Stop the pumps and abort every engine request that has not finished (idempotent)."""
        if self.closed:
            return
        self.closed = True
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for i, engine_id in enumerate(self.engine_ids):
            if not self.finished[i]:
                await self.engine.abort(engine_id)
                self.trackers[i].aborted()
        self.on_close(self)


class EventStream:
    """An SSE response that stops, and closes its generation, the moment the client disconnects."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]):
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})

        async def pump() -> None:
            async for data in self.events:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        tasks = [asyncio.create_task(pump()), asyncio.create_task(_wait_disconnect(receive))]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.events.aclose()
            await self.on_close()


async def respond(
    request: Request,
    gen: Generation,
    req: GenerationRequest,
    builder: ResponseBuilder,
    prompt_param: str,
) -> Response:
    """The JSON answer, or an EventStream once the first output is in; `gen` is always closed
    (a stream closes it when it ends)."""
    try:
        first = await until_disconnect(request, gen.next())
        if not req.stream:
            result = await until_disconnect(request, _collect(gen, first))
            return JSONResponse(builder.response(result))
    except _ClientGone:
        await gen.close()
        return Response(status_code=499)  # nobody is listening; the status is for the logs
    except ValueError as exc:  # the engine refused the request at submission
        await gen.close()
        raise field_error(str(exc), req.body_fields, fallback=prompt_param) from None
    except BaseException:
        await gen.close()
        raise
    finally:
        if not req.stream:
            await gen.close()
    return EventStream(_events(gen, first, builder, req.include_usage), gen.close)


async def _collect(gen: Generation, item) -> list:
    outs: list = [None] * len(gen.engine_ids)
    while item is not None:
        outs[item[0]] = item[1]
        item = await gen.next()
    return outs


async def _events(
    gen: Generation, first, builder: ResponseBuilder, include_usage: bool
) -> AsyncIterator[bytes]:
    try:
        for chunk in builder.start_chunks():
            yield sse(chunk)
        item = first
        while item is not None:
            for chunk in builder.delta_chunks(*item):
                yield sse(chunk)
            item = await gen.next()
        if include_usage:
            yield sse(builder.usage_chunk())
    except APIError as exc:  # the server is shutting down
        yield sse(exc.body())
    except Exception as exc:
        logger.exception("request %s failed while streaming", builder.request_id)
        yield sse(
            error_body(
                f"internal error while generating: {exc}", "server_error", code="internal_error"
            )
        )
    yield sse("[DONE]")
