"""Anthropic's Messages API (/v1/messages) through the official `anthropic` client.

The engine is `ScriptedEngine` (helpers/server.py): it answers with the reply a Qwen-family model
would write (thinking, tool calls in hermes' format), a few characters per step, and keeps the
prompt it got, so each test checks both directions of the translation: what the chat template
rendered from Anthropic's blocks, and the blocks, stop reasons, usage and stream events read
back. test_server_smollm2.py runs the same client against the real default model.
"""

from __future__ import annotations

import json

import anthropic
import pytest
from helpers.server import WEATHER_FUNCTION, post, qwen_scripted_server

WEATHER = {"name": WEATHER_FUNCTION["name"], "description": WEATHER_FUNCTION["description"],
           "input_schema": WEATHER_FUNCTION["parameters"]}
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
THOUGHT_CALL = (
    "<think>I should look it up.</think>\n\nLet me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
ANSWER = "It is 22 C and sunny in Paris."


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    with qwen_scripted_server(tmp_path_factory.mktemp("qwen"), api_key="sk-test") as api:
        api.client = anthropic.Anthropic(base_url=api.url, api_key="sk-test", max_retries=0)
        yield api


def ask(api, stream: bool, **kw):
    """One Messages request; the final message (a stream is accumulated by the SDK), and the
    stream's event types."""
    kw = {"model": "scripted", "max_tokens": 100, **kw}
    if not stream:
        return api.client.messages.create(**kw), None
    with api.client.messages.stream(**kw) as s:
        types = [e.type for e in s]
        return s.get_final_message(), types


@pytest.mark.parametrize("stream", [False, True])
def test_tool_round_trip_with_thinking(api, stream):
    api.engine.replies = [THOUGHT_CALL, ANSWER]
    msg, types = ask(api, stream, system="Be brief.", messages=[QUESTION], tools=[WEATHER])
    prompt = api.engine.prompts[-1]
    assert prompt.startswith("<|im_start|>system\nBe brief.") and "Current weather" in prompt
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"]
    assert msg.content[0].thinking == "I should look it up."
    assert msg.content[1].text == "\n\nLet me look.\n"
    call = msg.content[2]
    assert (call.name, call.input) == ("get_weather", {"city": "Paris"})
    assert msg.stop_reason == "tool_use" and msg.role == "assistant"
    assert msg.usage.input_tokens == len(api.tok.encode(prompt, add_special_tokens=False))
    assert msg.usage.output_tokens == len(THOUGHT_CALL)  # the scripted engine: a token a char
    if stream:
        assert types[:1] == ["message_start"] and types[-1] == "message_stop"
        assert types.count("content_block_start") == 3 == types.count("content_block_stop")

    # The client runs the tool and sends the conversation back, thinking block included.
    history = [
        QUESTION,
        {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": "22 C, sunny"},
            {"type": "text", "text": "Thanks!"}]},
    ]
    msg, _ = ask(api, stream, messages=history, tools=[WEATHER])
    prompt = api.engine.prompts[-1]
    assert "<tool_response>\n22 C, sunny\n</tool_response>" in prompt
    assert prompt.count("Paris") == 2 and "Thanks!" in prompt  # replayed call + question
    assert [(b.type, b.text) for b in msg.content] == [("text", ANSWER)]
    assert (msg.stop_reason, msg.stop_sequence) == ("end_turn", None)


def test_stream_event_sequence(api):
    api.engine.replies = ["<think>Hm.</think>Hi!"]
    r = post(api.url, "/v1/messages", {"model": "scripted", "max_tokens": 50, "stream": True,
                                       "messages": [QUESTION]},
             headers={"x-api-key": "sk-test"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    blocks = [b.split("\n") for b in r.text.strip().split("\n\n")]
    events = [b[0].removeprefix("event: ") for b in blocks]
    runs = [e for i, e in enumerate(events) if i == 0 or e != events[i - 1]]  # deltas: one run
    assert runs == ["message_start", "ping",
                    "content_block_start", "content_block_delta", "content_block_stop",
                    "content_block_start", "content_block_delta", "content_block_stop",
                    "message_delta", "message_stop"]
    datas = [json.loads(b[1].removeprefix("data: ")) for b in blocks]
    assert all(d["type"] == e for d, e in zip(datas, events))
    deltas = [d["delta"] for d in datas if d["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "Hm."
    assert "".join(d.get("text", "") for d in deltas) == "Hi!"
    assert datas[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert datas[-2]["usage"]["output_tokens"] == len("<think>Hm.</think>Hi!")


def test_forced_tool_and_sampling_fields(api):
    api.engine.replies = ['{"city": "Paris"}']
    msg, _ = ask(api, False, messages=[QUESTION], tools=[WEATHER], stop_sequences=["END"],
                 extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 7},
                 tool_choice={"type": "tool", "name": "get_weather"})
    params = api.engine.params[-1]
    assert (params.temperature, params.top_p, params.top_k, params.stop) == (0.5, 0.9, 7, ["END"])
    assert params.structured_outputs is not None and params.max_tokens == 100
    assert [(b.type, b.input) for b in msg.content] == [("tool_use", {"city": "Paris"})]
    assert msg.stop_reason == "tool_use"


def test_thinking_switch_and_count_tokens(api):
    api.engine.replies = ["Hello!"]
    ask(api, False, messages=[QUESTION], thinking={"type": "disabled"})
    assert api.engine.prompts[-1].endswith("<think>\n\n</think>\n\n")  # the template read it
    count = api.client.messages.count_tokens(model="scripted", system="Be brief.",
                                             messages=[QUESTION], tools=[WEATHER])
    rendered = api.tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, QUESTION],
        tools=[{"type": "function", "function": {
            "name": WEATHER["name"], "description": WEATHER["description"],
            "parameters": WEATHER["input_schema"]}}])
    assert count.input_tokens == len(rendered)


def test_errors_in_anthropics_shape(api):
    c = api.client
    r = post(api.url, "/v1/messages", {"model": "scripted", "messages": [QUESTION]},
             headers={"x-api-key": "sk-test"})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    image = {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}
    with pytest.raises(anthropic.BadRequestError, match="image"):
        c.messages.create(model="scripted", max_tokens=5,
                          messages=[{"role": "user", "content": [image]}])
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="nope", max_tokens=5, messages=[QUESTION])
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError, match="nope"):
        c.messages.create(model="scripted", max_tokens=5, messages=[QUESTION], tools=[WEATHER],
                          tool_choice={"type": "tool", "name": "nope"})
    wrong = anthropic.Anthropic(base_url=api.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model="scripted", max_tokens=5, messages=[QUESTION])
    assert e.value.body["error"]["type"] == "authentication_error"
