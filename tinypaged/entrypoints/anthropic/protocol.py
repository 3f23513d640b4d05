"""Anthropic Messages request bodies, translated into /v1/chat/completions bodies.

    Messages (Anthropic)                          chat (OpenAI)
    system: str | [{"type": "text", "text"}]      a first {"role": "system"} message
    messages[].content: str | blocks              messages[].content: str, plus:
      {"type": "text", "text"}                      the text
      {"type": "thinking", "thinking"} (assistant)  reasoning_content
      {"type": "tool_use", "id", "name", "input"}   tool_calls[{"id", "function": {"name",
                                                      "arguments": JSON text of input}}]
      {"type": "tool_result", "tool_use_id",        a {"role": "tool", "tool_call_id"} message
       "content": str | text blocks, "is_error"}      per result, before the user's text
    max_tokens (required)                         max_tokens
    stop_sequences                                stop
    temperature, top_p, top_k                     the same
    tools[{"name", "description", "input_schema"}] tools[{"type": "function", "function":
                                                      {"name", "description", "parameters"}}]
    tool_choice {"type": "auto"|"any"|"tool"|     "auto" | "required" | {"type": "function",
      "none", "name", "disable_parallel_tool_use"}   "function": {"name"}} | "none";
                                                    parallel_tool_calls
    thinking {"type": "enabled"|"disabled"}       chat_template_kwargs.enable_thinking
    stream                                        stream, with continuous usage (for
                                                    message_start's input_tokens)

Malformed fields are `bad_request`s naming the Anthropic field; the caller shapes them as
Anthropic errors. Fields this server does not use are logged, as vLLM does (chat_bridge).
"""

from __future__ import annotations

import json
from typing import Any

from tinypaged.entrypoints.chat_bridge import chat_tools, copy_fields, joined_text
from tinypaged.entrypoints.openai.errors import bad_request, show
from tinypaged.entrypoints.openai.protocol import log_ignored

KNOWN_FIELDS = frozenset({
    "model", "messages", "system", "max_tokens", "stop_sequences", "stream", "temperature",
    "top_p", "top_k", "tools", "tool_choice", "thinking", "metadata",
})  # fmt: skip
COUNT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking"})


def _text_of(blocks: Any, where: str) -> str:
    """A string, or a list of text blocks joined: system prompts and tool results."""
    return joined_text(blocks, where, ("text",), "block")


def _user_messages(content: list, where: str) -> list[dict]:
    """A user turn's blocks: each tool_result a tool message, then the text as a user message."""
    out, texts = [], []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise bad_request(f"{at}.tool_use_id", f"'{at}.tool_use_id' must be a string",
                                  code="invalid_type")
            result = _text_of(block.get("content", ""), f"{at}.content")
            if block.get("is_error"):
                result = f"Error: {result}"
            out.append({"role": "tool", "tool_call_id": call_id, "content": result})
        elif kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        else:
            raise bad_request(
                at,
                f"'{at}' is a {show(kind)} block; a user turn takes 'text' and 'tool_result' "
                "blocks (this server serves text-only models)",
                code="unsupported",
            )
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _assistant_message(content: list, where: str) -> dict:
    text, reasoning, calls = [], [], []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # encrypted by another server: nothing this model can read
        elif kind == "tool_use":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("id"), str):
                raise bad_request(at, f"'{at}' (tool_use) needs a string 'id' and 'name'")
            args = block.get("input", {})
            if not isinstance(args, dict):
                raise bad_request(f"{at}.input", f"'{at}.input' must be an object",
                                  code="invalid_type")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(args)}})
        else:
            raise bad_request(
                at,
                f"'{at}' is a {show(kind)} block; an assistant turn takes 'text', 'thinking' "
                "and 'tool_use' blocks",
                code="unsupported",
            )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _messages(body: dict) -> list[dict]:
    out = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": _text_of(body["system"], "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages", "'messages' is required: a non-empty list of messages",
                          code="missing_field")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise bad_request(f"{where}.role",
                              f"'{where}.role' must be 'user' or 'assistant', got {show(role)}")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise bad_request(f"{where}.content",
                              f"'{where}.content' must be a string or a list of content blocks",
                              code="invalid_type")
        elif role == "user":
            out += _user_messages(content, where)
        else:
            out.append(_assistant_message(content, where))
    return out


def _check_tool(where: str, tool: Any) -> None:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise bad_request(where, f"'{where}' must be an object with a string 'name'")
    if tool.get("type") not in (None, "custom"):
        raise bad_request(
            f"{where}.type",
            f"'{where}' is a {show(tool['type'])} server tool; this server runs no tools "
            "of its own, only client tools with an 'input_schema'",
            code="unsupported",
        )


def _tool_choice(choice: Any, chat: dict) -> None:
    if choice is None:
        return
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        chat["tool_choice"] = kind
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise bad_request(
            "tool_choice",
            "'tool_choice' must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', "
            f"'name': ...}}, got {show(choice)}",
        )
    if choice.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False


def to_chat_body(body: Any, count_only: bool = False) -> dict:
    """The /v1/chat/completions body that asks what `body` (a Messages request) asks.
    `count_only`: a count_tokens body (no max_tokens, no sampling)."""
    if not isinstance(body, dict):
        raise bad_request("body", "the request body must be a JSON object", code="invalid_type")
    log_ignored(body, COUNT_FIELDS if count_only else KNOWN_FIELDS, "Anthropic Messages")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": _messages(body)}
    tools = chat_tools(body.get("tools"), "input_schema", _check_tool)
    if tools is not None:
        chat["tools"] = tools
    _tool_choice(body.get("tool_choice"), chat)
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled", "adaptive"):
            raise bad_request("thinking", "'thinking.type' must be 'enabled' or 'disabled', "
                              f"got {show(kind)}")
        chat["chat_template_kwargs"] = {"enable_thinking": kind != "disabled"}
    if count_only:
        return chat
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise bad_request("max_tokens", "'max_tokens' is a required field", code="missing_field")
    chat["max_tokens"] = max_tokens
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    copy_fields(body, chat, ("temperature", "top_p", "top_k", "stream"))
    return chat
