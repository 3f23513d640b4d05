"""GLM-4.5 / 4.6 / 4.7 tool calls: a name, then key/value tags (vLLM's `glm45` / `glm47`).

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

Values are raw text. A value becomes a JSON number, boolean, object... only when the tool's
JSON schema does not declare that parameter a string and the text parses as JSON; otherwise it
stays a string. The arguments JSON is built one complete key/value pair at a time, so a stream
sends `{"city": "Paris"` as soon as that pair has closed and `}` when the call does.
"""

from __future__ import annotations

import json
import re

from tinypaged.entrypoints.openai.parsers.tool_calls import PartialCall, ToolParser, held_prefix

START, END = "<tool_call>", "</tool_call>"
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


class Glm45ToolParser(ToolParser):
    start = START

    def _is_string(self, function: str, key: str) -> bool:
        for tool in self.tools:
            fn = tool.get("function", {})
            if fn.get("name") == function:
                prop = (fn.get("parameters") or {}).get("properties", {}).get(key, {})
                return prop.get("type") == "string"
        return False

    def _value(self, function: str, key: str, text: str):
        if self._is_string(function, key):
            return text
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text

    def parse_calls(self, region: str, finished: bool) -> list[PartialCall]:
        calls = []
        for block in region.split(START)[1:]:
            done = END in block or finished
            body = block.split(END, 1)[0]
            head, tag, _ = body.partition("<arg_key>")
            if not (tag or "\n" in head.lstrip() or done):
                calls.append(PartialCall(None, "", False))
                break
            name = head.strip().split("\n", 1)[0].strip()
            if not name:
                break
            pairs = [
                f"{json.dumps(k.strip(), ensure_ascii=False)}: "
                f"{json.dumps(self._value(name, k.strip(), v), ensure_ascii=False)}"
                for k, v in _PAIR.findall(body[: len(body) - held_prefix(body, END)])
            ]
            arguments = "{" + ", ".join(pairs) + ("}" if done else "")
            calls.append(PartialCall(name, arguments, done))
            if not done:
                break
        return calls
