"""Hermes / Qwen tool calls: JSON objects between <tool_call> tags (vLLM's `hermes` parser).

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Qwen2.5, Qwen3 and Hermes-2/3 models write this; text before the first tag is content.
"""

from __future__ import annotations

from tinypaged.entrypoints.openai.parsers.tool_calls import (
    PartialCall,
    ToolParser,
    held_prefix,
    json_call,
)

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    start = START

    def parse_calls(self, region: str, finished: bool) -> list[PartialCall]:
        calls = []
        for block in region.split(START)[1:]:
            closed = END in block
            body = block.split(END, 1)[0]
            if not closed and not finished:
                body = body[: len(body) - held_prefix(body, END)]
            call = json_call(body.strip() if closed or finished else body, closed or finished)
            if call is None:
                break
            calls.append(call)
        return calls
