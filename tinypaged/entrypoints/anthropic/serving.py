"""The Anthropic Messages endpoints: POST /v1/messages and /v1/messages/count_tokens.

A request is translated into a chat request (protocol.py) and answered on the chat path
(chat_bridge.run_chat); the chat answer is translated back:

    {"id": "msg_...", "type": "message", "role": "assistant", "model",
     "content": [{"type": "thinking", "thinking", "signature"}, {"type": "text", "text"},
                 {"type": "tool_use", "id", "name", "input": {...}}],
     "stop_reason": "end_turn" | "max_tokens" | "stop_sequence" | "tool_use",
     "stop_sequence": str | null, "usage": {"input_tokens", "output_tokens", ...}}

A stream is Anthropic's server-sent events (`event: <type>` and `data: <json>`): message_start,
ping, then per content block content_block_start / content_block_delta (text_delta,
thinking_delta, input_json_delta) / content_block_stop, then message_delta (stop_reason, usage)
and message_stop. Errors have Anthropic's shape, {"type": "error", "error": {"type", "message"}},
with the HTTP status the chat path chose; mid-stream, an `error` event.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tinypaged.entrypoints.anthropic.protocol import to_chat_body
from tinypaged.entrypoints.chat_bridge import (
    ChatEvents,
    cached_tokens,
    has_text,
    restream,
    run_chat,
)
from tinypaged.entrypoints.openai.errors import APIError
from tinypaged.entrypoints.openai.protocol import parse_chat_request
from tinypaged.entrypoints.openai.request_handler import EventStream
from tinypaged.entrypoints.openai.response_bodies import new_id

if TYPE_CHECKING:
    from tinypaged.entrypoints.openai.api_server import OpenAIServer

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"),
                                       "message": message}}


def stop_reason(finish_reason: str | None, stop: Any, called: bool) -> tuple[str, str | None]:
    """(Anthropic's stop_reason, stop_sequence) of a chat choice's finish."""
    if called:
        return "tool_use", None
    if finish_reason == "stop" and isinstance(stop, str):
        return "stop_sequence", stop
    return STOP_REASONS.get(finish_reason or "", "end_turn"), None


def usage_body(usage: dict) -> dict:
    body = {"input_tokens": usage.get("prompt_tokens", 0),
            "output_tokens": usage.get("completion_tokens", 0)}
    cached = cached_tokens(usage)
    if cached is not None:
        body["cache_read_input_tokens"] = cached
    return body


def tool_input(arguments: str) -> dict:
    """A call's arguments as tool_use's `input` object; arguments cut short (max_tokens) are not
    JSON and give {}, with a warning."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        logger.warning("tool call arguments are not a JSON object (cut short?): %.200s", arguments)
        return {}
    return value


def message_body(chat: dict, msg_id: str) -> dict:
    """A chat.completion body as an Anthropic message."""
    choice = chat["choices"][0]
    message = choice["message"]
    content: list[dict] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"],
                        "signature": ""})
    if has_text(message.get("content")):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        content.append({"type": "tool_use", "id": call["id"], "name": fn["name"],
                        "input": tool_input(fn["arguments"])})
    reason, sequence = stop_reason(
        choice["finish_reason"], choice.get("stop_reason"), bool(message.get("tool_calls"))
    )
    return {"id": msg_id, "type": "message", "role": "assistant", "model": chat["model"],
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage_body(chat["usage"])}


def event(kind: str, data: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


async def message_events(
    chunks: AsyncIterator[dict | str], msg_id: str, model: str
) -> AsyncIterator[bytes]:
    """Chat chunks as Anthropic's stream: each reasoning / text / tool call run is a block."""
    reader = ChatEvents()
    block: tuple | None = None  # the open block: ("thinking" | "text", ) or ("tool", index)
    index, called, finish = -1, False, ("end_turn", None)

    def open_block(key: tuple, content_block: dict) -> list[bytes]:
        nonlocal block, index
        out = [] if block is None else [event("content_block_stop", {"index": index})]
        block, index = key, index + 1
        return out + [event("content_block_start", {"index": index,
                                                    "content_block": content_block})]

    started = False
    async for chunk in chunks:
        evs = reader.events(chunk)
        if evs and evs[0].kind == "error":
            status = 503 if evs[0].error.get("type") == "service_unavailable" else 500
            yield event("error", {"error": error_body(status, evs[0].error["message"])["error"]})
            return
        if not started and chunk != "[DONE]":
            started = True
            usage = {**usage_body(reader.usage), "output_tokens": 0}
            yield event("message_start", {"message": {
                "id": msg_id, "type": "message", "role": "assistant", "model": model,
                "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}})
            yield event("ping", {})
        for ev in evs:
            if ev.kind == "reasoning":
                if block != ("thinking",):
                    for b in open_block(("thinking",), {"type": "thinking", "thinking": "",
                                                        "signature": ""}):
                        yield b
                yield event("content_block_delta", {"index": index, "delta": {
                    "type": "thinking_delta", "thinking": ev.text}})
            elif ev.kind == "text":
                if block != ("text",):
                    for b in open_block(("text",), {"type": "text", "text": ""}):
                        yield b
                yield event("content_block_delta", {"index": index, "delta": {
                    "type": "text_delta", "text": ev.text}})
            elif ev.kind == "tool_start":
                called = True
                for b in open_block(("tool", ev.tool), {"type": "tool_use", "id": ev.call_id,
                                                        "name": ev.name, "input": {}}):
                    yield b
            elif ev.kind == "tool_args" and block == ("tool", ev.tool):
                yield event("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": ev.text}})
            elif ev.kind == "finish":
                finish = stop_reason(ev.finish_reason, ev.stop_reason, called)
    if block is not None:
        yield event("content_block_stop", {"index": index})
    usage = usage_body(reader.usage)
    yield event("message_delta", {"delta": {"stop_reason": finish[0], "stop_sequence": finish[1]},
                                  "usage": usage})
    yield event("message_stop", {})


class AnthropicServer:
    """The Messages endpoints of one OpenAIServer (its engine, model names, limits)."""

    def __init__(self, server: OpenAIServer):
        self.server = server

    def check_auth(self, request: Request) -> None:
        """Anthropic's clients send the key as `x-api-key`; `Authorization: Bearer` works too."""
        key = self.server.api_key
        given = request.headers.get("x-api-key")
        if key is None or given is None:
            return self.server.check_auth(request)
        if not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise APIError(401, "invalid API key: send the server's key as 'x-api-key'")

    async def messages(self, request: Request) -> Response:
        chat = to_chat_body(await self.server.read_json(request))
        answer = await run_chat(self.server, request, chat)
        msg_id = new_id("msg")
        if isinstance(answer, dict):
            return JSONResponse(message_body(answer, msg_id))
        if isinstance(answer, EventStream):
            model = self.server.check_model(chat.get("model"))
            return restream(answer, lambda chunks: message_events(chunks, msg_id, model))
        return answer

    async def count_tokens(self, request: Request) -> Response:
        chat = to_chat_body(await self.server.read_json(request), count_only=True)
        req = parse_chat_request(chat)
        self.server.check_model(req.model)
        prompt = await self.server._chat_prompt(req.messages, req.chat)
        return JSONResponse({"input_tokens": len(prompt)})

    def endpoint(self, fn):
        async def handler(request: Request) -> Response:
            try:
                self.check_auth(request)
                return await fn(request)
            except APIError as exc:
                return JSONResponse(error_body(exc.status, exc.message), status_code=exc.status,
                                    headers=exc.headers)
            except ClientDisconnect:
                return Response(status_code=499)
            except Exception as exc:  # a bug or engine fault: this request fails, the server lives
                logger.exception("request to %s failed", request.url.path)
                return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}: "
                                                    f"{exc}"), status_code=500)

        return handler


def anthropic_routes(server: OpenAIServer) -> list[Route]:
    api = AnthropicServer(server)
    return [
        Route("/v1/messages", api.endpoint(api.messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", api.endpoint(api.count_tokens), methods=["POST"]),
    ]
