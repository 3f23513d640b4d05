"""The OpenAI Responses endpoint: POST /v1/responses (stateless).

A request is translated into a chat request (protocol.py), answered on the chat path
(chat_bridge.run_chat), and the chat answer becomes a response object:

    {"id": "resp_...", "object": "response", "status": "completed" | "incomplete",
     "incomplete_details": {"reason": "max_output_tokens"} | null, "model",
     "output": [{"type": "reasoning", "content": [{"type": "reasoning_text", "text"}]},
                {"type": "message", "role": "assistant",
                 "content": [{"type": "output_text", "text", "annotations": []}]},
                {"type": "function_call", "call_id", "name", "arguments"}],
     "usage": {"input_tokens", "input_tokens_details": {"cached_tokens"}, "output_tokens",
               "output_tokens_details": {"reasoning_tokens"}, "total_tokens"}, ...}

A stream is the Responses events (`event: <type>`, `data: <json>` with a sequence_number):
response.created, response.in_progress, then per output item response.output_item.added,
its deltas (response.reasoning_text.delta; response.content_part.added and
response.output_text.delta; response.function_call_arguments.delta), their .done events and
response.output_item.done, and last response.completed (or response.incomplete). Errors keep
OpenAI's error body; mid-stream, an `error` event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tinypaged.entrypoints.chat_bridge import (
    ChatEvents,
    cached_tokens,
    has_text,
    restream,
    run_chat,
)
from tinypaged.entrypoints.openai.request_handler import EventStream
from tinypaged.entrypoints.openai.response_bodies import new_id, now
from tinypaged.entrypoints.responses.protocol import to_chat_body

if TYPE_CHECKING:
    from tinypaged.entrypoints.openai.api_server import OpenAIServer


def reasoning_item(text: str, item_id: str | None = None, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id or new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str | None, item_id: str | None = None, status: str = "completed"
                 ) -> dict:
    return {"type": "message", "id": item_id or new_id("msg"), "status": status,
            "role": "assistant", "content": [] if text is None else [text_part(text)]}


def call_item(call_id: str, name: str, arguments: str, item_id: str | None = None,
              status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


class ResponsesServer:
    """One /v1/responses request on an OpenAIServer (its engine, model names, limits)."""

    def __init__(self, server: OpenAIServer):
        self.server = server

    def response_body(self, body: dict, output: list[dict], usage: dict,
                      finish_reason: str | None, status: str | None = None) -> dict:
        """The response object around `output` (the echo of the request's settings included,
        as OpenAI's)."""
        tok = self.server.engine.tokenizer
        reasoning = "".join(c["text"] for item in output if item["type"] == "reasoning"
                            for c in item["content"])
        # The chat path reports the reasoning as text: its tokens are re-counted here.
        reasoning_tokens = len(tok.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        incomplete = finish_reason == "length"
        text = body.get("text") if isinstance(body.get("text"), dict) else {}
        return {
            "id": self.response_id, "object": "response", "created_at": self.created,
            "status": status or ("incomplete" if incomplete else "completed"),
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None, "model": self.model, "output": output,
            "instructions": body.get("instructions"), "metadata": body.get("metadata"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools", []),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": None, "reasoning": body.get("reasoning"),
            "store": False, "background": False, "truncation": "disabled",
            "text": {"format": text.get("format") or {"type": "text"}},
            "usage": None if usage is None else {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": cached_tokens(usage) or 0},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
            },
        }

    async def responses(self, request: Request) -> Response:
        body = await self.server.read_json(request)
        chat = to_chat_body(body)
        self.model = self.server.check_model(chat.get("model"))
        self.response_id, self.created = new_id("resp"), now()
        answer = await run_chat(self.server, request, chat)
        if isinstance(answer, EventStream):
            return restream(answer, lambda chunks: self.events(chunks, body))
        if not isinstance(answer, dict):
            return answer
        choice = answer["choices"][0]
        message = choice["message"]
        output = []
        if message.get("reasoning_content"):
            output.append(reasoning_item(message["reasoning_content"]))
        if has_text(message.get("content")):
            output.append(message_item(message["content"]))
        for call in message.get("tool_calls") or []:
            fn = call["function"]
            output.append(call_item(call["id"], fn["name"], fn["arguments"]))
        return JSONResponse(
            self.response_body(body, output, answer["usage"], choice["finish_reason"])
        )

    async def events(
        self, chunks: AsyncIterator[dict | str], body: dict
    ) -> AsyncIterator[bytes]:
        """Chat chunks as Responses events: each reasoning / text / tool call run an item."""
        reader = ChatEvents()
        output: list[dict] = []  # finished items
        item: dict | None = None  # the open item
        seq = 0
        finish = None

        def event(kind: str, **data: Any) -> bytes:
            nonlocal seq
            seq += 1
            payload = {"type": kind, "sequence_number": seq - 1, **data}
            return f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()

        def close() -> list[bytes]:
            nonlocal item
            if item is None:
                return []
            out, where = [], {"item_id": item["id"], "output_index": len(output)}
            if item["type"] == "reasoning":
                text = item["content"][0]["text"]
                out.append(event("response.reasoning_text.done", **where, content_index=0,
                                 text=text))
            elif item["type"] == "message":
                part = item["content"][0]
                out.append(event("response.output_text.done", **where, content_index=0,
                                 text=part["text"], logprobs=[]))
                out.append(event("response.content_part.done", **where, content_index=0,
                                 part=part))
            else:
                out.append(event("response.function_call_arguments.done", **where,
                                 name=item["name"], arguments=item["arguments"]))
            item["status"] = "completed"
            out.append(event("response.output_item.done", output_index=len(output), item=item))
            output.append(item)
            item = None
            return out

        def open_item(new: dict) -> list[bytes]:
            nonlocal item
            out = close()
            item = new
            shown = {**new, "content": []} if new["type"] != "function_call" else new
            out.append(event("response.output_item.added", output_index=len(output),
                             item=shown))
            if new["type"] == "message":
                out.append(event("response.content_part.added", item_id=new["id"],
                                 output_index=len(output), content_index=0,
                                 part=text_part("")))
            return out

        start = self.response_body(body, [], None, None, status="in_progress")
        yield event("response.created", response=start)
        yield event("response.in_progress", response=start)
        async for chunk in chunks:
            for ev in reader.events(chunk):
                where = {"output_index": len(output)}
                if ev.kind == "error":
                    yield event("error", code=ev.error.get("code"),
                                message=ev.error["message"], param=ev.error.get("param"))
                    return
                if ev.kind == "reasoning":
                    if item is None or item["type"] != "reasoning":
                        for b in open_item(reasoning_item("", status="in_progress")):
                            yield b
                    item["content"][0]["text"] += ev.text
                    yield event("response.reasoning_text.delta", item_id=item["id"], **where,
                                content_index=0, delta=ev.text)
                elif ev.kind == "text":
                    if item is None or item["type"] != "message":
                        for b in open_item(message_item("", status="in_progress")):
                            yield b
                    item["content"][0]["text"] += ev.text
                    yield event("response.output_text.delta", item_id=item["id"], **where,
                                content_index=0, delta=ev.text, logprobs=[])
                elif ev.kind == "tool_start":
                    for b in open_item(call_item(ev.call_id, ev.name, "", status="in_progress")):
                        yield b
                elif ev.kind == "tool_args" and item is not None:
                    item["arguments"] += ev.text
                    yield event("response.function_call_arguments.delta", item_id=item["id"],
                                **where, delta=ev.text)
                elif ev.kind == "finish":
                    finish = ev.finish_reason
        for b in close():
            yield b
        final = self.response_body(body, output, reader.usage, finish)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield event(kind, response=final)


def responses_routes(server: OpenAIServer) -> list[Route]:
    """POST /v1/responses, behind the OpenAI server's auth and error handling."""
    async def handler(request: Request) -> Response:
        return await ResponsesServer(server).responses(request)

    return [Route("/v1/responses", server.endpoint(handler, auth=True), methods=["POST"])]
