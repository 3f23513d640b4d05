"""The OpenAI-compatible HTTP server: a Starlette app around one AsyncLLM.

    app = build_app(AsyncLLM(), served_model_name="smollm2", api_key=None, max_queue=None)
    uvicorn.run(app, host="127.0.0.1", port=8000)      # what `tinypaged serve` does

Endpoints: GET /health, /metrics, /v1/models; POST /v1/completions, /v1/chat/completions,
/tokenize, /detokenize. Request validation and the response shapes live in `protocol.py`, the
Prometheus metrics in `metrics.py`; this file moves requests between HTTP and the engine.

One HTTP request becomes one engine request per prompt (the `n` samples of a prompt share it).
Before answering, the server waits for the first output: a request the engine refuses at
submission still gets a proper 400, not a broken stream. While it waits, generates or streams, a
watcher listens for the client's disconnect and aborts the engine requests at once, which frees
their KV blocks. An exception inside one request ends that request only (500, or an error event
when the stream has already begun).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tinypaged.metrics import CONTENT_TYPE, ServerMetrics
from tinypaged.protocol import (
    APIError,
    GenerationRequest,
    ResponseFormat,
    bad_request,
    error_body,
    new_id,
    now,
    parse_chat_request,
    parse_completion_request,
    parse_detokenize_request,
    parse_tokenize_request,
    sse,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
RETRY_AFTER_S = 1


class _ClientGone(Exception):
    pass


async def _wait_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class Generation:
    """The engine requests of one HTTP request (one per prompt), merged into one output stream."""

    def __init__(self, server: OpenAIServer, request_id: str, prompts: list[list[int]], params):
        self.server = server
        self.engine_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self.finished = [False] * len(prompts)
        self.trackers = [server.metrics.track() for _ in prompts]
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks = [
            asyncio.create_task(self._pump(i, ids, p))
            for i, (ids, p) in enumerate(zip(prompts, params))
        ]
        self.closed = False

    async def _pump(self, i: int, prompt_ids: list[int], params) -> None:
        try:
            stream = self.server.engine.generate(
                {"prompt_token_ids": prompt_ids}, params, self.engine_ids[i]
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
                await self.server.engine.abort(engine_id)
                self.trackers[i].aborted()
        self.server.release(self)


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


class OpenAIServer:
    def __init__(
        self,
        engine: Any,
        served_model_name: str | list[str] | None = None,
        api_key: str | None = None,
        max_queue: int | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ):
        self.engine = engine
        names = [served_model_name] if isinstance(served_model_name, str) else served_model_name
        self.model_names = list(names or [engine.model_name])
        self.model_name = self.model_names[0]
        self.api_key = api_key
        self.max_queue = max_queue
        self.max_body_bytes = max_body_bytes
        self.metrics = ServerMetrics(engine, self.model_name)
        self.active: set[Generation] = set()
        self.in_flight = 0  # engine requests admitted and not yet closed
        self.created = now()

    # ------------------------------------------------------------------------------ plumbing

    @property
    def max_model_len(self) -> int:
        return int(getattr(self.engine, "max_model_len", None) or self.engine.config.max_model_len)

    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        ):
            raise APIError(
                401,
                "invalid or missing API key: send the header 'Authorization: Bearer <key>' "
                "with the key the server was started with",
                code="invalid_api_key",
            )

    async def read_json(self, request: Request) -> Any:
        """The body as JSON; an oversized body is refused (413) before it is read or parsed."""
        limit = self.max_body_bytes
        length = request.headers.get("content-length")
        too_big = APIError(
            413,
            f"request body exceeds the server's limit of {limit} bytes",
            param="body",
            code="request_too_large",
        )
        if length is not None and length.isdigit() and int(length) > limit:
            raise too_big
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_big
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad_request(
                "body", f"the request body is not valid JSON: {exc}", code="invalid_json"
            ) from None

    def check_model(self, model: str | None) -> str:
        if model is None or model in self.model_names:
            return model or self.model_name
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {self.model_names}",
            param="model",
            code="model_not_found",
        )

    def admit(self, num_prompts: int) -> None:
        if not getattr(self.engine, "is_running", True):  # e.g. a tensor-parallel worker died
            raise APIError(
                503,
                "the engine has stopped and cannot take requests; see the server log",
                type="service_unavailable",
                code="engine_dead",
            )
        if self.max_queue is None:
            return
        capacity = self.engine.config.max_num_seqs + self.max_queue
        if self.in_flight + num_prompts > capacity:
            raise APIError(
                503,
                f"the server is busy: {self.in_flight} requests in flight and the queue "
                f"(--max-queue {self.max_queue}) is full; retry later",
                type="server_overloaded",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )

    def release(self, gen: Generation) -> None:
        if gen in self.active:
            self.active.discard(gen)
            self.in_flight -= len(gen.engine_ids)

    def sampling_params(self, req: GenerationRequest, prompt_len: int, prompt_param: str):
        from tinypaged.sampling import SamplingParams

        limit = self.max_model_len
        if prompt_len >= limit:
            raise bad_request(
                prompt_param,
                f"the prompt has {prompt_len} tokens but the model's context (max_model_len) "
                f"is {limit} tokens; shorten the prompt",
                code="context_length_exceeded",
            )
        max_tokens = req.max_tokens or limit - prompt_len
        if prompt_len + max_tokens > limit:
            raise bad_request(
                req.max_tokens_param,
                f"{prompt_len} prompt tokens + {req.max_tokens_param}={max_tokens} exceed the "
                f"model's context (max_model_len) of {limit} tokens; ask for at most "
                f"{limit - prompt_len}",
                code="context_length_exceeded",
            )
        try:
            return SamplingParams(**req.sampling, max_tokens=max_tokens)
        except (ValueError, TypeError) as exc:
            text = str(exc)  # SamplingParams' messages start with the field's name
            first = text.split(maxsplit=1)[0] if text else ""
            raise bad_request(first if first.isidentifier() else "body", text) from None

    async def until_disconnect(self, request: Request, work: Awaitable) -> Any:
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

    # ------------------------------------------------------------------------------ generation

    async def generate(
        self,
        request: Request,
        req: GenerationRequest,
        prompts: list[list[int]],
        fmt: ResponseFormat,
        prompt_param: str,
    ) -> Response:
        params = [self.sampling_params(req, len(ids), prompt_param) for ids in prompts]
        self.admit(len(prompts))
        gen = Generation(self, fmt.request_id, prompts, params)
        self.active.add(gen)
        self.in_flight += len(prompts)
        try:
            first = await self.until_disconnect(request, gen.next())
            if not req.stream:
                result = await self.until_disconnect(request, self._collect(gen, first))
                return JSONResponse(fmt.response(result))
        except _ClientGone:
            await gen.close()
            return Response(status_code=499)  # nobody is listening; the status is for the logs
        except ValueError as exc:  # the engine refused the request at submission
            await gen.close()
            raise bad_request(prompt_param, str(exc)) from None
        except BaseException:
            await gen.close()
            raise
        finally:
            if not req.stream:
                await gen.close()
        return EventStream(self._events(gen, first, fmt, req.include_usage), gen.close)

    @staticmethod
    async def _collect(gen: Generation, item) -> list:
        outs: list = [None] * len(gen.engine_ids)
        while item is not None:
            outs[item[0]] = item[1]
            item = await gen.next()
        return outs

    @staticmethod
    async def _events(
        gen: Generation, first, fmt: ResponseFormat, include_usage: bool
    ) -> AsyncIterator[bytes]:
        try:
            for chunk in fmt.start_chunks():
                yield sse(chunk)
            item = first
            while item is not None:
                for chunk in fmt.delta_chunks(*item):
                    yield sse(chunk)
                item = await gen.next()
            if include_usage:
                yield sse(fmt.usage_chunk())
        except Exception as exc:
            logger.exception("request %s failed while streaming", fmt.request_id)
            yield sse(
                error_body(
                    f"internal error while generating: {exc}", "server_error", code="internal_error"
                )
            )
        yield sse("[DONE]")

    # ------------------------------------------------------------------------------ endpoints

    async def completions(self, request: Request) -> Response:
        req = parse_completion_request(await self.read_json(request))
        model = self.check_model(req.model)
        tok = self.engine.tokenizer
        prompts = [tok.encode(p) if isinstance(p, str) else p for p in req.prompts]
        fmt = ResponseFormat("completion", new_id("cmpl"), model, req, prompts, tok)
        return await self.generate(request, req, prompts, fmt, "prompt")

    async def chat_completions(self, request: Request) -> Response:
        req = parse_chat_request(await self.read_json(request))
        model = self.check_model(req.model)
        tok = self.engine.tokenizer
        prompt = self._chat_prompt(req.messages)
        fmt = ResponseFormat("chat", new_id("chatcmpl"), model, req, [prompt], tok)
        return await self.generate(request, req, [prompt], fmt, "messages")

    def _chat_prompt(self, messages: list[dict]) -> list[int]:
        try:
            return list(
                self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            )
        except Exception as exc:  # noqa: BLE001 - e.g. the template's own raise_exception()
            raise bad_request(
                "messages", f"the chat template cannot render these messages: {exc}"
            ) from None

    async def tokenize(self, request: Request) -> Response:
        model, prompt, messages, with_strs = parse_tokenize_request(await self.read_json(request))
        self.check_model(model)
        tok = self.engine.tokenizer
        ids = self._chat_prompt(messages) if messages is not None else tok.encode(prompt)
        strs = [tok.decode([t], skip_special_tokens=False) for t in ids] if with_strs else None
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": self.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def detokenize(self, request: Request) -> Response:
        model, tokens = parse_detokenize_request(await self.read_json(request))
        self.check_model(model)
        try:
            text = self.engine.tokenizer.decode(tokens, skip_special_tokens=False)
        except Exception as exc:  # noqa: BLE001 - ids outside the vocabulary
            raise bad_request("tokens", f"cannot decode these token ids: {exc}") from None
        return JSONResponse({"prompt": text})

    async def models(self, request: Request) -> Response:
        data = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "tinypaged",
                "root": self.engine.model_name,
                "max_model_len": self.max_model_len,
            }
            for name in self.model_names
        ]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        if not getattr(self.engine, "is_running", True):
            return JSONResponse(
                error_body("the engine has stopped", "server_error", code="engine_dead"),
                status_code=503,
            )
        return Response(status_code=200)

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    # ------------------------------------------------------------------------------ the app

    def endpoint(self, fn: Callable[[Request], Awaitable[Response]], auth: bool):
        async def handler(request: Request) -> Response:
            try:
                if auth:
                    self.check_auth(request)
                return await fn(request)
            except APIError as exc:
                return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
            except Exception as exc:  # a bug or engine fault: this request fails, the server lives
                logger.exception("request to %s failed", request.url.path)
                body = error_body(
                    f"internal error: {type(exc).__name__}: {exc}",
                    "server_error",
                    code="internal_error",
                )
                return JSONResponse(body, status_code=500)

        return handler

    async def shutdown(self) -> None:
        """Abort whatever is still in flight when the server stops."""
        for gen in list(self.active):
            await gen.close()


def build_app(
    engine: Any,
    served_model_name: str | list[str] | None = None,
    api_key: str | None = None,
    max_queue: int | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> Starlette:
    """The Starlette app serving `engine` (an AsyncLLM). The engine outlives the app: the caller
    shuts it down."""
    server = OpenAIServer(engine, served_model_name, api_key, max_queue, max_body_bytes)
    e = server.endpoint
    routes = [
        Route("/health", e(server.health, auth=False), methods=["GET"]),
        Route("/metrics", e(server.metrics_endpoint, auth=False), methods=["GET"]),
        Route("/v1/models", e(server.models, auth=True), methods=["GET"]),
        Route("/v1/completions", e(server.completions, auth=True), methods=["POST"]),
        Route("/v1/chat/completions", e(server.chat_completions, auth=True), methods=["POST"]),
        Route("/tokenize", e(server.tokenize, auth=True), methods=["POST"]),
        Route("/detokenize", e(server.detokenize, auth=True), methods=["POST"]),
    ]

    async def http_error(request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        body = error_body(
            f"{request.method} {request.url.path}: {exc.detail}", "invalid_request_error", code=code
        )
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        yield
        await server.shutdown()

    app = Starlette(
        routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan
    )
    app.state.server = server
    return app
