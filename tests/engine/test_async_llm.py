"""AsyncLLM: many concurrent streams on one engine loop, some aborted midway; the others finish
with the same tokens as LLM.generate, and no KV block is left behind."""

from __future__ import annotations

import asyncio
import time

import pytest
from helpers.models import prompts, save_tiny

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


def _slow_steps(engine: AsyncLLM, seconds: float) -> None:
    """Make every engine step take at least `seconds` (the engine thread holds the step)."""
    step = engine.engine.step

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return step(*args, **kwargs)

    engine.engine.step = slow


def test_event_loop_never_waits_for_a_step(model_dir):
    """Submitting, aborting and reading stats return at once while a long step runs, and 200
    streams cancelled together cost the next request about one step, not one step each."""
    engine = AsyncLLM(str(model_dir), **ENGINE)
    step_s = 0.1
    _slow_steps(engine, step_s)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def consume(i: int) -> None:
        async for _ in engine.generate({"prompt_token_ids": [3 + i % 50]}, params, f"c{i}"):
            pass

    async def main() -> float:
        try:
            tasks = [asyncio.create_task(consume(i)) for i in range(200)]
            await asyncio.sleep(3 * step_s)  # steps are running now
            t0 = time.perf_counter()
            engine.get_stats()
            for task in tasks:
                task.cancel()  # 200 clients hang up at once: 200 aborts
            await asyncio.gather(*tasks, return_exceptions=True)
            assert time.perf_counter() - t0 < 0.05  # nothing above waited for the engine
            t0 = time.perf_counter()
            quick = SamplingParams(temperature=0.0, max_tokens=1)
            async for _ in engine.generate({"prompt_token_ids": [5, 6]}, quick, "next"):
                pass
            return time.perf_counter() - t0
        finally:
            await engine.shutdown()

    waited = asyncio.run(main())
    # The step in flight, then the next one (aborts applied first, then this prefill).
    assert waited < 3 * step_s + 0.5, waited
    stats = engine.get_stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_admission_errors_reach_the_caller(model_dir):
    engine = AsyncLLM(str(model_dir), **ENGINE)
    greedy = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)

    async def first(prompt, params, request_id):
        async for out in engine.generate(prompt, params, request_id):
            return out

    async def main() -> None:
        try:
            # Found by the engine loop when it adds the request: token ids against the model's
            # vocabulary (256); sent back through the request's queue.
            with pytest.raises(ValueError, match="out of range"):
                await first({"prompt_token_ids": [1, 256]}, greedy, "a")
            stop = SamplingParams(stop_token_ids=[256], min_tokens=1)
            with pytest.raises(ValueError, match="stop_token_ids"):
                await first({"prompt_token_ids": [1]}, stop, "b")
            # A request id already in use: found by AsyncLLM, which holds the streams.
            hold = engine.generate({"prompt_token_ids": [1]}, greedy, "dup")
            await anext(hold)
            with pytest.raises(ValueError, match="already in use"):
                await first({"prompt_token_ids": [2]}, greedy, "dup")
            await hold.aclose()
            # Found by the engine loop (the scheduler): a prompt that can never fit.
            with pytest.raises(ValueError, match="max_model_len=256"):
                await first({"prompt_token_ids": [1] * 250}, greedy, "big")
            assert (await first({"prompt_token_ids": [1]}, greedy, "fine")).outputs[0].token_ids
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_streamed_logprobs_are_snapshots(model_dir):
    """Outputs handed out while the engine keeps going never change afterwards: every output's
    logprobs list is as long as its token ids (a live list would keep growing)."""
    engine = AsyncLLM(str(model_dir), **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)

    async def stream(i: int) -> list:
        seen = []
        async for out in engine.generate({"prompt_token_ids": [4 + i]}, params, f"lp{i}"):
            seen.append(out.outputs[0])
            await asyncio.sleep(0.002 * (i % 3))  # readers slower than the engine
        return seen

    async def main() -> list:
        try:
            return await asyncio.gather(*(stream(i) for i in range(24)))
        finally:
            await engine.shutdown()

    for seen in asyncio.run(main()):
        assert len(seen[-1].token_ids) == 24
        for c in seen:
            assert len(c.logprobs) == len(c.token_ids)
