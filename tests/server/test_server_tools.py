"""Tool calling and reasoning through the server with the official `openai` client.

The round trip an agent makes (tools -> tool call -> tool result -> answer), for three model
families' chat templates (helpers/chat_templates.py) and tool-call formats, streaming and not.
A random tiny model does not decide to call a tool, so here the engine is `ScriptedEngine`, a
test double that answers with the reply a model of that family would write, a few characters
per step; the tokenizer and its chat template are real, and the test reads the prompt the
engine got, so it checks what the template rendered (the tools, the replayed call, the tool
result). test_server_e2e.py replays a tool conversation on the real engine.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import openai
import pytest
from helpers.chat_templates import GLM45, LLAMA3, QWEN
from helpers.server import (
    WEATHER_FUNCTION,
    ScriptedEngine,  # noqa: F401
    assert_error,
    post,
    running_server,
)
from helpers.tokenizer import train_bpe

from tinypaged.entrypoints.openai.api_server import build_app
from tinypaged.tokenizer.tokenizer import load_tokenizer

WEATHER = {"type": "function", "function": WEATHER_FUNCTION}
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
ANSWER = "It is 22 C and sunny in Paris."

FAMILIES = {
    # name: (chat template, --tool-call-parser, the model's tool-call reply)
    "qwen": (
        QWEN,
        "hermes",
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>",
    ),
    "llama3": (
        LLAMA3,
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    ),
    "glm45": (
        GLM45,
        "glm45",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "</tool_call>",
    ),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    template, parser, reply = FAMILIES[request.param]
    tok = load_tokenizer(train_bpe(tmp_path_factory.mktemp(request.param), chat_template=template))
    engine = ScriptedEngine(tok)
    app = build_app(engine, tool_call_parser=parser, enable_auto_tool_choice=True)
    with running_server(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        yield SimpleNamespace(name=request.param, engine=engine, client=client, url=url,
                              reply=reply)


def ask(f, messages, stream: bool, **kw):
    """One chat request; returns (content, tool_calls as dicts, finish_reason, extra fields)."""
    r = f.client.chat.completions.create(
        model="scripted", messages=messages, stream=stream, **kw
    )
    if not stream:
        m = r.choices[0].message
        calls = [c.model_dump() for c in m.tool_calls or []]
        return m.content, calls, r.choices[0].finish_reason, m.model_extra
    content, calls, finish, extra = "", {}, None, {}
    for chunk in r:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        delta = choice.delta
        content += delta.content or ""
        for key, value in (delta.model_extra or {}).items():
            extra[key] = extra.get(key, "") + (value or "")
        for tc in delta.tool_calls or []:
            if tc.index not in calls:
                calls[tc.index] = {"id": tc.id, "type": tc.type,
                                   "function": {"name": tc.function.name, "arguments": ""}}
            else:
                assert tc.id is None and tc.function.name is None
            calls[tc.index]["function"]["arguments"] += tc.function.arguments or ""
    return content or None, list(calls.values()), finish, extra


@pytest.mark.parametrize("stream", [False, True])
def test_tool_round_trip(family, stream):
    f = family
    f.engine.replies = [f.reply, ANSWER]
    content, calls, finish, _ = ask(f, [QUESTION], stream, tools=[WEATHER])
    prompt = f.engine.prompts[-1]
    assert "get_weather" in prompt and "Current weather in a city" in prompt  # tools rendered
    assert f.engine.params[-1].skip_special_tokens is False  # tags that are special tokens stay
    assert finish == "tool_calls"
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert content == ("Let me look.\n" if f.name == "qwen" else None)

    # The agent runs the tool and sends the whole conversation back.
    history = [
        QUESTION,
        {"role": "assistant", "content": content, "tool_calls": calls},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "22 C, sunny"},
    ]
    content, calls, finish, _ = ask(f, history, stream, tools=[WEATHER])
    prompt = f.engine.prompts[-1]
    assert "22 C, sunny" in prompt  # the tool result
    assert prompt.count("Paris") == 2  # the question and the replayed call's arguments
    assert (content, calls, finish) == (ANSWER, [], "stop")


def test_tool_choice_none_reads_no_calls(family):
    f = family
    f.engine.replies = [f.reply]
    content, calls, finish, _ = ask(f, [QUESTION], False, tools=[WEATHER], tool_choice="none")
    assert (content, calls, finish) == (f.reply, [], "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_split_and_thinking_switch(tmp_path, stream):
    tok = load_tokenizer(train_bpe(tmp_path, chat_template=QWEN))
    engine = ScriptedEngine(tok)
    engine.replies = ["<think>The user greets me.</think>\n\nHello!", "Hello!"]
    app = build_app(engine, reasoning_parser="qwen3")
    with running_server(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        f = SimpleNamespace(client=client)
        content, calls, _, extra = ask(f, [QUESTION], stream)
        assert (content, extra["reasoning_content"]) == ("\n\nHello!", "The user greets me.")
        assert "<think>" not in engine.prompts[-1]
        off = {"chat_template_kwargs": {"enable_thinking": False}}
        content, calls, _, extra = ask(f, [QUESTION], stream, extra_body=off)
        assert content == "Hello!" and not extra.get("reasoning_content")
        assert engine.prompts[-1].endswith("<think>\n\n</think>\n\n")  # the template read it


def test_tool_errors(family):
    url = family.url
    msgs = [QUESTION]
    body = {"messages": msgs, "tool_choice": "auto"}
    assert_error(post(url, "/v1/chat/completions", body), 400, "tool_choice", "`tools`")
    body = {"messages": msgs, "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "nope"}}}
    assert_error(post(url, "/v1/chat/completions", body), 400, "tool_choice", "'nope'")
    body = {"messages": msgs, "tools": [{"type": "retrieval"}]}
    assert_error(post(url, "/v1/chat/completions", body), 400, "tools[0]", "function")
    body = {"messages": msgs, "tools": [{"type": "function", "function": {}}]}
    assert_error(post(url, "/v1/chat/completions", body), 400, "tools[0].function.name")
    bad_call = {"role": "assistant", "content": None,
                "tool_calls": [{"id": "x", "type": "function",
                                "function": {"name": "f", "arguments": "{oops"}}]}
    body = {"messages": [QUESTION, bad_call]}
    assert_error(post(url, "/v1/chat/completions", body), 400,
                 "messages[1].tool_calls[0].function.arguments", "JSON")
    body = {"messages": msgs, "continue_final_message": True}
    assert_error(post(url, "/v1/chat/completions", body), 400, "continue_final_message", "both")


def test_auto_tool_choice_needs_the_flags(tmp_path):
    tok = load_tokenizer(train_bpe(tmp_path, chat_template=QWEN))
    with running_server(build_app(ScriptedEngine(tok))) as url:
        r = post(url, "/v1/chat/completions", {"messages": [QUESTION], "tools": [WEATHER]})
        assert_error(r, 400, "tool_choice", "--enable-auto-tool-choice", "--tool-call-parser")


FORCED = [
    ("required", '[{"name": "get_weather", "parameters": {"city": "Paris"}}]', "tool_calls"),
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Paris"}', "stop"),
]


@pytest.mark.parametrize("choice,reply,finish", FORCED)
def test_forced_tool_choice(family, choice, reply, finish):
    """"required" and a named function constrain the output to the tool_choice schema through
    structured output, and read it as JSON whatever the model's own format."""
    from tinypaged.entrypoints.openai.parsers.forced import tool_choice_schema

    family.engine.replies = [reply, reply]
    for stream in (False, True):
        content, calls, got_finish, _ = ask(family, [QUESTION], stream, tools=[WEATHER],
                                            tool_choice=choice)
        assert family.engine.params[-1].structured_outputs.json == tool_choice_schema(
            [WEATHER], choice
        )
        assert (content, got_finish) == (None, finish)
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
            == [("get_weather", {"city": "Paris"})]
