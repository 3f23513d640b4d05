"""The HTTP side of the OpenAI-compatible server: routes, auth, admission and shutdown.

A Starlette app around one engine (an EngineClient: AsyncLLM):

    app = build_app(AsyncLLM(), served_model_name="smollm2", api_key=None, max_queue=None)
    GracefulServer(uvicorn.Config(app, port=8000), app.state.server, 5.0).run()  # `serve`

Endpoints: GET /health, /metrics, /version, /v1/models; POST /v1/completions,
/v1/chat/completions, /invocations, /tokenize, /detokenize; CORS through Starlette's
middleware. This file holds the routes, the API key, body limits, model names, admission (a
full queue, a dead engine or a shutdown is a 503), the drain on SIGTERM (`GracefulServer`) and
the mapping of errors to OpenAI's error bodies. Long bodies are parsed, and prompts tokenized, in
a worker thread: the event loop only routes. The rest lives beside it: request parsing in
`protocol.py` (chat's tool and template fields in `chat_protocol.py`, structured output in
`structured_protocol.py`, the error shape in `errors.py`), running one request against the
engine (disconnects, streaming) in `request_handler.py`, the response shapes in
`response_bodies.py`, the Prometheus metrics in `metrics.py`. An exception inside one request
ends that request only (500).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tinypaged.engine.client import EngineClient
from tinypaged.entrypoints.anthropic.serving import anthropic_routes
from tinypaged.entrypoints.openai.chat_output import output_for
from tinypaged.entrypoints.openai.chat_protocol import (
    ChatOptions,
    check_tool_choice,
    parse_chat_options,
)
from tinypaged.entrypoints.openai.errors import APIError, bad_request, error_body, show
from tinypaged.entrypoints.openai.lora_routes import lora_routes
from tinypaged.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from tinypaged.entrypoints.openai.parsers import REASONING_PARSERS, TOOL_PARSERS
from tinypaged.entrypoints.openai.pooling_routes import pooling_routes
from tinypaged.entrypoints.openai.protocol import (
    GenerationRequest,
    field_value,
    parse_chat_request,
    parse_completion_request,
    parse_detokenize_request,
    parse_json_body,
    parse_tokenize_request,
)
from tinypaged.entrypoints.openai.request_handler import Generation, build_sampling_params, respond
from tinypaged.entrypoints.openai.response_bodies import ResponseBuilder, new_id, now
from tinypaged.entrypoints.openai.template_tools import check_template_renders_tools
from tinypaged.entrypoints.responses.serving import responses_routes
from tinypaged.host.packages import MissingPackageError, missing_optional

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
CORS_DEFAULTS = {
    "allow_origins": ["*"],
    "allow_methods": ["*"],
    "allow_headers": ["*"],
    "allow_credentials": False,
}
RETRY_AFTER_S = 1
OFF_LOOP_BYTES = 8 * 1024  # bodies and texts past this are parsed / tokenized in a thread
# A prompt of more than max_model_len * (longest token in characters) * this many characters
# cannot fit and is refused before tokenizing. A token covers at most its own string's length in
# characters (byte-level BPE: one character per byte; SentencePiece: "<0x0A>" is longer than the
# one character it stands for), so the bound holds for any tokenizer whose normalizer does not
# delete characters; the margin covers normalizers that merge a few (NFC, NFKC).
PROMPT_CHARS_MARGIN = 4


def _pick(registry: dict[str, type], name: str | None, what: str) -> type | None:
    if name is None or name in registry:
        return registry.get(name) if name else None
    raise ValueError(f"unknown {what} {name!r}; choose one of {sorted(registry)}")


class OpenAIServer:
    """The state of one app (engine, model names, key, limits, requests in flight) and its
    endpoints."""

    def __init__(
        self,
        engine: EngineClient,
        served_model_name: str | list[str] | None = None,
        api_key: str | None = None,
        max_queue: int | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        tool_call_parser: str | None = None,
        enable_auto_tool_choice: bool = False,
        reasoning_parser: str | None = None,
        enable_prompt_tokens_details: bool = False,
        trust_request_chat_template: bool = False,
        return_tokens_as_token_ids: bool = False,  # vLLM's flag: every request's default
    ):
        if not isinstance(engine, EngineClient):
            raise TypeError(
                f"the server needs an EngineClient (e.g. AsyncLLM), got {type(engine).__name__}; "
                "subclass tinypaged.engine.client.EngineClient"
            )
        self.engine = engine
        self.tool_parser = _pick(TOOL_PARSERS, tool_call_parser, "tool_call_parser")
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.reasoning_parser = _pick(REASONING_PARSERS, reasoning_parser, "reasoning_parser")
        self.prompt_tokens_details = enable_prompt_tokens_details
        self.trust_request_chat_template = trust_request_chat_template
        self.tokens_as_ids = return_tokens_as_token_ids
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
        self.loop: asyncio.AbstractEventLoop | None = None  # the app's loop, set at startup
        self.draining = False  # shutting down: admit nothing new
        self.lora = None  # lora_routes.LoRAServing with --enable-lora

    # ------------------------------------------------------------------------------ plumbing

    @property
    def max_model_len(self) -> int:
        return int(self.engine.config.max_model_len)

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
        """The body as JSON; an oversized body is refused (413) before it is read or parsed, a
        body not sent as application/json with a 400, as vLLM."""
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
        async for chunk in request.stream():  # ClientDisconnect when the client hangs up
            body += chunk
            if len(body) > limit:
                raise too_big
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type != "application/json":
            raise bad_request(
                "content-type",
                f"Unsupported Media Type {media_type or '(none)'!r}: only 'application/json' is "
                "allowed; send the header 'Content-Type: application/json'",
                code="unsupported_media_type",
            )
        if len(body) > OFF_LOOP_BYTES:
            return await asyncio.to_thread(parse_json_body, bytes(body))
        return parse_json_body(bytes(body))

    @property
    def max_prompt_chars(self) -> int:
        """Prompts longer than this many characters cannot fit in the context, whatever their
        tokens (see PROMPT_CHARS_MARGIN)."""
        return self.max_model_len * self.engine.tokenizer.max_token_chars * PROMPT_CHARS_MARGIN

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        limit = self.max_prompt_chars
        if num_chars > limit:
            raise bad_request(
                param,
                f"the prompt has {num_chars} characters, more than any prompt that fits the "
                f"model's context of {self.max_model_len} tokens can have ({limit}); shorten it",
                code="context_length_exceeded",
            )

    async def encode(
        self, texts: list[str], param: str, add_special_tokens: bool = True
    ) -> list[list[int]]:
        """Tokenize `texts` (in a thread unless short); a tokenizer error is the client's 400."""
        tok = self.engine.tokenizer

        def encode() -> list[list[int]]:
            return [tok.encode(t, add_special_tokens=add_special_tokens) for t in texts]

        try:
            if sum(map(len, texts)) > OFF_LOOP_BYTES:
                return await asyncio.to_thread(encode)
            return encode()
        except Exception as exc:  # noqa: BLE001 - whatever the tokenizer rejects
            raise bad_request(param, f"cannot tokenize '{param}': {exc}") from None

    def check_model(self, model: str | None) -> str:
        """The served name to answer with; absent or "" means the default model (vLLM)."""
        if not model or model in self.model_names or (self.lora and model in self.lora.adapters):
            return model or self.model_name
        raise APIError(
            404,
            f"the model {show(model)} does not exist; this server serves {self.model_names}",
            param="model",
            code="model_not_found",
        )

    def admit(self, num_prompts: int) -> None:
        if self.draining:
            raise APIError(
                503,
                "the server is shutting down and takes no new requests; retry on another replica "
                "or once it is back",
                type="service_unavailable",
                code="server_shutting_down",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        if not self.engine.is_running:  # e.g. a tensor-parallel worker died
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

    # ------------------------------------------------------------------------------ generation

    async def generate(
        self,
        request: Request,
        req: GenerationRequest,
        prompts: list[list[int]],
        builder: ResponseBuilder,
        prompt_param: str,
    ) -> Response:
        limit = self.max_model_len
        defaults = self.engine.default_sampling_params
        params = [
            build_sampling_params(req, len(ids), prompt_param, limit, defaults) for ids in prompts
        ]
        self.admit(len(prompts))
        lora = self.lora and self.lora.request_for(builder.model, len(prompts))
        gen = Generation(
            self.engine, self.metrics, builder.request_id, prompts, params, self.release, lora
        )
        self.active.add(gen)
        self.in_flight += len(prompts)
        return await respond(request, gen, req, builder, prompt_param)

    # ------------------------------------------------------------------------------ endpoints

    async def completions(self, request: Request, body: Any = None) -> Response:
        req = parse_completion_request(body or await self.read_json(request))
        req.return_tokens_as_token_ids |= self.tokens_as_ids
        model = self.check_model(req.model)
        tok = self.engine.tokenizer
        texts = [p for p in req.prompts if isinstance(p, str)]
        if req.truncate_prompt_tokens is None:  # a truncated prompt may be any length
            for text in texts:
                self.check_prompt_chars(len(text), "prompt")
        encoded = iter(await self.encode(texts, "prompt"))
        prompts = [next(encoded) if isinstance(p, str) else p for p in req.prompts]
        prompts = [self.truncate(req, p) for p in prompts]
        builder = ResponseBuilder(
            "completion",
            new_id("cmpl"),
            model,
            req,
            prompts,
            tok,
            prompt_tokens_details=self.prompt_tokens_details,
            echo_prompts=[tok.decode(p, skip_special_tokens=False) for p in prompts]
            if req.echo
            else None,
        )
        return await self.generate(request, req, prompts, builder, "prompt")

    async def chat_completions(self, request: Request, body: Any = None) -> Response:
        req = parse_chat_request(body or await self.read_json(request))
        req.return_tokens_as_token_ids |= self.tokens_as_ids
        model = self.check_model(req.model)
        opts = req.chat
        auto_ready = self.enable_auto_tool_choice and bool(self.tool_parser)
        check_tool_choice(req.chat, req.sampling, auto_ready)
        check_template_renders_tools(self.engine.tokenizer, req.chat, model)  # drops tools?
        tok = self.engine.tokenizer
        if req.truncate_prompt_tokens is None:  # a truncated prompt may be any length
            chars = sum(len(m["content"]) for m in req.messages if isinstance(m["content"], str))
            self.check_prompt_chars(chars, "messages")
        prompt = await self._chat_prompt(req.messages, opts, opts.add_special_tokens)
        prompt = self.truncate(req, prompt)
        last = req.messages[-1]
        echo = last["content"] if opts.echo and last["role"] == "assistant" else ""
        builder = ResponseBuilder(
            "chat",
            new_id("chatcmpl"),
            model,
            req,
            [prompt],
            tok,
            chat_output=lambda: output_for(opts, self.tool_parser, self.reasoning_parser),
            echo=echo,
            prompt_tokens_details=self.prompt_tokens_details,
        )
        return await self.generate(request, req, [prompt], builder, "messages")

    def truncate(self, req: GenerationRequest, prompt: list[int]) -> list[int]:
        """vLLM's truncate_prompt_tokens: keep the prompt's last k tokens (-1: max_model_len), or
        its first k with truncation_side "right"."""
        k, limit = req.truncate_prompt_tokens, self.max_model_len
        if k is None:
            return prompt
        if not (k == -1 or 1 <= k <= limit):
            raise bad_request(
                "truncate_prompt_tokens",
                f"'truncate_prompt_tokens' must be -1 (the context length) or in [1, {limit}] "
                f"(max_model_len), got {k}",
            )
        keep = limit if k == -1 else k
        return prompt[:keep] if req.truncation_side == "right" else prompt[-keep:]

    async def _chat_prompt(
        self, messages: list[dict], opts: ChatOptions, add_special_tokens: bool = False
    ) -> list[int]:
        if opts.chat_template and not self.trust_request_chat_template:  # as vLLM
            raise bad_request("chat_template", "the request passes a chat_template but the "
                              "server was not started with --trust-request-chat-template")
        tok = self.engine.tokenizer
        kwargs = opts.template_kwargs()

        def render() -> list[int]:
            if add_special_tokens:
                text = tok.render_chat(messages, **kwargs)
                return list(tok.encode(text, add_special_tokens=True))
            return list(tok.apply_chat_template(messages, **kwargs))

        try:  # rendering and tokenizing run in a thread: neither holds up the event loop
            return await asyncio.to_thread(render)
        except Exception as exc:  # noqa: BLE001 - e.g. the template's own raise_exception()
            raise bad_request(
                "messages", f"the chat template cannot render these messages: {exc}"
            ) from None

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: a prompt (add_special_tokens defaults to true) or chat messages
        rendered like a chat request (add_generation_prompt true, add_special_tokens false)."""
        body = await self.read_json(request)
        model, prompt, messages, with_strs = parse_tokenize_request(body)
        self.check_model(model)
        tok = self.engine.tokenizer
        special = field_value(body, "add_special_tokens", "bool")
        if messages is not None:
            ids = await self._chat_prompt(messages, parse_chat_options(body), bool(special))
        else:
            (ids,) = await self.encode([prompt], "prompt", add_special_tokens=special is not False)
        strs = tok.convert_ids_to_tokens(ids) if with_strs else None
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
        decode = self.engine.tokenizer.decode
        try:
            text = await asyncio.to_thread(decode, tokens, skip_special_tokens=False)
        except Exception as exc:  # noqa: BLE001 - ids outside the vocabulary
            raise bad_request("tokens", f"cannot decode these token ids: {exc}") from None
        return JSONResponse({"prompt": text})

    async def invocations(self, request: Request) -> Response:
        """SageMaker's single entry point (vLLM's /invocations): chat if the body has
        'messages', a completion if it has 'prompt'."""
        body = await self.read_json(request)
        if isinstance(body, dict) and "messages" in body:
            return await self.chat_completions(request, body)
        if isinstance(body, dict) and "prompt" in body:
            return await self.completions(request, body)
        raise bad_request(
            "body", "/invocations needs 'messages' (chat) or 'prompt' (completion) in the body"
        )

    async def version(self, request: Request) -> Response:
        from tinypaged import __version__

        return JSONResponse({"version": __version__})

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
        ] + (self.lora.models_data() if self.lora else [])
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        if self.draining:
            return JSONResponse(
                error_body("the server is shutting down", "service_unavailable",
                           code="server_shutting_down"),
                status_code=503,
            )
        if not self.engine.is_running:
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
            except MissingPackageError as exc:  # an optional package is missing: not a 500
                return JSONResponse(error_body(str(exc), "invalid_request_error",
                                               code="missing_package"), status_code=400)
            except ClientDisconnect:  # gone before its body was read: nothing to answer or log
                return Response(status_code=499)
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

    def begin_shutdown(self, timeout: float) -> None:
        """Start draining (safe from a signal handler or another thread): admit nothing new,
        give the requests in flight `timeout` seconds, then end them with a 503 error."""
        if self.loop is not None and not self.draining:
            self.draining = True
            self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._drain(timeout)))

    async def _drain(self, timeout: float) -> None:
        deadline = self.loop.time() + timeout
        while self.active and self.loop.time() < deadline:
            await asyncio.sleep(0.02)
        if not self.active:
            return
        logger.warning("shutdown timeout of %gs reached: ending %d request%s still in flight",
                       timeout, len(self.active), "" if len(self.active) == 1 else "s")
        error = APIError(
            503,
            f"the server shut down before this request finished (--shutdown-timeout {timeout:g}s)",
            type="service_unavailable",
            code="server_shutting_down",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
        for gen in list(self.active):
            gen.stop(error)


def build_app(
    engine: EngineClient,
    served_model_name: str | list[str] | None = None,
    api_key: str | None = None,
    max_queue: int | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    cors: dict[str, Any] | None = None,
    **options: Any,
) -> Starlette:
    """The Starlette app serving `engine` (an EngineClient, e.g. AsyncLLM). The engine outlives
    the app: the caller shuts it down. `options`: tool_call_parser, enable_auto_tool_choice,
    reasoning_parser (see OpenAIServer). `cors`: Starlette CORSMiddleware arguments
    (allow_origins, allow_methods, allow_headers, allow_credentials); by default any origin, as
    vLLM's defaults."""
    lora_modules = options.pop("lora_modules", None)  # with --enable-lora: lora_routes.py
    server = OpenAIServer(engine, served_model_name, api_key, max_queue, max_body_bytes, **options)
    e = server.endpoint
    routes = [
        Route("/health", e(server.health, auth=False), methods=["GET"]),
        Route("/metrics", e(server.metrics_endpoint, auth=False), methods=["GET"]),
        Route("/v1/models", e(server.models, auth=True), methods=["GET"]),
        Route("/v1/completions", e(server.completions, auth=True), methods=["POST"]),
        Route("/v1/chat/completions", e(server.chat_completions, auth=True), methods=["POST"]),
        Route("/invocations", e(server.invocations, auth=True), methods=["POST"]),
        Route("/version", e(server.version, auth=False), methods=["GET"]),
        Route("/tokenize", e(server.tokenize, auth=True), methods=["POST"]),
        Route("/detokenize", e(server.detokenize, auth=True), methods=["POST"]),
    ]
    routes += anthropic_routes(server) + responses_routes(server)  # translated onto chat
    routes += pooling_routes(server)  # /v1/embeddings, /pooling, /score, /rerank
    routes += [] if lora_modules is None else lora_routes(server, lora_modules)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        path = request.url.path
        path = path if len(path) <= 200 else path[:200] + "..."  # never echo a huge URL back
        body = error_body(f"{request.method} {path}: {exc.detail}", "invalid_request_error",
                          code=code)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        server.loop = asyncio.get_running_loop()
        yield
        await server.shutdown()

    for line in missing_optional():  # such requests get a 400 naming the install command
        logger.warning("%s", line)
    cors = {**CORS_DEFAULTS, **(cors or {})}
    app = Starlette(
        routes=routes,
        exception_handlers={HTTPException: http_error},
        lifespan=lifespan,
        middleware=[Middleware(CORSMiddleware, **cors)],
    )
    app.state.server = server
    return app


class GracefulServer(uvicorn.Server):
    """uvicorn, plus vLLM's `--shutdown-timeout` on SIGTERM / Ctrl-C: new requests get 503 (with
    Retry-After) at once, requests in flight get `shutdown_timeout` seconds to finish, then every
    open stream ends with an OpenAI error event and `data: [DONE]` and every request still waiting
    for its answer gets a JSON 503. uvicorn's own grace period is only a backstop after that."""

    def __init__(self, config: uvicorn.Config, server: OpenAIServer, shutdown_timeout: float):
        config.timeout_graceful_shutdown = shutdown_timeout + 2
        super().__init__(config)
        self.server = server
        self.shutdown_timeout = shutdown_timeout

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.server.begin_shutdown(self.shutdown_timeout)
        super().handle_exit(sig, frame)
