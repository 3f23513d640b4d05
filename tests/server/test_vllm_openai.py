"""vLLM's OpenAI-server tests (tests/entrypoints/openai in vllm-project/vllm) that needed work
here, rewritten against the default model on the one shared server (conftest.py's `served`,
SmolLM2-135M-Instruct, prompt_tokens_details on). Each test names the vLLM test it follows;
docs/vllm_openai_tests.md lists them all."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
from helpers.server import running_server
from prometheus_client.parser import text_string_to_metric_families

from tinypaged.entrypoints.openai.api_server import build_app

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="none", max_retries=0)


def ids_of(entries) -> list[int]:
    """The ids behind `return_tokens_as_token_ids` strings ("token_id:123")."""
    assert all(e.startswith("token_id:") for e in entries), entries
    return [int(e.removeprefix("token_id:")) for e in entries]


def post(served, path: str, body: dict) -> httpx.Response:
    return httpx.post(served[1] + path, json={"model": MODEL, **body}, timeout=60)


# ------------------------------------------------- completion/test_completion.py (usage, logprobs)


def test_single_completion_usage_and_cached_tokens(served, client):
    """test_single_completion with --enable-prompt-tokens-details; prefix caching stays on
    here, so a repeated prompt reports its cached blocks as usage.prompt_tokens_details."""
    engine = served[0]
    prompt = "Hello, my name is"
    c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    n_prompt = len(engine.tokenizer.encode(prompt))
    assert c.choices[0].finish_reason == "length" and len(c.choices) == 1
    u = c.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (n_prompt, 5, n_prompt + 5)
    assert isinstance(u.prompt_tokens_details.cached_tokens, int)
    long_ids = engine.tokenizer.encode("one two three four five six seven eight " * 5)[:40]
    cached = []
    for _ in range(2):
        c = client.completions.create(model=MODEL, prompt=long_ids, max_tokens=1)
        cached.append(c.usage.prompt_tokens_details.cached_tokens)
    assert cached[1] > 0 and cached[1] % 16 == 0 and cached[1] < 40, cached  # whole blocks
    assert c.choices[0].prompt_logprobs is None  # not asked for


def test_completion_logprobs_counts(client):
    """test_no_logprobs, test_zero_logprobs, test_some_logprobs, test_too_many_completion_
    logprobs: top_logprobs has k (or k + 1 with the sampled token) entries; over 20 is a 400,
    streamed or not, and the server answers afterwards."""
    ask = dict(model=MODEL, prompt=[0, 0, 0, 0, 0], max_tokens=5, temperature=0.0)
    assert client.completions.create(**ask, logprobs=None).choices[0].logprobs is None
    zero = client.completions.create(**ask, logprobs=0).choices[0].logprobs
    assert zero.token_logprobs is not None and len(zero.top_logprobs[0]) == 1
    some = client.completions.create(**ask, logprobs=5).choices[0].logprobs
    assert all(5 <= len(t) <= 6 for t in some.top_logprobs)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(**ask, logprobs=21)
    with pytest.raises(openai.BadRequestError):
        list(client.completions.create(**ask, logprobs=30, stream=True))
    assert client.completions.create(**ask).choices[0].text is not None


@pytest.mark.parametrize("prompt_logprobs", [-1, 0, 1, None])
def test_prompt_logprobs_completion(served, client, prompt_logprobs):
    """test_prompt_logprobs_completion: per choice, one entry per prompt token (the first
    null), each holding the prompt token itself and at most `prompt_logprobs` others."""
    prompts = ["A robot may not injure another robot", "My name is"]
    extra = {} if prompt_logprobs is None else {"prompt_logprobs": prompt_logprobs}
    if prompt_logprobs is not None and prompt_logprobs < 0:
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt=prompts, max_tokens=2,
                                      extra_body=extra)
        return
    c = client.completions.create(model=MODEL, prompt=prompts, max_tokens=2, extra_body=extra)
    for choice, prompt in zip(c.choices, prompts):
        if prompt_logprobs is None:
            assert choice.prompt_logprobs is None
            continue
        ids = served[0].tokenizer.encode(prompt)
        entries = choice.prompt_logprobs
        assert len(entries) == len(ids) and entries[0] is None
        for tid, entry in zip(ids[1:], entries[1:]):
            assert str(tid) in entry and len(entry) <= prompt_logprobs + 1
            assert all(v["logprob"] <= 0 and isinstance(v["decoded_token"], str)
                       for v in entry.values())
            # vLLM's Logprob.rank: the top-k rank 1..k; the prompt token ranks past k exactly
            # when it is not among them
            others = sorted(v["rank"] for t, v in entry.items() if t != str(tid))
            own = entry[str(tid)]["rank"]
            if len(entry) == prompt_logprobs:  # the prompt token is one of the top k
                assert sorted(others + [own]) == list(range(1, prompt_logprobs + 1))
            else:
                assert others == list(range(1, prompt_logprobs + 1)) and own > prompt_logprobs


def test_prompt_logprobs_chat(served):
    """chat test_prompt_logprobs_chat / test_more_than_one_prompt_logprobs_chat: the body's
    top-level prompt_logprobs covers the templated prompt; -1 is a 400; with stream a 400."""
    r = post(served, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2,
                                              "prompt_logprobs": 1, "logprobs": True,
                                              "top_logprobs": 1})
    body = r.json()
    ids = served[0].tokenizer.apply_chat_template(CHAT)
    assert r.status_code == 200 and len(body["prompt_logprobs"]) == len(ids)
    assert body["prompt_logprobs"][0] is None
    assert all(str(t) in e for t, e in zip(ids[1:], body["prompt_logprobs"][1:]))
    plain = post(served, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}).json()
    assert plain["prompt_logprobs"] is None  # there, null, as vLLM's
    for extra in ({"prompt_logprobs": -1}, {"prompt_logprobs": 1, "stream": True}):
        r = post(served, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, **extra})
        assert r.status_code == 400 and "prompt_logprobs" in r.text, r.text


# ------------------------------------------ test_return_tokens_as_ids.py, test_logprob_token_ids


def test_return_tokens_as_token_ids(served, client):
    """test_completion_return_tokens_as_token_ids_completion / _chat (the request field): every
    logprob token is "token_id:<id>", and those ids decode to the text (the echoed prompt
    included), however its characters split into tokens."""
    tok = served[0].tokenizer
    prompt = "Say 'Hello, world! 🎉'"
    c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                  echo=True, logprobs=1,
                                  extra_body={"return_tokens_as_token_ids": True})
    ids = ids_of(c.choices[0].logprobs.tokens)
    assert tok.decode(ids) == c.choices[0].text and c.choices[0].text.startswith(prompt)
    # vLLM's order: each top_logprobs dict starts with the token itself (prompt ones too)
    assert [next(iter(t)) for t in c.choices[0].logprobs.top_logprobs[1:]] == \
        c.choices[0].logprobs.tokens[1:]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                          "content": prompt}], max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=2,
                                          extra_body={"return_tokens_as_token_ids": True})
    content = chat.choices[0].logprobs.content
    assert tok.decode(ids_of([e.token for e in content])) == chat.choices[0].message.content
    assert all(ids_of([t.token for t in e.top_logprobs]) for e in content)


def test_return_tokens_as_token_ids_server_flag(served):
    """The same test's server-flag half (`--return-tokens-as-token-ids`): a second app on the
    already loaded engine (no model load) answers every request with token_id strings."""
    engine = served[0]
    with running_server(build_app(engine, return_tokens_as_token_ids=True)) as url:
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Emojis: 🐱🐶🎉"}],
            "max_tokens": 6, "temperature": 0, "logprobs": True})
    body = r.json()["choices"][0]
    ids = ids_of([e["token"] for e in body["logprobs"]["content"]])
    assert engine.tokenizer.decode(ids, skip_special_tokens=True) == body["message"]["content"]


def test_logprob_token_ids(served, client):
    """test_logprob_token_ids_returns_requested_ids and ..._default_behavior_unchanged: the
    asked ids' logprobs stand in for the top ones (the sampled token keeps a slot), with the
    same values the natural top-k gives them; the default path is unchanged."""
    ask = dict(model=MODEL, messages=CHAT, max_tokens=1, temperature=0, logprobs=True)
    natural = client.chat.completions.create(**ask, top_logprobs=5, extra_body={
        "return_tokens_as_token_ids": True}).choices[0].logprobs.content[0]
    assert len(natural.top_logprobs) == 5 and all(e.logprob <= 0 for e in natural.top_logprobs)
    want = {i: e.logprob for i, e in zip(ids_of([e.token for e in natural.top_logprobs]),
                                         natural.top_logprobs)}
    # the 3rd..5th most likely plus two far-off ids, none of them the sampled token
    asked = list(want)[2:] + [100, 5000]
    got = client.chat.completions.create(**ask, top_logprobs=len(asked), extra_body={
        "logprob_token_ids": asked, "return_tokens_as_token_ids": True,
    }).choices[0].logprobs.content[0]
    returned = dict(zip(ids_of([e.token for e in got.top_logprobs]),
                        [e.logprob for e in got.top_logprobs]))
    assert len(set(returned) & set(asked)) >= len(asked) - 1, (asked, returned)
    for i, lp in returned.items():
        assert math.isfinite(lp) and lp <= 0
        if i in want:
            assert lp == pytest.approx(want[i], abs=1e-4)
    comp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=1, logprobs=1,
                                     extra_body={"logprob_token_ids": [100, 5000],
                                                 "return_tokens_as_token_ids": True})
    assert {100, 5000} <= set(ids_of(list(comp.choices[0].logprobs.top_logprobs[0])))


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_logprob_token_ids_validation(served, path):
    """test_logprob_token_ids_validation: an empty list, no logprobs, a non-list and an id
    outside the vocabulary are each a 400 naming the field."""
    base = {"messages": CHAT} if "chat" in path else {"prompt": "hi"}
    on = {"logprobs": True} if "chat" in path else {"logprobs": 1}
    vocab = served[0].tokenizer.vocab_size
    for extra, words in (
        ({**on, "logprob_token_ids": []}, "must not be an empty list"),
        ({"logprob_token_ids": [100]}, "when using `logprob_token_ids`"),
        ({**on, "logprob_token_ids": 123}, "logprob_token_ids"),
        ({**on, "logprob_token_ids": "123"}, "logprob_token_ids"),
        ({**on, "logprob_token_ids": [vocab + 5]}, "logprob_token_ids"),
    ):
        r = post(served, path, {**base, "max_tokens": 1, **extra})
        assert r.status_code == 400 and words in r.json()["error"]["message"], (extra, r.text)


# -------------------------------------------------- allowed_token_ids, bad_words (vLLM's fields)


def test_allowed_token_ids_and_bad_words(served, client):
    """vLLM's allowed_token_ids (every generated token is one of them) and bad_words (the
    word's tokens, with and without a leading space, are never generated)."""
    tok = served[0].tokenizer
    allowed = tok.encode(" yes") + tok.encode(" no")
    c = client.completions.create(model=MODEL, prompt="Is the sky blue?", max_tokens=6,
                                  temperature=1.0, seed=3, extra_body={
                                      "allowed_token_ids": allowed, "return_token_ids": True})
    assert c.choices[0].token_ids and set(c.choices[0].token_ids) <= set(allowed)
    ask = dict(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    plain = client.completions.create(**ask).choices[0].text
    word = next(w for w in plain.split() if w.isalpha())
    banned = client.completions.create(**ask, extra_body={"bad_words": [word]}).choices[0].text
    assert word in plain and word not in banned.split(), (plain, banned)


# ----------------------------------------------------- instrumentator/test_metrics.py counts


def test_metrics_counts(served, client):
    """test_metrics_counts: over N sequential requests of P prompt tokens and M new tokens,
    iteration_tokens_total grows by N * (P + M) over N * M steps (vLLM counts each step with
    output: its new tokens plus the whole prompt of a request getting its first token), and
    the per-request counters as vLLM's."""
    engine, url = served
    prompt_ids = engine.tokenizer.encode("Hello my name is Robert and I love magic")
    n, m = 3, 4

    def scrape() -> dict[str, float]:
        text = httpx.get(url + "/metrics").text
        return {s.name: s.value for f in text_string_to_metric_families(text)
                for s in f.samples if s.labels.get("model_name") == MODEL
                and "finished_reason" not in s.labels and "le" not in s.labels}

    before = scrape()
    for _ in range(n):
        client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=m,
                                  extra_body={"ignore_eos": True})
    after = scrape()
    grew = {k: after[k] - before.get(k, 0) for k in after}
    p = len(prompt_ids)
    assert grew["tinypaged:iteration_tokens_total_sum"] == n * (p + m)
    assert grew["tinypaged:iteration_tokens_total_count"] == n * m
    assert grew["tinypaged:prompt_tokens_total"] == n * p
    assert grew["tinypaged:generation_tokens_total"] == n * m
    assert grew["tinypaged:request_prompt_tokens_sum"] == n * p
    assert grew["tinypaged:inter_token_latency_seconds_count"] == n * (m - 1)
    assert grew["tinypaged:time_to_first_token_seconds_count"] == n


# ------------------------------------------------ test_completion_streaming, stream options


def test_completion_streaming_and_stream_options(client):
    """test_completion_streaming and test_completion_stream_options: the stream's text equals
    the plain answer, one finish_reason; usage only in the last chunk (include_usage) or in
    every chunk (continuous_usage_stats)."""
    ask = dict(model=MODEL, prompt="What is an LLM?", max_tokens=5, temperature=0.0,
               extra_body={"ignore_eos": True})
    single = client.completions.create(**ask).choices[0].text
    chunks = list(client.completions.create(**ask, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == single
    assert [c.choices[0].finish_reason for c in chunks].count("length") == 1
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)
    chunks = list(client.completions.create(**ask, stream=True,
                                            stream_options={"include_usage": True}))
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    u = chunks[-1].usage
    assert u.completion_tokens == 5 and u.total_tokens == u.prompt_tokens + 5
    chunks = list(client.completions.create(**ask, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None and c.usage.total_tokens ==
               c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(**ask, stream=False, stream_options={"include_usage": True})
    for options in ({"include_usage": None}, {"continuous_usage_stats": None},
                    {"continuous_usage_stats": True}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(**ask, stream=False, stream_options=options)


def test_batch_and_echo_logprob_completions(served, client):
    """test_batch_completions (beam search aside) and test_echo_logprob_completion: a list of
    equal prompts gives equal answers, streamed or not; with echo the logprob lists start with
    the prompt's tokens (the first without logprobs) and hold max(k, 1)..k + 1 alternatives."""
    tok = served[0].tokenizer
    for prompts in (["Hello, my name is"] * 2, [[0, 0, 0, 0, 0]] * 2):
        batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5,
                                          temperature=0.0)
        assert len(batch.choices) == 2 and batch.choices[0].text == batch.choices[1].text
        texts = ["", ""]
        for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=5,
                                               temperature=0.0, stream=True):
            assert len(chunk.choices) == 1
            texts[chunk.choices[0].index] += chunk.choices[0].text
        assert texts == [batch.choices[0].text] * 2
    for k in (1, 0):
        for prompt in ("Hello, my name is", [0, 0, 0, 0, 0]):
            c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                          temperature=0.0, echo=True, logprobs=k,
                                          extra_body={"ignore_eos": True})
            text = tok.decode(prompt) if isinstance(prompt, list) else prompt
            lp = c.choices[0].logprobs
            n_prompt = len(prompt) if isinstance(prompt, list) else len(tok.encode(prompt))
            assert c.choices[0].text.startswith(text)
            assert len(lp.tokens) == len(lp.text_offset) == n_prompt + 5
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            assert all(max(k, 1) <= len(t) <= k + 1 for t in lp.top_logprobs[1:])


# ----------------------------------------------------------- chat_completion/test_chat.py

SESSION = [{"role": "system", "content": "you are a helpful assistant"},
           {"role": "user", "content": "what is 1+1?"}]


def test_chat_logprobs_counts(client):
    """test_no_logprobs_chat, test_zero_logprobs_chat, test_some_logprobs_chat,
    test_too_many_chat_logprobs."""
    ask = dict(model=MODEL, messages=SESSION, max_completion_tokens=5, temperature=0.0)
    assert client.chat.completions.create(**ask, logprobs=False).choices[0].logprobs is None
    zero = client.chat.completions.create(**ask, logprobs=True, top_logprobs=0)
    assert zero.choices[0].logprobs.content and \
        len(zero.choices[0].logprobs.content[0].top_logprobs) == 0
    some = client.chat.completions.create(**ask, logprobs=True, top_logprobs=5)
    assert all(len(e.top_logprobs) == 5 for e in some.choices[0].logprobs.content)
    with pytest.raises(openai.BadRequestError):
        list(client.chat.completions.create(**ask, logprobs=True, top_logprobs=21,
                                            stream=True))
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**ask, logprobs=True, top_logprobs=30)
    assert client.chat.completions.create(**ask).choices[0].message.content is not None


def test_more_than_one_prompt_logprobs_chat(client):
    """test_prompt_logprobs_chat (1, 0, -1, None) and test_more_than_one_prompt_logprobs_chat:
    each entry holds k alternatives, plus the prompt token when it is not among them."""
    msgs = [{"role": "user", "content": "Who won the world series in 2020?"},
            {"role": "assistant", "content": "The Los Angeles Dodgers."},
            {"role": "user", "content": "Where was it played?"}]
    ask = dict(model=MODEL, messages=msgs, max_completion_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**ask, extra_body={"prompt_logprobs": -1})
    assert client.chat.completions.create(**ask).prompt_logprobs is None
    got = {k: client.chat.completions.create(**ask, extra_body={"prompt_logprobs": k})
           .prompt_logprobs for k in (0, 1, 2)}
    for k, entries in got.items():
        assert entries[0] is None and all(k <= len(e) <= k + 1 for e in entries[1:])
    for e0, e1, e2 in zip(got[0][1:], got[1][1:], got[2][1:]):
        assert set(e0) <= set(e1) <= set(e2) and len(e0) == 1
        for tid, v in e1.items():
            assert v["logprob"] == pytest.approx(e2[tid]["logprob"], abs=1e-4)


def test_chat_streaming_and_stream_options(client):
    """test_single_chat_session, test_chat_streaming and test_chat_completion_stream_options:
    usage adds up, the stream's text equals the plain answer with one finish_reason, usage
    grows chunk by chunk with continuous_usage_stats, stream_options without stream is a
    400."""
    ask = dict(model=MODEL, messages=SESSION, max_completion_tokens=10, temperature=0.0)
    plain = client.chat.completions.create(**ask)
    u = plain.usage
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    chunks = list(client.chat.completions.create(**ask, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        plain.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert reasons == [plain.choices[0].finish_reason]
    last = 0
    for c in client.chat.completions.create(**ask, stream=True, extra_body={"min_tokens": 10},
                                            stream_options={"include_usage": True,
                                                            "continuous_usage_stats": True}):
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
        assert last == 0 or c.usage.completion_tokens > last or (
            not c.choices and c.usage.completion_tokens == last)
        last = c.usage.completion_tokens
    assert last == 10
    for options in ({"include_usage": None}, {"include_usage": True}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(**ask, stream_options=options)
