"""Structured output and the logits fields through the server: request parsing (every field,
every error as a 400 naming the field), then the openai client against a real engine on a tiny
random Llama with SmolLM2's vocabulary, where only the grammar can make the output valid."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest
from helpers.models import single_thread  # noqa: F401
from helpers.server import assert_error, post, running_server
from helpers.structured import SCHEMA, save_tiny_with_smollm2_vocab

from tinypaged import AsyncLLM
from tinypaged.entrypoints.openai.errors import APIError
from tinypaged.entrypoints.openai.protocol import parse_chat_request, parse_completion_request

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def structured(body: dict, chat: bool = True):
    req = (parse_chat_request if chat else parse_completion_request)(
        {**(CHAT if chat else {"prompt": "x"}), **body}
    )
    return req.sampling.get("structured_outputs"), req


@pytest.mark.parametrize("chat", [True, False])
def test_parse_structured_fields(chat):
    assert structured({"response_format": {"type": "text"}}, chat)[0] is None
    assert structured({"response_format": {"type": "json_object"}}, chat)[0].json_object
    so, req = structured({"response_format": {"type": "json_schema", "json_schema": {
        "name": "pet", "strict": True, "schema": SCHEMA}}}, chat)
    assert so.json == SCHEMA and req.body_fields["structured_outputs"] == "response_format"
    assert structured({"guided_json": json.dumps(SCHEMA)}, chat)[0].json == SCHEMA
    assert structured({"guided_regex": "[a-z]+"}, chat)[0].regex == "[a-z]+"
    assert structured({"guided_choice": ["a", "b"]}, chat)[0].choice == ["a", "b"]
    assert structured({"guided_grammar": 'root ::= "x"'}, chat)[0].grammar == 'root ::= "x"'
    so, _ = structured({"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}})
    assert so.regex == "a+" and so.disable_any_whitespace
    _, req = structured({"logit_bias": {"42": 250, "7": -3}, "allowed_token_ids": [1, 2],
                         "bad_words": ["x"]}, chat)
    assert req.sampling["logit_bias"] == {42: 250, 7: -3}  # SamplingParams clamps to 100
    assert req.sampling["allowed_token_ids"] == [1, 2] and req.sampling["bad_words"] == ["x"]


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": "json"}, "response_format", "'type'"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "'xml'"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}}},
     "response_format.json_schema.schema", "JSON schema"),
    ({"guided_json": "{oops"}, "guided_json", "not valid JSON"),
    ({"guided_choice": "a"}, "guided_choice", "list of strings"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
     "one structured-output field"),
    ({"structured_outputs": {"regex": "a", "color": 1}}, "structured_outputs", "takes the keys"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"5": "high"}}, "logit_bias", "token ids"),
    ({"allowed_token_ids": "1,2"}, "allowed_token_ids", "list of token ids"),
    ({"bad_words": [1]}, "bad_words", "list of strings"),
])
def test_parse_errors_name_the_field(body, param, words):
    with pytest.raises(APIError) as info:
        parse_chat_request({**CHAT, **body})
    assert info.value.status == 400 and info.value.param == param
    assert words in info.value.message


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_smol_vocab_server")
    save_tiny_with_smollm2_vocab(path)
    from tinypaged.entrypoints.openai.api_server import build_app

    engine = AsyncLLM(str(path), num_kv_blocks=64, block_size=8)
    try:
        with running_server(build_app(engine)) as url:
            yield url
    finally:
        asyncio.run(engine.shutdown())


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)


def model(client) -> str:
    return client.models.list().data[0].id


@pytest.mark.parametrize("stream", [False, True])
def test_chat_json_schema_through_the_openai_client(client, stream):
    # A random model fills free whitespace forever: JSON without it (response_format keeps
    # vLLM's flexible whitespace; sampling/test_structured_smollm2.py runs it on a real model).
    so = {"json": SCHEMA, "disable_any_whitespace": True}
    kw = dict(model=model(client), messages=CHAT["messages"], max_tokens=120, temperature=0,
              extra_body={"structured_outputs": so})
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        choice = client.chat.completions.create(**kw).choices[0]
        text, reason = choice.message.content, choice.finish_reason
    jsonschema.validate(json.loads(text), SCHEMA)
    assert reason == "stop"


def test_completions_guided_fields_and_logit_bias(client):
    m = model(client)
    r = client.completions.create(model=m, prompt="colour:", max_tokens=10, temperature=0.9,
                                  seed=3, n=3, extra_body={"guided_choice": ["red", "green"]})
    assert all(c.text in ("red", "green") and c.finish_reason == "stop" for c in r.choices)
    r = client.completions.create(model=m, prompt="code:", max_tokens=10, temperature=0,
                                  extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{3}"})
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", r.choices[0].text)
    ids = {"ignore_eos": True, "return_token_ids": True}
    biased = client.completions.create(model=m, prompt="x", max_tokens=4, temperature=0,
                                       logit_bias={"777": 100}, extra_body=ids)
    allowed = client.completions.create(model=m, prompt="x", max_tokens=4, temperature=0,
                                        extra_body={"allowed_token_ids": [777], **ids})
    # both force token 777 at every step
    assert biased.choices[0].model_extra["token_ids"] == [777] * 4
    assert allowed.choices[0].model_extra["token_ids"] == [777] * 4
    assert biased.choices[0].text == allowed.choices[0].text


def test_engine_side_errors_name_the_field(server):
    r = post(server, "/v1/chat/completions", {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objectx"}}}})
    assert_error(r, 400, "response_format", "objectx")
    r = post(server, "/v1/completions", {"prompt": "a", "guided_regex": "a(b"})
    assert_error(r, 400, "guided_regex", "regex")
    r = post(server, "/v1/completions", {"prompt": "a", "allowed_token_ids": [10**6]})
    assert_error(r, 400, "allowed_token_ids", "outside the vocabulary")
