"""An AWQ checkpoint written by `tinypaged quantize` runs through every front door: LLM (greedy
tokens = transformers on the dequantized weights), the `tinypaged generate` command and the
OpenAI server."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from helpers.models import check_llm_greedy, generate_cli
from helpers.quantize import quantized_pair
from helpers.server import running_server

from tinypaged import LLM, AsyncLLM, SamplingParams
from tinypaged.entrypoints.openai.api_server import build_app

ENGINE = dict(num_kv_blocks=64, block_size=16, max_model_len=128)


@pytest.fixture(scope="module")
def awq_dir(tmp_path_factory):
    return quantized_pair("llama", tmp_path_factory.mktemp("awq-engine"))


def test_llm_generates_the_dequantized_models_tokens(awq_dir):
    out_dir, hf_model = awq_dir
    llm = LLM(str(out_dir), **ENGINE)
    prompts = [[5, 17, 99, 3, 250, 42, 7], list(range(11, 40))]
    check_llm_greedy(llm, hf_model, prompts)


def test_cli_and_server_serve_the_checkpoint(awq_dir):
    out_dir, _ = awq_dir
    params = SamplingParams(temperature=0.0, max_tokens=5)  # what the command line asks for
    expected = LLM(str(out_dir), **ENGINE).generate("Hello there", params, use_tqdm=False)
    text = expected[0].outputs[0].text

    cli = generate_cli(out_dir, "Hello there", "--quantization", "awq")
    assert cli.rstrip("\n") == text.rstrip("\n")

    engine = AsyncLLM(str(out_dir), **ENGINE)
    try:
        with running_server(build_app(engine, served_model_name="awq")) as url:
            r = httpx.post(url + "/v1/completions", timeout=60, json={
                "model": "awq", "prompt": "Hello there", "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == text
    finally:
        asyncio.run(engine.shutdown())
