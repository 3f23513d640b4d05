"""The one server on the real default model (SmolLM2-135M-Instruct) that every test file here
which needs it shares (`served`), started once for this directory: test_server_smollm2.py and
test_vllm_openai.py. It reports prompt_tokens_details as `vllm serve
--enable-prompt-tokens-details` does."""

from __future__ import annotations

import asyncio

import pytest
from helpers.server import running_server

from tinypaged import AsyncLLM
from tinypaged.entrypoints.openai.api_server import build_app


@pytest.fixture(scope="package")
def served():
    engine = AsyncLLM(num_kv_blocks=16, max_model_len=256)
    try:
        with running_server(build_app(engine, enable_prompt_tokens_details=True)) as url:
            yield engine, url
    finally:
        asyncio.run(engine.shutdown())
