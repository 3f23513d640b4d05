"""The server end to end on the real engine (a tiny random llama with the default model's
tokenizer and chat template), through the official `openai` client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from helpers.server import build_tiny_model, metric, running_server, sse_events

from tinypaged import LLM, AsyncLLM, SamplingParams
from tinypaged.entrypoints.openai.api_server import build_app

ENGINE_ARGS = {"max_model_len": 256, "num_kv_blocks": 400, "max_num_seqs": 64, "dtype": "float32"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = AsyncLLM(str(model_dir), **ENGINE_ARGS)
    yield engine
    asyncio.run(engine.shutdown())


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), **ENGINE_ARGS)


@pytest.fixture(scope="module")
def url(engine):
    with running_server(build_app(engine, served_model_name="tiny")) as url:
        yield url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def greedy_text(llm: LLM, prompt, max_tokens: int, chat: bool = False) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    if chat:
        return llm.chat(prompt, params, use_tqdm=False)[0].outputs[0].text
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text


def test_models_list(client, engine):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].max_model_len == 256


def test_greedy_completion_matches_llm(client, llm):
    prompt = "The quick brown fox"
    want = greedy_text(llm, prompt, 12)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == want
    assert r.usage.prompt_tokens == len(llm.tokenizer.encode(prompt))
    stream = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == want


def test_greedy_chat_matches_llm(client, llm):
    msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi there"}]
    want = greedy_text(llm, msgs, 10, chat=True)
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(llm.tokenizer.apply_chat_template(msgs))
    stream = client.chat.completions.create(
        model="tiny",
        messages=msgs,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.model_dump() == r.usage.model_dump()


def test_n2_and_seed_reproducible(client):
    def sample(seed: int):
        r = client.completions.create(
            model="tiny",
            prompt="Once upon a time",
            n=2,
            max_tokens=8,
            temperature=1.0,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        assert [c.index for c in r.choices] == [0, 1]
        assert r.usage.completion_tokens == 16
        return [c.text for c in r.choices]

    first = sample(7)
    assert sample(7) == first
    assert first[0] != first[1]  # the two samples draw differently
    assert sample(8) != first


def test_stop_string(client, llm):
    full = greedy_text(llm, "Stop test prompt", 12)
    stop = full[4:7]
    assert stop, full
    r = client.completions.create(
        model="tiny", prompt="Stop test prompt", max_tokens=12, temperature=0, stop=[stop]
    )
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_logprobs_both_formats(client):
    r = client.completions.create(
        model="tiny", prompt="Logprobs", max_tokens=5, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    for tok_lp, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert tok_lp <= 0 and 3 <= len(top) <= 4
        assert tok_lp == pytest.approx(max(top.values()))  # greedy took the best token
    c = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_context_limits_are_400(url, llm):
    long_ids = [100] * 256
    r = httpx.post(url + "/v1/completions", json={"prompt": long_ids, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(url + "/v1/completions", json={"prompt": [100] * 200, "max_tokens": 100})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(url + "/v1/completions", json={"prompt": [10**6], "max_tokens": 1})
    assert r.status_code == 400 and "out of range" in r.json()["error"]["message"]


def test_tokenize_matches_tokenizer(url, llm):
    r = httpx.post(url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert r["tokens"] == llm.tokenizer.encode("Hello world") and r["count"] == len(r["tokens"])
    back = httpx.post(url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": "Hello world"}


def test_64_concurrent_streams_with_disconnects(engine, llm):
    """48 streams run to the end, 16 hang up after their first token: every survivor completes,
    the metrics add up, and the KV cache is all free afterwards."""
    app = build_app(engine, served_model_name="tiny")  # fresh metrics registry
    prompts = [f"Request number {i} says" + " hello" * (i % 7) for i in range(64)]
    quitters = set(range(0, 64, 4))
    max_tokens = 12  # quitters ask for 200, so they cannot be done before they hang up

    async def one(client: httpx.AsyncClient, i: int):
        body = {
            "prompt": prompts[i],
            "max_tokens": 200 if i in quitters else max_tokens,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            raw = ""
            async for chunk in r.aiter_text():
                raw += chunk
                if i in quitters and '"text"' in raw:
                    return None  # leaving the block closes the connection mid-stream
        return sse_events(raw)

    async def run_all(url: str):
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    with running_server(app) as url:
        results = asyncio.run(run_all(url))
        deadline = time.monotonic() + 10
        while engine.get_stats()["num_free_blocks"] != engine.get_stats()["num_total_blocks"]:
            assert time.monotonic() < deadline, engine.get_stats()
            time.sleep(0.02)
        text = httpx.get(url + "/metrics").text

    survivors = [r for i, r in enumerate(results) if i not in quitters]
    for events in survivors:
        assert events[-1] == "[DONE]"
        assert events[-2]["usage"]["completion_tokens"] == max_tokens
        assert [e["choices"][0]["finish_reason"] for e in events[:-2]][-1] == "length"
    stats = engine.get_stats()
    assert stats["num_running"] == stats["num_waiting"] == 0

    name = {"model_name": "tiny"}
    prompt_tokens = sum(len(llm.tokenizer.encode(p)) for p in prompts)
    assert metric(text, "tinypaged:prompt_tokens_total", **name) == prompt_tokens
    # On a fast machine a quitter's 200 tokens can all be out before its hang-up reaches the
    # server: it then ends "length" like the others. Either way every request is counted once.
    finished = metric(text, "tinypaged:request_success_total", finished_reason="length")
    aborted = metric(text, "tinypaged:request_success_total", finished_reason="abort")
    assert finished + aborted == 64 and finished >= 48
    generated = metric(text, "tinypaged:generation_tokens_total", **name)
    assert 48 * max_tokens + 16 <= generated <= 48 * max_tokens + 16 * 200
    assert metric(text, "tinypaged:time_to_first_token_seconds_count", **name) == 64
    assert metric(text, "tinypaged:inter_token_latency_seconds_count", **name) == generated - 64
    assert metric(text, "tinypaged:e2e_request_latency_seconds_count", **name) == finished
    assert metric(text, "tinypaged:num_requests_running", **name) == 0
    assert metric(text, "tinypaged:kv_cache_usage_perc", **name) == 0
    assert json.dumps(results[1][0])  # a survivor's chunks are plain JSON objects
    # vLLM's per-request histograms count the finished requests; the phase times add up.
    for hist in ("prompt_tokens", "generation_tokens", "max_num_generation_tokens", "params_n",
                 "params_max_tokens", "queue_time_seconds", "prefill_time_seconds",
                 "decode_time_seconds", "inference_time_seconds"):
        assert metric(text, f"tinypaged:request_{hist}_count", **name) == finished, hist
    inference = metric(text, "tinypaged:request_inference_time_seconds_sum", **name)
    parts = sum(metric(text, f"tinypaged:request_{p}_time_seconds_sum", **name)
                for p in ("prefill", "decode"))
    assert inference == pytest.approx(parts, rel=1e-6)
    assert metric(text, "tinypaged:request_params_n_sum", **name) == finished
    assert metric(text, "tinypaged:prefix_cache_queries_total", **name) == prompt_tokens
    hits = metric(text, "tinypaged:prefix_cache_hits_total", **name)
    assert 0 <= hits < prompt_tokens
    # Engine-wide since start (this engine served other tests too): every prompt token not
    # cached and every generated token but each sample's last went through a step.
    computed = metric(text, "tinypaged:iteration_tokens_total_sum", **name)
    assert computed >= prompt_tokens - hits + generated - 64
    steps = metric(text, "tinypaged:iteration_tokens_total_count", **name)
    assert metric(text, "tinypaged:iteration_tokens_total_bucket", le="+Inf", **name) == steps
    # the counter is the scheduler's own count of preempted sequences (engine-wide)
    preempted = engine.get_stats()["iteration_stats"].num_preemptions
    assert metric(text, "tinypaged:num_preemptions_total", **name) == preempted
    assert metric(text, "tinypaged:cache_config_info", block_size="16", **name) == 1


# ------------------------------------------------------------------ tools and template switches

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
PARSED = {"name": "get_weather", "arguments": {"city": "Paris"}}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
]


def chat_offline(llm: LLM, messages: list[dict], **kw) -> tuple[int, str]:
    """(prompt tokens, greedy text) of LLM.chat: the offline form of the same request."""
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False, **kw)
    return len(out[0].prompt_token_ids), out[0].outputs[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_tool_conversation_replays(client, llm, stream):
    """A replayed tool conversation renders (tools too, though ChatML ignores them) and
    generates what LLM.chat generates; tool_choice 'none' needs no tool parser."""
    # The template's messages: tool-call arguments as objects, a null content as "".
    template_history = [
        HISTORY[0],
        {"role": "assistant", "content": "", "tool_calls": [{**CALL, "function": PARSED}]},
        HISTORY[2],
    ]
    prompt_tokens, text = chat_offline(llm, template_history, tools=[WEATHER])
    r = client.chat.completions.create(
        model="tiny", messages=HISTORY, tools=[WEATHER], tool_choice="none", max_tokens=8,
        temperature=0,
        stream=stream, stream_options={"include_usage": True} if stream else None,
    )
    if stream:
        chunks = list(r)
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
    else:
        content, usage = r.choices[0].message.content, r.usage
        assert r.choices[0].message.tool_calls is None  # tool_choice "none": not parsed
    assert usage.prompt_tokens == prompt_tokens
    assert (content or "") == text


def test_template_switches_match_llm_chat(client, llm):
    """add_generation_prompt, continue_final_message and echo, as vLLM defines them."""
    msgs = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi, I am"}]
    prompt_tokens, text = chat_offline(
        llm, msgs, add_generation_prompt=False, continue_final_message=True
    )
    r = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=8, temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True, "echo": True},
    )
    assert r.usage.prompt_tokens == prompt_tokens
    assert r.choices[0].message.content == "Hi, I am" + text
    stream = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=8, temperature=0, stream=True,
        extra_body={"add_generation_prompt": False, "continue_final_message": True, "echo": True},
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == "Hi, I am" + text


def test_cached_prompt_tokens_and_tokenize_options(engine, model_dir):
    from tinypaged.tokenizer.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    app = build_app(engine, served_model_name="tiny", enable_prompt_tokens_details=True)
    with running_server(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        prompt = "the quick brown fox jumps over the lazy dog " * 6  # > 3 KV blocks
        n = len(tok.encode(prompt))
        first = client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
        again = client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        # The prefix cache serves whole blocks of 16, and always recomputes the last token.
        assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16

        r = httpx.post(url + "/tokenize", json={"prompt": "The quick brown fox",
                                                "return_token_strs": True}).json()
        assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
        assert "Ġbrown" in r["token_strs"]  # the tokenizer's own tokens, not decoded text
        msgs = [{"role": "user", "content": "Hi"}]
        for gen in (True, False):
            r = httpx.post(url + "/tokenize", json={"messages": msgs,
                                                    "add_generation_prompt": gen}).json()
            assert r["tokens"] == tok.apply_chat_template(msgs, add_generation_prompt=gen)
        r = httpx.post(url + "/tokenize", json={"messages": msgs, "tools": [WEATHER]}).json()
        assert r["tokens"] == tok.apply_chat_template(msgs, tools=[WEATHER])


def test_echo_with_logprobs_and_prompt_logprobs(client, llm):
    prompt = "The quick brown fox"
    ids = llm.tokenizer.encode(prompt)
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=1, prompt_logprobs=1)
    want = llm.generate(prompt, params, use_tqdm=False)[0]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0,
                                  echo=True, logprobs=1)
    choice = r.choices[0]
    assert choice.text == prompt + want.outputs[0].text
    lp = choice.logprobs
    assert lp.tokens[: len(ids)] == [llm.tokenizer.decode([t], False) for t in ids]
    assert lp.token_logprobs[0] is None
    wanted = [e[t] for e, t in zip(want.prompt_logprobs[1:], ids[1:])]
    wanted += [e[t] for e, t in zip(want.outputs[0].logprobs, want.outputs[0].token_ids)]
    assert lp.token_logprobs[1:] == pytest.approx(wanted, abs=1e-4)
    assert lp.text_offset[len(ids)] == len(prompt)  # the generated text starts after the echo
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=1,
                                  extra_body={"prompt_logprobs": 0})
    body = r.choices[0].model_extra["prompt_logprobs"]
    assert body[0] is None and len(body) == len(ids)
    assert [float(e[str(t)]["logprob"]) for e, t in zip(body[1:], ids[1:])] == pytest.approx(
        [e[t] for e, t in zip(want.prompt_logprobs[1:], ids[1:])], abs=1e-4
    )
