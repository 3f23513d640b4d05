"""Checks on the real default model (SmolLM2-135M-Instruct), served once: greedy text streamed
through the official `openai` client equals what the engine gives directly, for completions and
chat; `tinypaged bench serve` measures the server."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from helpers.server import running_server

from tinypaged import AsyncLLM, SamplingParams
from tinypaged.entrypoints.cli import main
from tinypaged.entrypoints.openai.api_server import build_app


async def direct(engine: AsyncLLM, prompt, n: int) -> str:
    params = SamplingParams(temperature=0, max_tokens=n)
    async for out in engine.generate(prompt, params, f"direct-{id(prompt)}"):
        text = out.outputs[0].text
    return text


@pytest.fixture(scope="module")
def served():
    engine = AsyncLLM(num_kv_blocks=16, max_model_len=256)
    try:
        with running_server(build_app(engine)) as url:
            yield engine, url
    finally:
        asyncio.run(engine.shutdown())


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
