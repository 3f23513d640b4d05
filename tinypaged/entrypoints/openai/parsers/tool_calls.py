"""Tool calls in generated text: what every tool-call parser shares, and the streaming of them.

A model asked to call tools writes them in its own format after (optionally) some plain text:

    hermes       Let me look.<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>
    llama3_json  {"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}
    glm45        <tool_call>f\n<arg_key>x</arg_key>\n<arg_value>1</arg_value>\n</tool_call>

A parser (one module per format) says where the calls begin (`find_start`) and reads the calls
out of the text from there (`parse_calls`), each as a `PartialCall`: the name once it is whole,
and the arguments' JSON text as far as it is certain. "Certain" means it only ever grows: a later
call of `parse_calls` on a longer text returns arguments that start with the earlier ones. That
one rule makes streaming generic (`ToolCallStream`): each step sends the text before the calls as
`content`, then per call a header (index, id, name) and the new piece of its arguments, which is
OpenAI's delta shape:

    {"tool_calls": [{"index": 0, "id": "call_...", "type": "function",
                     "function": {"name": "f", "arguments": "{\"x\": "}}]}
    {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}

The whole-text answer (`extract_tool_calls`) is the last state of the same parse, so a streamed
and a non-streamed answer carry the same arguments text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

JSON_DECODER = json.JSONDecoder()
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


@dataclass
class PartialCall:
    name: str | None  # None until the whole name has been written
    arguments: str  # JSON text of the arguments object, as far as it is certain
    done: bool  # the call is complete


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or new_call_id()

    def as_dict(self) -> dict:
        """The OpenAI shape of one call in a message's `tool_calls`."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def held_prefix(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def json_call(body: str, complete: bool) -> PartialCall | None:
    """A call written as a JSON object {"name": ..., "arguments" | "parameters": {...}}.

    `complete`: no more text will come for this call. The arguments are the object's own text,
    cut from `body`; while unfinished, everything after the key is certain (an arguments object
    that has not closed cannot be followed by anything else)."""
    name = _NAME.search(body)
    args = _ARGS.search(body)
    arguments = ""
    args_closed = False
    if args is not None:
        rest = body[args.end() :]
        try:
            value, end = JSON_DECODER.raw_decode(rest)
            arguments, args_closed = rest[:end], True
            if isinstance(value, str):  # some models write the arguments as a JSON string
                arguments = value
        except json.JSONDecodeError:
            arguments = rest.rstrip() if complete else rest
    if complete:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        if not args_closed:
            value = obj.get("arguments", obj.get("parameters", {}))
            arguments = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        return PartialCall(obj["name"], arguments, True)
    return PartialCall(json.loads(f'"{name.group(1)}"') if name else None, arguments, False)


def json_calls(region: str, pos: int, separators: str, finished: bool) -> list[PartialCall]:
    """The JSON-object calls of `region` from `pos` on, one after the other with any of
    `separators` (and whitespace) between them; the last may still be unfinished."""
    calls = []
    while True:
        while pos < len(region) and region[pos] in " \t\n" + separators:
            pos += 1
        if pos >= len(region) or region[pos] != "{":
            return calls
        try:
            _, end = JSON_DECODER.raw_decode(region, pos)
        except ValueError:
            call = json_call(region[pos:], complete=finished)
            return calls + [call] if call is not None else calls
        call = json_call(region[pos:end], complete=True)
        if call is None:
            return calls
        calls.append(call)
        pos = end


class ToolParser:
    """One model family's tool-call format. Subclasses set `start` and write `parse_calls`."""

    start: str = ""  # the marker where the first tool call begins

    max_calls: int | None = None  # parallel_tool_calls=false: 1

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools = tools or []

    def find_start(self, text: str) -> int | None:
        """Where the tool calls begin in `text`, or None if they do not (yet)."""
        at = text.find(self.start)
        return None if at < 0 else at

    def held(self, text: str) -> int:
        """Trailing characters of `text` that must not stream as content yet: they may begin
        the start marker."""
        return held_prefix(text, self.start)

    def parse_calls(self, region: str, finished: bool) -> list[PartialCall]:
        """The calls in `region` (the text from `find_start` on)."""
        raise NotImplementedError

    def extract_tool_calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output; text that does not parse stays content."""
        start = self.find_start(text)
        if start is None:
            return text, []
        calls = [
            ToolCall(c.name, c.arguments)
            for c in self.parse_calls(text[start:], finished=True)
            if c.done and c.name
        ][: self.max_calls]
        if not calls:
            return text, []
        return text[:start] or None, calls


class ToolCallStream:
    """One choice's streamed tool calls: `update(text)` with the cumulative text returns the
    delta to send now (content and/or tool_calls), or None."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.content_sent = 0
        self.ids: list[str] = []  # the id of each call whose header went out
        self.args_sent: list[int] = []

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def update(self, text: str, finished: bool) -> dict[str, Any] | None:
        delta: dict[str, Any] = {}
        start = self.parser.find_start(text)
        if start is not None:
            end = start
        else:
            end = len(text) - (0 if finished else self.parser.held(text))
        if end > self.content_sent:
            delta["content"] = text[self.content_sent : end]
            self.content_sent = end
        if start is not None:
            parsed = self.parser.parse_calls(text[start:], finished)[: self.parser.max_calls]
            calls = self._calls(parsed)
            if calls:
                delta["tool_calls"] = calls
            elif finished and not self.ids and len(text) > self.content_sent:
                # What looked like a call did not parse: it was content after all (as in
                # extract_tool_calls).
                delta["content"] = delta.get("content", "") + text[self.content_sent :]
                self.content_sent = len(text)
        return delta or None

    def _calls(self, calls: list[PartialCall]) -> list[dict]:
        out = []
        for i, call in enumerate(calls):
            if call.name is None:
                break  # calls stream in order: a later one waits for this one's name
            entry: dict[str, Any] = {"index": i}
            if i == len(self.ids):
                self.ids.append(new_call_id())
                self.args_sent.append(0)
                entry.update(id=self.ids[i], type="function")
                entry["function"] = {"name": call.name, "arguments": ""}
            piece = call.arguments[self.args_sent[i] :]
            if piece:
                entry.setdefault("function", {})["arguments"] = piece
                self.args_sent[i] = len(call.arguments)
            if len(entry) > 1:
                out.append(entry)
        return out
