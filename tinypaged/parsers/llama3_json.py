"""Llama 3.x JSON tool calls (vLLM's `llama3_json` parser).

Llama 3.1-3.3 answer a tool request with the whole output as JSON object(s), optionally after
the <|python_tag|> token, several separated by ';':

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "f", "parameters": {}}

An output whose first non-space character is anything else is plain content.
"""

from __future__ import annotations

from tinypaged.parsers.tool_calls import JSON_DECODER, PartialCall, ToolParser, json_call

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
        calls = []
        while True:
            while pos < len(region) and region[pos] in " \t\n;":
                pos += 1
            if pos >= len(region) or region[pos] != "{":
                return calls
            try:
                _, end = JSON_DECODER.raw_decode(region, pos)
            except ValueError:
                call = json_call(region[pos:], complete=finished)
                if call is not None:
                    calls.append(call)
                return calls
            call = json_call(region[pos:end], complete=True)
            if call is None:
                return calls
            calls.append(call)
            pos = end
