"""One check on the real default model (SmolLM2-135M-Instruct): greedy text streamed through the
official `openai` client equals what the engine gives directly, for completions and chat."""

from __future__ import annotations

import asyncio

import openai
from test_server_helpers import running_server

from tinypaged import AsyncLLM, SamplingParams
from tinypaged.server import build_app


async def direct(engine: AsyncLLM, prompt, n: int) -> str:
    params = SamplingParams(temperature=0, max_tokens=n)
    async for out in engine.generate(prompt, params, f"direct-{id(prompt)}"):
        text = out.outputs[0].text
    return text


def test_smollm2_through_the_openai_client():
    prompt, n = "The capital of France is", 12
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    engine = AsyncLLM(num_kv_blocks=16, max_model_len=256)
    try:
        want_text = asyncio.run(direct(engine, prompt, n))
        chat_ids = engine.tokenizer.apply_chat_template(messages)
        want_chat = asyncio.run(direct(engine, {"prompt_token_ids": chat_ids}, n))
        assert want_text.strip()
        with running_server(build_app(engine)) as url:
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
    finally:
        asyncio.run(engine.shutdown())
