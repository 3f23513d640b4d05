"""Tool-call and reasoning parsers on text: the whole-output answer, and the same answer
rebuilt from a stream cut at every possible place (one character at a time and in odd-sized
pieces), which is where partial tags and half-written JSON live."""

from __future__ import annotations

import json

import pytest

from tinypaged.entrypoints.openai.chat_output import ChatOutput
from tinypaged.entrypoints.openai.parsers import REASONING_PARSERS, TOOL_PARSERS
from tinypaged.entrypoints.openai.parsers.forced import (
    NamedToolParser,
    RequiredToolParser,
    tool_choice_schema,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}

HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"days": 2, "tags": ["a}", {"b": "</tool_call"}]}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
LLAMA3 = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
    '{"name": "get_time", "parameters": {}}'
)
GLM45 = (
    "Sure.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>123</arg_value>\n"
    "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"
    "<tool_call>get_time\n</tool_call>"
)

CASES = [
    # parser, text, content, [(name, arguments)]
    ("hermes", HERMES, "Let me check.\n", [
        ("get_weather", {"city": "Paris", "days": 2, "tags": ["a}", {"b": "</tool_call"}]}),
        ("get_time", {}),
    ]),
    ("llama3_json", LLAMA3, None, [("get_weather", {"city": "Paris", "days": 2}),
                                   ("get_time", {})]),
    ("llama3_json", ' {"name": "f", "arguments": {"x": [1, 2]}}', None, [("f", {"x": [1, 2]})]),
    # "123" stays a string: the schema says city is one; days is not, so it becomes a number.
    ("glm45", GLM45, "Sure.", [("get_weather", {"city": "123", "days": 2}), ("get_time", {})]),
    ("glm47", "<tool_call>get_time</tool_call>", None, [("get_time", {})]),
    # Text that only looks like a call start stays content.
    ("hermes", "I use <tool_ and {json} freely.", "I use <tool_ and {json} freely.", []),
    ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("llama3_json", "The answer is {x}.", "The answer is {x}.", []),
]


def stream(output: ChatOutput, text: str, step: int) -> tuple[str, str, dict[int, dict]]:
    """Feed `text` in pieces of `step` characters; (reasoning, content, calls) as a client
    rebuilds them from the deltas, checking OpenAI's delta shape on the way."""
    reasoning, content, calls = "", "", {}
    cuts = list(range(step, len(text), step)) + [len(text)]
    for end in cuts:
        delta = output.delta(text[:end], finished=end == len(text))
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "")
        for tc in delta.get("tool_calls", []):
            if tc["index"] not in calls:  # the first piece of a call carries id, type, name
                assert tc["index"] == len(calls) and tc["type"] == "function", tc
                assert tc["id"].startswith("call_") and tc["function"]["name"], tc
                calls[tc["index"]] = {"name": tc["function"]["name"], "arguments": ""}
            else:
                assert set(tc) == {"index", "function"} and "name" not in tc["function"], tc
            calls[tc["index"]]["arguments"] += tc["function"].get("arguments", "")
    return reasoning, content, calls


@pytest.mark.parametrize("name,text,content,want", CASES)
def test_tool_parser_whole_and_streamed(name, text, content, want):
    parser = TOOL_PARSERS[name]([WEATHER])
    got_content, calls = parser.extract_tool_calls(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == want
    whole = [c.arguments for c in calls]
    for step in (1, 2, 7):
        output = ChatOutput(TOOL_PARSERS[name]([WEATHER]))
        _, streamed_content, streamed = stream(output, text, step)
        assert streamed_content == (content or "")
        assert [(c["name"], c["arguments"]) for c in streamed.values()] == list(
            zip([n for n, _ in want], whole)
        )


def test_arguments_stream_in_pieces():
    """Arguments go out as they are written, not in one piece when the call closes."""
    output = ChatOutput(TOOL_PARSERS["hermes"]())
    pieces = []
    for end in range(1, len(HERMES) + 1):
        for tc in output.delta(HERMES[:end], end == len(HERMES)).get("tool_calls", []):
            pieces.append(tc["function"].get("arguments", ""))
    assert len([p for p in pieces if p]) > 10


def test_forced_tool_choice_parsers_and_schemas():
    required = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", ' \
        '"parameters": {}}]'
    content, calls = RequiredToolParser().extract_tool_calls(required)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})
    ]
    _, _, streamed = stream(ChatOutput(RequiredToolParser()), required, 3)
    assert [c["arguments"] for c in streamed.values()] == [c.arguments for c in calls]
    _, calls = NamedToolParser("get_weather").extract_tool_calls(' {"city": "Rome"}')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Rome"})]

    named = {"type": "function", "function": {"name": "get_weather"}}
    assert tool_choice_schema([WEATHER], named) == WEATHER["function"]["parameters"]
    schema = tool_choice_schema([WEATHER], "required")
    assert schema["type"] == "array" and schema["minItems"] == 1
    one = schema["items"]["anyOf"][0]
    assert one["properties"]["name"]["enum"] == ["get_weather"]
    assert one["properties"]["parameters"] == WEATHER["function"]["parameters"]


REASONING = [
    # parser, text, reasoning, content
    ("qwen3", "<think>Greeting.</think>Hello!", "Greeting.", "Hello!"),
    ("qwen3", "\n<think>\nA</think>\n\nB", "\nA", "\n\nB"),
    ("qwen3", "Hello, no thinking.", None, "Hello, no thinking."),
    ("glm45", "<think>x < y</think>So y.", "x < y", "So y."),
    ("deepseek_r1", "Thinking in the prompt's tag.</think>Done.", "Thinking in the prompt's tag.",
     "Done."),
    ("deepseek_r1", "<think>Both tags.</think>Done.", "Both tags.", "Done."),
    ("deepseek_r1", "Still thinking when cut off", "Still thinking when cut off", None),
]


@pytest.mark.parametrize("name,text,reasoning,content", REASONING)
def test_reasoning_parser_whole_and_streamed(name, text, reasoning, content):
    assert REASONING_PARSERS[name]().extract_reasoning(text) == (reasoning, content)
    for step in (1, 3):
        got = stream(ChatOutput(None, REASONING_PARSERS[name]()), text, step)
        assert got[:2] == (reasoning or "", content or "")


def test_reasoning_then_tool_calls():
    """Thinking first, then a tool call in the content: both parsers on one output."""
    text = "<think>Need the weather.</think>" + HERMES
    output = ChatOutput(TOOL_PARSERS["hermes"](), REASONING_PARSERS["qwen3"]())
    message = output.message(text)
    assert message["reasoning_content"] == "Need the weather."
    assert message["content"] == "Let me check.\n"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
    assert output.finish_reason("stop") == "tool_calls"
    reasoning, content, calls = stream(
        ChatOutput(TOOL_PARSERS["hermes"](), REASONING_PARSERS["qwen3"]()), text, 4
    )
    assert (reasoning, content) == ("Need the weather.", "Let me check.\n")
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_time"]


def test_parallel_tool_calls_false_keeps_the_first_call():
    from tinypaged.entrypoints.openai.chat_output import output_for
    from tinypaged.entrypoints.openai.chat_protocol import parse_chat_options

    body = {"tools": [WEATHER], "parallel_tool_calls": False}
    output = output_for(parse_chat_options(body), TOOL_PARSERS["hermes"], None)
    assert [c["function"]["name"] for c in output.message(HERMES)["tool_calls"]] == [
        "get_weather"
    ]
    _, _, calls = stream(output_for(parse_chat_options(body), TOOL_PARSERS["hermes"], None),
                         HERMES, 5)
    assert [c["name"] for c in calls.values()] == ["get_weather"]
