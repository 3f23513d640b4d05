"""The chat request's fields for tools, thinking and templates: parsing and validation.

What /v1/chat/completions takes besides messages and sampling (vLLM's names and rules):

    tools                   [{"type": "function", "function": {"name", "description",
                              "parameters": <JSON schema>}}]
    tool_choice             "none" | "auto" | "required" | {"type": "function",
                              "function": {"name": ...}}; "auto" when tools are given, else
                              "none"; without tools only "none" is allowed
    chat_template_kwargs    extra variables for the chat template (Qwen3: enable_thinking)
    add_generation_prompt   end the prompt with the assistant's turn header (default true)
    continue_final_message  leave the final (assistant) message open, to be continued
    echo                    start the answer with that final assistant message's content
    parallel_tool_calls     false: keep only the first tool call of an answer

and, inside messages, an assistant's `tool_calls`, a tool result's `tool_call_id`, and `name`:
what a client sends back to replay a tool conversation. Errors are `bad_request`s naming the
field (errors.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tinypaged.entrypoints.openai.errors import bad_request, show
from tinypaged.entrypoints.openai.parsers.forced import tool_choice_schema
from tinypaged.sampling.structured_output import StructuredOutputsParams


@dataclass
class ChatOptions:
    tools: list[dict] | None = None
    tool_choice: str | dict = "none"
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    parallel_tool_calls: bool = True  # False: only the first call is returned (vLLM)
    chat_template: str | None = None  # this request's Jinja template (--trust-request-chat-
    # template), in place of the model's
    add_special_tokens: bool = False  # the tokenizer's own specials (bos) around the rendered
    # prompt too; the template usually writes them itself (vLLM's default: false)
    documents: list[dict] | None = None  # RAG documents, for templates that render them

    @property
    def named_tool(self) -> str | None:
        return self.tool_choice["function"]["name"] if isinstance(self.tool_choice, dict) else None

    def template_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `Tokenizer.apply_chat_template` for these options."""
        return {
            **self.chat_template_kwargs,
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "tools": self.tools,
            **({"documents": self.documents} if self.documents is not None else {}),
            **({"chat_template": self.chat_template} if self.chat_template else {}),
        }


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(
            name, f"'{name}' must be a boolean, got {show(value)}", code="invalid_type"
        )
    return value


def parse_tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools", "'tools' must be a list of tool objects", code="invalid_type")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise bad_request(
                where,
                f"'{where}' must be {{'type': 'function', 'function': {{...}}}}; only function "
                f"tools are supported, got {str(tool)[:80]!r}",
            )
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(
                f"{where}.function.name",
                f"'{where}.function' must be an object with a non-empty string 'name'",
            )
        if not isinstance(fn.get("parameters", {}) or {}, dict):
            raise bad_request(
                f"{where}.function.parameters",
                f"'{where}.function.parameters' must be a JSON schema object",
            )
    return tools


def parse_tool_choice(body: dict, tools: list[dict] | None) -> str | dict:
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if choice == "none":
        return choice
    if tools is None:
        raise bad_request("tool_choice", "When using `tool_choice`, `tools` must be set.")
    if choice in ("auto", "required"):
        return choice if tools or choice == "auto" else "none"
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise bad_request(
            "tool_choice",
            "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', "
            f"'function': {{'name': ...}}}}, got {show(choice)}",
        )
    if name not in [t["function"]["name"] for t in tools]:
        raise bad_request(
            "tool_choice", f"Tool {show(name)} was not found in 'tools'; give it there first"
        )
    return {"type": "function", "function": {"name": name}}


def parse_chat_options(body: dict) -> ChatOptions:
    tools = parse_tools(body.get("tools"))
    opts = ChatOptions(tools=tools, tool_choice=parse_tool_choice(body, tools))
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad_request(
            "chat_template_kwargs", "'chat_template_kwargs' must be an object", code="invalid_type"
        )
    opts.chat_template_kwargs = dict(kwargs or {})
    opts.add_generation_prompt = _bool(body, "add_generation_prompt", True)
    opts.continue_final_message = _bool(body, "continue_final_message", False)
    opts.echo = _bool(body, "echo", False)
    opts.parallel_tool_calls = _bool(body, "parallel_tool_calls", True)
    opts.add_special_tokens = _bool(body, "add_special_tokens", False)
    template = body.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise bad_request("chat_template", "'chat_template' must be a string (a Jinja template)",
                          code="invalid_type")
    opts.chat_template = template
    documents = body.get("documents")
    if documents is not None and not (
        isinstance(documents, list) and all(isinstance(d, dict) for d in documents)
    ):
        raise bad_request("documents", "'documents' must be a list of objects (e.g. {'title', "
                          "'text'})", code="invalid_type")
    opts.documents = documents
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise bad_request(
            "modalities", f"this server answers in text only (['text']), got {show(modalities)}"
        )
    if opts.add_generation_prompt and opts.continue_final_message:
        raise bad_request(
            "continue_final_message",
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True; "
            "set 'add_generation_prompt' to false to continue the final message",
        )
    return opts


def parse_tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's `tool_calls`, with each call's arguments also decoded into
    `function.arguments` as a dict, which is what chat templates iterate over."""
    if not isinstance(calls, list):
        raise bad_request(where, f"'{where}' must be a list of tool calls", code="invalid_type")
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(
                f"{where}[{i}].function",
                f"'{where}[{i}]' must be {{'id', 'type': 'function', 'function': {{'name', "
                "'arguments'}}",
            )
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except json.JSONDecodeError as exc:
                raise bad_request(
                    f"{where}[{i}].function.arguments",
                    f"'{where}[{i}].function.arguments' is not valid JSON: {exc}",
                ) from None
        out.append(
            {
                "id": call.get("id"),
                "type": "function",
                "function": {"name": fn["name"], "arguments": args},
            }
        )
    return out


def message_extras(m: dict, where: str) -> dict:
    """The tool and thinking fields of one incoming message, checked."""
    extras: dict[str, Any] = {}
    for name in ("name", "tool_call_id", "reasoning_content"):
        value = m.get(name)
        if value is None:
            continue
        if not isinstance(value, str):
            raise bad_request(
                f"{where}.{name}", f"'{where}.{name}' must be a string", code="invalid_type"
            )
        extras[name] = value
    if m.get("tool_calls") is not None:
        extras["tool_calls"] = parse_tool_calls(m["tool_calls"], f"{where}.tool_calls")
    return extras


def check_tool_choice(
    opts: ChatOptions | None, sampling: dict[str, Any], auto_ready: bool
) -> None:
    """Check `tool_choice` against the server and add what it needs to `sampling` (the request's
    SamplingParams kwargs). "auto" needs the server's tool parser (`auto_ready`:
    --enable-auto-tool-choice and --tool-call-parser); "required" and a named function constrain
    the output to the JSON of `tool_choice_schema` through structured output."""
    if opts is None or not opts.tools or opts.tool_choice == "none":
        return
    if opts.tool_choice == "auto":
        if not auto_ready:
            raise bad_request(
                "tool_choice",
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set; start the server with them, or send tool_choice 'none', "
                "'required' or a named function",
            )
        # Some models' tool-call tags are special tokens (GLM-4.5's); the parser must see them,
        # so they stay in the text unless the request says otherwise (as vLLM).
        sampling.setdefault("skip_special_tokens", False)
        return
    schema = tool_choice_schema(opts.tools, opts.tool_choice)
    sampling["structured_outputs"] = StructuredOutputsParams(json=schema)
