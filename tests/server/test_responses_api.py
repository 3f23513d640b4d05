"""OpenAI's Responses API (/v1/responses, stateless) through the official `openai` client.

As in test_anthropic_messages.py the engine is `ScriptedEngine`, answering as a Qwen-family
model would (thinking, hermes tool calls), so each test checks what the chat template rendered
from the input items and the output items, events and usage read back.
test_server_smollm2.py runs the same client against the real default model.
"""

from __future__ import annotations

import json

import openai
import pytest
from helpers.server import WEATHER_FUNCTION, qwen_scripted_server

WEATHER = {"type": "function", **WEATHER_FUNCTION}
QUESTION = "What is the weather in Paris?"
THOUGHT_CALL = (
    "<think>I should look it up.</think>\n\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
ANSWER = "It is 22 C and sunny in Paris."


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    with qwen_scripted_server(tmp_path_factory.mktemp("qwen")) as api:
        api.client = openai.OpenAI(base_url=api.url + "/v1", api_key="none", max_retries=0)
        yield api


def ask(api, stream: bool, **kw):
    """One Responses request: the final response object and (streaming) the event types."""
    kw = {"model": "scripted", **kw}
    if not stream:
        return api.client.responses.create(**kw), None
    events = list(api.client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events[-1].response, [e.type for e in events]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_round_trip_with_reasoning(api, stream):
    api.engine.replies = [THOUGHT_CALL, ANSWER]
    r, types = ask(api, stream, instructions="Be brief.", input=QUESTION, tools=[WEATHER])
    prompt = api.engine.prompts[-1]
    assert prompt.startswith("<|im_start|>system\nBe brief.") and "Current weather" in prompt
    assert [item.type for item in r.output] == ["reasoning", "function_call"]
    assert r.output[0].content[0].text == "I should look it up."
    call = r.output[1]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert r.status == "completed" and r.output_text == ""
    n_prompt = len(api.tok.encode(prompt, add_special_tokens=False))
    assert (r.usage.input_tokens, r.usage.output_tokens) == (n_prompt, len(THOUGHT_CALL))
    assert r.usage.total_tokens == n_prompt + len(THOUGHT_CALL)
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    if stream:
        assert types[:3] == ["response.created", "response.in_progress",
                             "response.output_item.added"]
        assert "response.reasoning_text.delta" in types
        assert "response.function_call_arguments.delta" in types
        assert types[-3:] == ["response.function_call_arguments.done",
                              "response.output_item.done", "response.completed"]

    # The client runs the tool and sends the items back with the result: no stored state.
    items = [{"role": "user", "content": QUESTION}, *[o.model_dump() for o in r.output],
             {"type": "function_call_output", "call_id": call.call_id, "output": "22 C, sunny"}]
    r, types = ask(api, stream, input=items, tools=[WEATHER])
    prompt = api.engine.prompts[-1]
    assert "<tool_response>\n22 C, sunny\n</tool_response>" in prompt
    assert prompt.count("Paris") == 2  # the question and the replayed call's arguments
    assert [o.type for o in r.output] == ["message"] and r.output_text == ANSWER
    if stream:
        assert types[2:5] == ["response.output_item.added", "response.content_part.added",
                              "response.output_text.delta"]
        assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                              "response.output_item.done", "response.completed"]


def test_structured_output_and_sampling_fields(api):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    api.engine.replies = ['{"city": "Paris"}']
    r, _ = ask(api, False, input=[{"role": "developer", "content": "JSON only."},
                                  {"role": "user", "content": [
                                      {"type": "input_text", "text": QUESTION}]}],
               text={"format": {"type": "json_schema", "name": "city", "schema": schema}},
               max_output_tokens=40, temperature=0.5, top_p=0.9)
    params = api.engine.params[-1]
    assert params.structured_outputs.json == schema
    assert (params.max_tokens, params.temperature, params.top_p) == (40, 0.5, 0.9)
    assert api.engine.prompts[-1].startswith("<|im_start|>system\nJSON only.")
    assert json.loads(r.output_text) == {"city": "Paris"}
    assert r.text.format.type == "json_schema" and r.store is False


def test_stateless_and_unsupported_fields_are_400s(api):
    c = api.client
    for kw, param, word in [
        ({"previous_response_id": "resp_123"}, "previous_response_id", "stateless"),
        ({"store": True}, "store", "stateless"),
        ({"background": True}, "background", "stateless"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]", "function"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(model="scripted", input=QUESTION, **kw)
        assert e.value.body["param"] == param and word in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="scripted", input=[{"type": "item_reference", "id": "x"}])
    assert "stateless" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="scripted", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "http://x/y.png"}]}])
    assert e.value.body["param"] == "input[0].content[0]"
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="nope", input=QUESTION)
