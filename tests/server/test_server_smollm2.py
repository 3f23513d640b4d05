"""Checks on the real default model (SmolLM2-135M-Instruct), served once: greedy text streamed
through the official `openai` client equals what the engine gives directly, for completions and
chat; `tinypaged bench serve` measures the server. Then Anthropic Messages and OpenAI Responses
through the official `anthropic` and `openai` clients on the same server: a plain chat
(streaming and not) gives the engine's own greedy text for the same chat prompt, and a tool
round trip runs with the tool forced (a 135M model does not pick tools by itself); and
/invocations answers as the endpoints do."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import openai
import pytest

from tinypaged import AsyncLLM, SamplingParams
from tinypaged.entrypoints.cli import main


async def direct(engine: AsyncLLM, prompt, n: int) -> str:
    params = SamplingParams(temperature=0, max_tokens=n)
    async for out in engine.generate(prompt, params, f"direct-{id(prompt)}"):
        text = out.outputs[0].text
    return text


def test_smollm2_through_the_openai_client(served):
    engine, url = served
    prompt, n = "The capital of France is", 12
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want_text = asyncio.run(direct(engine, prompt, n))
    chat_ids = engine.tokenizer.apply_chat_template(messages)
    want_chat = asyncio.run(direct(engine, {"prompt_token_ids": chat_ids}, n))
    assert want_text.strip()
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=n, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == want_text
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=n, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want_chat


def test_bench_serve_measures_the_server(served, tmp_path, capsys):
    _, url = served
    port = url.rsplit(":", 1)[1]
    # a vllm bench serve command line, unchanged
    main(["bench", "serve", "--backend", "vllm", "--dataset-name", "random", "--port", port,
          "--num-prompts", "4", "--request-rate", "20",
          "--random-input-len", "16", "--random-output-len", "6", "--ignore-eos",
          "--max-concurrency", "2", "--save-result", "--result-dir", str(tmp_path),
          "--result-filename", "r.json"])
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == 4 and result["output_lens"] == [6] * 4
    assert result["input_lens"] == [16] * 4 and result["model_id"] == "SmolLM2-135M-Instruct"
    assert 0 < result["median_ttft_ms"] < result["median_e2el_ms"]
    assert len(result["itls"][0]) >= 1 and result["max_concurrency"] == 2
    printed = capsys.readouterr().out
    for line in ("TTFT (ms)", "TPOT (ms)", "ITL (ms)", "request throughput (req/s)"):
        assert line in printed, printed


# ---------------------------------------------- Anthropic Messages, OpenAI Responses, /invocations

QUESTION = "What is the capital of France?"
N = 10
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}},
                  "required": ["city"]}


def greedy(engine: AsyncLLM, messages: list[dict], n: int) -> tuple[str, str, int]:
    """The engine's own greedy answer to `messages` (the chat template's prompt)."""
    async def run():
        ids = engine.tokenizer.apply_chat_template(messages)
        params = SamplingParams(temperature=0, max_tokens=n)
        async for out in engine.generate({"prompt_token_ids": ids}, params, f"g-{id(ids)}"):
            c = out.outputs[0]
        return c.text, c.finish_reason, len(c.token_ids)

    return asyncio.run(run())


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_plain_chat(served, stream):
    engine, url = served
    want, finish, n_tokens = greedy(engine, [{"role": "user", "content": QUESTION}], N)
    assert len(want.split()) >= 2
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    kw = dict(model="SmolLM2-135M-Instruct", max_tokens=N, extra_body={"temperature": 0},
              messages=[{"role": "user", "content": QUESTION}])
    if stream:
        with client.messages.stream(**kw) as s:
            text = "".join(s.text_stream)
            msg = s.get_final_message()
        assert text == want
    else:
        msg = client.messages.create(**kw)
    assert [(b.type, b.text) for b in msg.content] == [("text", want)]
    stop_reason = {"length": "max_tokens", "stop": "end_turn"}[finish]
    assert (msg.stop_reason, msg.usage.output_tokens) == (stop_reason, n_tokens)
    if stream:
        return
    word = want.split()[1]  # a stop sequence the answer reaches
    msg = client.messages.create(**{**kw, "stop_sequences": [word]})
    assert msg.content[0].text == want[: want.index(word)]
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", word)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_plain_chat(served, stream):
    engine, url = served
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": QUESTION}]
    want, finish, n_tokens = greedy(engine, messages, N)
    status = {"length": "response.incomplete", "stop": "response.completed"}[finish]
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    kw = dict(model="SmolLM2-135M-Instruct", instructions="Answer briefly.", input=QUESTION,
              max_output_tokens=N, temperature=0)
    if stream:
        events = list(client.responses.create(stream=True, **kw))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == want and events[-1].type == status
        r = events[-1].response
    else:
        r = client.responses.create(**kw)
    assert r.output_text == want
    assert r.status == status.removeprefix("response.")
    if finish == "length":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == n_tokens


def test_anthropic_forced_tool_round_trip(served):
    _, url = served
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    tool = {"name": "get_weather", "description": "Weather in a city",
            "input_schema": WEATHER_SCHEMA}
    question = {"role": "user", "content": "What is the weather in Paris?"}
    msg = client.messages.create(model="SmolLM2-135M-Instruct", max_tokens=40,
                                 messages=[question], tools=[tool],
                                 tool_choice={"type": "tool", "name": "get_weather"})
    (call,) = msg.content
    assert call.type == "tool_use" and call.name == "get_weather"
    assert isinstance(call.input["city"], str) and msg.stop_reason == "tool_use"
    history = [question, {"role": "assistant", "content": [call.model_dump()]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": "22 C, sunny"}]}]
    with client.messages.stream(model="SmolLM2-135M-Instruct", max_tokens=8, messages=history,
                                tools=[tool], tool_choice={"type": "none"}) as s:
        msg = s.get_final_message()
    assert msg.content and msg.content[0].type == "text" and msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens")


def test_responses_forced_tool_round_trip(served):
    _, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    tool = {"type": "function", "name": "get_weather", "description": "Weather in a city",
            "parameters": WEATHER_SCHEMA}
    question = {"role": "user", "content": "What is the weather in Paris?"}
    events = list(client.responses.create(
        model="SmolLM2-135M-Instruct", input=[question], tools=[tool], max_output_tokens=40,
        tool_choice={"type": "function", "name": "get_weather"}, stream=True))
    (call,) = events[-1].response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert isinstance(json.loads(call.arguments)["city"], str)
    items = [question, call.model_dump(),
             {"type": "function_call_output", "call_id": call.call_id, "output": "22 C"}]
    r = client.responses.create(model="SmolLM2-135M-Instruct", input=items, tools=[tool],
                                tool_choice="none", max_output_tokens=8)
    assert [o.type for o in r.output] == ["message"] and r.output_text


def test_invocations_answers_as_chat_and_completions(served):
    """vLLM's test_invocations: /invocations answers a chat body exactly as
    /v1/chat/completions (the SDK's full model, null fields included) and a prompt body as
    /v1/completions."""
    _, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    chat = {"model": "SmolLM2-135M-Instruct", "max_completion_tokens": 5, "temperature": 0.0,
            "logprobs": False, "messages": [{"role": "system", "content": "be helpful"},
                                            {"role": "user", "content": "what is 1+1?"}]}
    want = client.chat.completions.create(**chat).model_dump()
    got = httpx.post(url + "/invocations", json=chat, timeout=60).json()
    same_shape(want, got)
    prompt = {"model": "SmolLM2-135M-Instruct", "prompt": "1+1=", "max_tokens": 5,
              "temperature": 0.0}
    want = client.completions.create(**prompt).model_dump()
    got = httpx.post(url + "/invocations", json=prompt, timeout=60).json()
    same_shape(want, got)


def same_shape(want: dict, got: dict) -> None:
    """`got` (raw JSON) has every key of the SDK's model `want` but the fields newer SDKs
    declare that vLLM does not send either (e.g. `metadata`), which are then null; the choices
    are equal, null fields included."""
    assert set(got) <= set(want) and all(want[k] is None for k in set(want) - set(got))
    assert want["choices"] == got["choices"]
