"""Tool calls forced by `tool_choice`: the output is JSON by construction (vLLM's way).

With `tool_choice` "required" or a named function, the server asks structured output to
constrain the text to a JSON schema (`tool_choice_schema`), and the text is then read without
any model-specific parser:

    required        [{"name": "f", "parameters": {"x": 1}}, {"name": "g", "parameters": {}}]
    named function  {"x": 1}                      (the arguments of that one function)
"""

from __future__ import annotations

from tinypaged.entrypoints.openai.parsers.tool_calls import PartialCall, ToolParser, json_calls


def tool_choice_schema(tools: list[dict], tool_choice: str | dict) -> dict:
    """The JSON schema the output must follow for this tool_choice."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        fn = next(t["function"] for t in tools if t["function"]["name"] == name)
        return fn.get("parameters") or {"type": "object", "properties": {}}
    one_call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t["function"]["name"]]},
                    "parameters": t["function"].get("parameters")
                    or {"type": "object", "properties": {}},
                },
                "required": ["name", "parameters"],
            }
            for t in tools
        ]
    }
    return {"type": "array", "minItems": 1, "items": one_call}


class NamedToolParser(ToolParser):
    """The whole output is the arguments of one function."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def find_start(self, text: str) -> int | None:
        return 0

    def parse_calls(self, region: str, finished: bool) -> list[PartialCall]:
        return [PartialCall(self.name, region.strip() if finished else region, finished)]


class RequiredToolParser(ToolParser):
    """The output is a JSON list of {"name", "parameters"} objects."""

    def find_start(self, text: str) -> int | None:
        at = text.find("[")
        return None if at < 0 else at

    def held(self, text: str) -> int:
        return len(text)  # nothing before the list is content

    def parse_calls(self, region: str, finished: bool) -> list[PartialCall]:
        return json_calls(region, 1, ",", finished)  # after the list's "["
