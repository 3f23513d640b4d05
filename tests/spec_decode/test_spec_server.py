"""`serve --speculative-config` end to end: the server over AsyncLLM with n-gram speculation,
async scheduling forced (so verifications overlap, as served on a GPU), a tiny random llama
with the default model's tokenizer. Concurrent completions, streamed and not, equal the greedy
output without speculation; /metrics carries the spec-decode counters; every block is free."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from helpers.server import build_tiny_model, metric, running_server, sse_events

from tinypaged import LLM, AsyncLLM, SamplingParams
from tinypaged.entrypoints.openai.api_server import build_app

ENGINE_ARGS = {"max_model_len": 256, "num_kv_blocks": 200, "max_num_seqs": 8, "dtype": "float32"}
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}
# repetitive prompts, so that prompt lookup finds drafts
PROMPTS = [f"one two three four {i} one two three four {i} one two" for i in range(6)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def test_served_ngram_outputs_equal_no_speculation(model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].text for o in
            LLM(str(model_dir), **ENGINE_ARGS).generate(PROMPTS, params, use_tqdm=False)]
    engine = AsyncLLM(str(model_dir), speculative_config=SPEC, async_scheduling=True,
                      **ENGINE_ARGS)

    async def one(client: httpx.AsyncClient, i: int) -> str:
        body = {"prompt": PROMPTS[i], "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                "stream": i % 2 == 1}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        if not body["stream"]:
            return r.json()["choices"][0]["text"]
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        return "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])

    async def run_all(url: str) -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(*(one(client, i) for i in range(len(PROMPTS))))

    try:
        with running_server(build_app(engine, served_model_name="tiny")) as url:
            got = asyncio.run(run_all(url))
            text = httpx.get(url + "/metrics").text
        assert got == want
        drafts = metric(text, "tinypaged:spec_decode_num_drafts_total", model_name="tiny")
        accepted = metric(text, "tinypaged:spec_decode_num_accepted_tokens_total",
                          model_name="tiny")
        assert drafts > 0 and accepted > 0
        core = engine.core_client.engine  # the Engine, in this process
        assert core.spec.overlap and core.spec.num_overlapped > 0
        stats = core.get_stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
    finally:
        asyncio.run(engine.shutdown())
