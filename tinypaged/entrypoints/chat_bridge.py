"""What the Anthropic Messages and OpenAI Responses translators share: they run the chat path.

Both APIs are translators (ARCHITECTURE.md, "Where wave 3 fits"): a body of theirs becomes a
/v1/chat/completions body, the OpenAI server answers it as it answers any chat request (same
parsing, template, tool and reasoning parsers, disconnect handling), and the chat answer is
turned back into their shape. The engine never sees their JSON. This module holds the common
steps:

    run_chat(server, request, chat_body)   the chat answer: a dict, an EventStream of chat
                                           chunks, or a bare Response (the client hung up)
    ChatEvents                             a chat stream's chunks as typed events
                                           (reasoning / text / tool call start / arguments /
                                           finish / usage / error)
    restream(stream, events)               the same EventStream, re-framed by the translator

and, for building the chat body, the parts both request shapes have alike:

    joined_text(content, where, kinds, noun)   a string, or a list of text parts, as one string
    chat_tools(tools, schema_key, check)       a list of client tools as chat function tools
    copy_fields(body, chat, names)             settings passed through as they are; a stream
                                               asks for continuous usage

and the translators log the fields they do not use with protocol.log_ignored, as chat does.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tinypaged.entrypoints.openai.errors import bad_request, show
from tinypaged.entrypoints.openai.request_handler import EventStream

if TYPE_CHECKING:
    from tinypaged.entrypoints.openai.api_server import OpenAIServer


def joined_text(content: Any, where: str, kinds: tuple[str, ...], noun: str) -> str:
    """`content` as one string: a string, or a list of text {noun}s (dicts whose "type" is one
    of `kinds`, with a string "text") joined. Anything else is a 400 naming `where`."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(where, f"'{where}' must be a string or a list of text {noun}s",
                          code="invalid_type")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise bad_request(
                f"{where}[{i}]",
                f"'{where}[{i}]' is a {show(kind)} {noun}; only text {noun}s are supported "
                "(this server serves text-only models)",
                code="unsupported",
            )
        texts.append(part["text"])
    return "".join(texts)


def chat_tools(tools: Any, schema_key: str, check: Callable[[str, Any], None]
               ) -> list[dict] | None:
    """`tools` (None, or a list whose items each pass `check(where, tool)`, which raises) as
    chat function tools; a tool's parameters are its `schema_key` (any object when unset)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools", "'tools' must be a list of tools", code="invalid_type")
    out = []
    for i, tool in enumerate(tools):
        check(f"tools[{i}]", tool)
        fn = {"name": tool["name"], "parameters": tool.get(schema_key) or {"type": "object"}}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def copy_fields(body: dict, chat: dict, names: tuple[str, ...]) -> None:
    """The fields `names` of `body` that are set, into `chat` as they are. A stream asks for
    usage on every chunk: the translators' first event reports the prompt's tokens."""
    for name in names:
        if body.get(name) is not None:
            chat[name] = body[name]
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}


async def run_chat(
    server: OpenAIServer, request: Request, chat_body: dict
) -> dict | EventStream | Response:
    """Answer `chat_body` on the chat path: the chat.completion body (non-streaming), the
    EventStream of chat chunks (streaming), or a bare Response when there is nothing to
    translate (the client hung up). APIErrors propagate for the caller to shape."""
    response = await server.chat_completions(request, chat_body)
    if isinstance(response, EventStream):
        return response
    if isinstance(response, JSONResponse) and response.status_code == 200:
        return json.loads(response.body)
    return response


def restream(
    stream: EventStream, translate: Callable[[AsyncIterator[dict | str]], AsyncIterator[bytes]]
) -> EventStream:
    """`stream` (SSE chat chunks) re-framed by `translate`, which reads the chunks as dicts
    (and the final "[DONE]") and yields the bytes to send; closing it closes the generation."""

    async def chunks() -> AsyncIterator[dict | str]:
        async for data in stream.events:
            for line in data.decode().split("\n"):
                if line.startswith("data: "):
                    payload = line[len("data: ") :]
                    yield payload if payload == "[DONE]" else json.loads(payload)

    return EventStream(translate(chunks()), stream.on_close)


@dataclass
class ChatEvent:
    """One step of a chat stream, as the translators need it.

    kind: "reasoning" | "text" (text) · "tool_start" (tool index, call id, name) ·
    "tool_args" (tool index, text) · "finish" (finish_reason, stop_reason) · "usage" (usage) ·
    "error" (error: the OpenAI error object)
    """

    kind: str
    text: str = ""
    tool: int = 0
    call_id: str = ""
    name: str = ""
    finish_reason: str | None = None
    stop_reason: Any = None
    usage: dict = field(default_factory=dict)
    error: dict = field(default_factory=dict)


class ChatEvents:
    """Reads the chunks of one chat stream (choice 0, with continuous usage) as ChatEvents.

    `usage` always holds the latest usage seen (prompt tokens from the first chunk on). Text
    that is only whitespace so far (Qwen3's "\n\n" between </think> and a tool call) is held
    back until real text follows, so that it opens no text block of its own (`has_text`)."""

    def __init__(self) -> None:
        self.usage: dict = {"prompt_tokens": 0, "completion_tokens": 0}
        self.held = ""  # whitespace-only text not sent yet
        self.text_sent = False

    def events(self, chunk: dict | str) -> list[ChatEvent]:
        if chunk == "[DONE]":
            return []
        if "error" in chunk:
            return [ChatEvent("error", error=chunk["error"])]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out: list[ChatEvent] = []
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out.append(ChatEvent("reasoning", text=delta["reasoning_content"]))
            if delta.get("content"):
                text = self.held + delta["content"]
                if self.text_sent or text.strip():
                    out.append(ChatEvent("text", text=text))
                    self.held, self.text_sent = "", True
                else:
                    self.held = text
            for call in delta.get("tool_calls") or []:
                fn = call.get("function") or {}
                if call.get("id"):
                    out.append(
                        ChatEvent("tool_start", tool=call["index"], call_id=call["id"],
                                  name=fn.get("name") or "")
                    )
                if fn.get("arguments"):
                    out.append(ChatEvent("tool_args", tool=call["index"], text=fn["arguments"]))
            if choice.get("finish_reason"):
                out.append(
                    ChatEvent("finish", finish_reason=choice["finish_reason"],
                              stop_reason=choice.get("stop_reason"))
                )
        if not chunk.get("choices") and chunk.get("usage"):
            out.append(ChatEvent("usage", usage=chunk["usage"]))
        return out


def has_text(content: str | None) -> bool:
    """Whether a whole answer's content makes a text block (see ChatEvents)."""
    return bool(content and content.strip())


def cached_tokens(usage: dict) -> int | None:
    details = usage.get("prompt_tokens_details") or {}
    return details.get("cached_tokens")
