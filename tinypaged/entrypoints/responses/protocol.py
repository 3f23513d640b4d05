"""OpenAI Responses request bodies, translated into /v1/chat/completions bodies.

    Responses                                     chat
    instructions                                  a first {"role": "system"} message
    input: str                                    one user message
    input: items                                  messages:
      {"role", "content": str | [{"type":            a message ("developer" is "system");
        "input_text" | "output_text", "text"}]}       parts joined as text
      {"type": "reasoning", "content" |             the next assistant message's
        "summary": [{"text"}]}                        reasoning_content
      {"type": "function_call", "call_id",          that assistant message's tool_calls
        "name", "arguments"}
      {"type": "function_call_output",              a {"role": "tool", "tool_call_id"} message
        "call_id", "output"}
    tools [{"type": "function", "name",           tools [{"type": "function", "function":
      "description", "parameters"}]                 {...}}]
    tool_choice "auto"|"none"|"required"|         the same | {"type": "function",
      {"type": "function", "name"}                  "function": {"name"}}
    text.format {"type": "text" | "json_object"   response_format (json_schema:
      | "json_schema", "name", "schema"}            {"json_schema": {"name", "schema"}})
    max_output_tokens                             max_tokens
    temperature, top_p, top_k, parallel_tool_calls, stream   the same
    reasoning.effort "none"                       chat_template_kwargs.enable_thinking false

The server is stateless: `store` true, `previous_response_id`, `conversation`, `background` and
`item_reference` items ask for state it does not keep, and are 400s saying so. Fields it does
not use are logged, as vLLM does (protocol.log_ignored).
"""

from __future__ import annotations

from typing import Any

from tinypaged.entrypoints.chat_bridge import chat_tools, copy_fields, joined_text
from tinypaged.entrypoints.openai.errors import bad_request, show
from tinypaged.entrypoints.openai.protocol import log_ignored

KNOWN_FIELDS = frozenset({
    "model", "input", "instructions", "tools", "tool_choice", "text", "max_output_tokens",
    "temperature", "top_p", "top_k", "stream", "store", "parallel_tool_calls", "reasoning",
    "metadata", "user", "previous_response_id", "conversation", "background", "truncation",
})  # fmt: skip
STATELESS = (
    "this server is stateless: it stores no responses or conversations, so send the whole "
    "conversation in 'input' (and 'store': false)"
)


TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text", "summary_text")


def _text(content: Any, where: str) -> str:
    return joined_text(content, where, TEXT_PARTS, "part")


def _assistant(out: list[dict], fresh: bool) -> dict:
    """The assistant message that assistant-side items are gathered into (a new one unless the
    last message is one this run of items opened)."""
    if not fresh and out and out[-1]["role"] == "assistant":
        return out[-1]
    out.append({"role": "assistant", "content": ""})
    return out[-1]


def _messages(body: dict) -> list[dict]:
    out: list[dict] = []
    if body.get("instructions") is not None:
        out.append({"role": "system", "content": _text(body["instructions"], "instructions")})
    items = body.get("input")
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("input", "'input' is required: a string or a non-empty list of items",
                          code="missing_field")
    gathering = False  # the last message is an assistant message items are gathered into
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(where, f"'{where}' must be an object", code="invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{where}.role", f"'{where}.role' must be 'user', 'assistant', "
                                  f"'system' or 'developer', got {show(role)}")
            text = _text(item.get("content"), f"{where}.content")
            if role == "assistant":
                message = _assistant(out, not gathering)
                message["content"] += text
            else:
                out.append({"role": "system" if role == "developer" else role, "content": text})
            gathering = role == "assistant"
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            message = _assistant(out, not gathering)
            message["reasoning_content"] = message.get("reasoning_content", "") + _text(
                parts, f"{where}.content")
            gathering = True
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise bad_request(where, f"'{where}' (function_call) needs string 'call_id', "
                                  "'name' and 'arguments'")
            message = _assistant(out, not gathering)
            message.setdefault("tool_calls", []).append({
                "id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}})
            gathering = True
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}.call_id", f"'{where}.call_id' must be a string",
                                  code="invalid_type")
            output = _text(item.get("output", ""), f"{where}.output")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
            gathering = False
        elif kind == "item_reference":
            raise bad_request(where, f"'{where}' is an item_reference; {STATELESS}",
                              code="unsupported")
        else:
            raise bad_request(
                f"{where}.type",
                f"'{where}.type' {show(kind)} is not supported; items may be messages, "
                "'reasoning', 'function_call' and 'function_call_output'",
                code="unsupported",
            )
    return out


def _check_tool(where: str, tool: Any) -> None:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function" or not isinstance(tool.get("name"), str):
        raise bad_request(
            where,
            f"'{where}' is a {show(kind)} tool; only function tools "
            "({'type': 'function', 'name', 'parameters'}) are supported: this server runs "
            "no tools of its own",
            code="unsupported",
        )


def _response_format(text: Any) -> dict | None:
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": spec}
    raise bad_request("text.format", "'text.format.type' must be 'text', 'json_object' or "
                      f"'json_schema', got {show(kind)}")


def to_chat_body(body: Any) -> dict:
    """The /v1/chat/completions body that asks what `body` (a Responses request) asks."""
    if not isinstance(body, dict):
        raise bad_request("body", "the request body must be a JSON object", code="invalid_type")
    log_ignored(body, KNOWN_FIELDS, "Responses")
    for name in ("previous_response_id", "conversation"):
        if body.get(name) is not None:
            raise bad_request(name, f"'{name}' needs a stored response; {STATELESS}",
                              code="unsupported")
    if body.get("store"):
        raise bad_request("store", f"'store' must be false: {STATELESS}", code="unsupported")
    if body.get("background"):
        raise bad_request("background", "'background' must be false: " + STATELESS,
                          code="unsupported")
    if body.get("truncation") not in (None, "disabled"):
        raise bad_request("truncation", "only 'truncation': 'disabled' is supported: a prompt "
                          "over the context is a 400, never cut")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": _messages(body)}
    tools = chat_tools(body.get("tools"), "parameters", _check_tool)
    if tools is not None:
        chat["tools"] = tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None:
        chat["tool_choice"] = choice
    fmt = _response_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") == "none":
        chat["chat_template_kwargs"] = {"enable_thinking": False}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    copy_fields(body, chat, ("temperature", "top_p", "top_k", "parallel_tool_calls", "stream"))
    return chat
