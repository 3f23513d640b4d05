"""Llama 3.x JSON tool calls (vLLM's `llama3_json` parser).

Llama 3.1-3.3 answer a tool request with the whole output as JSON object(s), optionally after
the <|python_tag|> token, several separated by ';':

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "f", "parameters": {}}

An output whose first non-space character is anything else is plain content.
"""

from __future__ import annotations

from tinypaged.entrypoints.openai.parsers.tool_calls import PartialCall, ToolParser, json_calls

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    start = "{"

    def find_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(PYTHON_TAG) or stripped.startswith("{"):
            return 0  # the calls are the whole output, leading blanks included
        return None

    def held(self, text: str) -> int:
        # Undecided while the output is blank or a prefix of <|python_tag|>.
        stripped = text.strip()
        return len(text) if PYTHON_TAG.startswith(stripped) else 0

    def parse_calls(self, region: str, finished: bool) -> list[PartialCall]:
        region = region.lstrip()
        pos = len(PYTHON_TAG) if region.startswith(PYTHON_TAG) else 0
        return json_calls(region, pos, ";", finished)
