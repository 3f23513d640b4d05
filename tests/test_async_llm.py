"""AsyncLLM: many concurrent streams on one engine loop, some aborted midway; the others finish
with the same tokens as LLM.generate, and no KV block is left behind."""

from __future__ import annotations

import asyncio

import pytest

from tests.test_engine import prompts, save_tiny
from tinypaged import LLM, AsyncLLM, SamplingParams

ENGINE = dict(skip_tokenizer_init=True, num_kv_blocks=96, block_size=8, max_num_seqs=16)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("async-llama")
    save_tiny("llama", path)
    return path


def test_32_streams_with_aborts(model_dir):
    batch = prompts(32, seed=21, lo=3, hi=30)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(str(model_dir), **ENGINE).generate(
        [{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)]
    engine = AsyncLLM(str(model_dir), **ENGINE)

    async def stream(i: int):
        seen, last = 0, None
        async for out in engine.generate({"prompt_token_ids": batch[i]}, params, f"r{i}"):
            assert len(out.outputs[0].token_ids) >= seen  # cumulative, never shrinking
            seen, last = len(out.outputs[0].token_ids), out
            if i % 4 == 0 and seen >= 3:
                await engine.abort(f"r{i}")  # hang up midway: the stream just stops
                return None
        assert last.finished and last.outputs[0].finish_reason == "length"
        return last.outputs[0].token_ids

    async def main():
        try:
            return await asyncio.gather(*(stream(i) for i in range(32)))
        finally:
            await engine.shutdown()

    results = asyncio.run(main())
    for i, got in enumerate(results):
        if i % 4 == 0:
            assert got is None
        else:
            assert got == expected[i]
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_running"] == stats["num_waiting"] == 0
