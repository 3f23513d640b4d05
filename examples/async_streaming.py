"""Stream tokens as they are generated, with AsyncLLM (the engine behind `tinypaged serve`).

    python examples/async_streaming.py

Each output is cumulative: print the part of the text that is new since the last one.
Requests submitted from several coroutines share the engine's batches.
"""

import asyncio

from tinypaged import AsyncLLM, SamplingParams


async def main() -> None:
    engine = AsyncLLM()  # the built-in SmolLM2-135M-Instruct
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=48, seed=0)
    try:
        shown = ""
        async for out in engine.generate("Once upon a time, a small robot", params, "story"):
            text = out.outputs[0].text
            print(text[len(shown) :], end="", flush=True)
            shown = text
        final = out.outputs[0]
        print(f"\n[finish_reason={final.finish_reason}, tokens={len(final.token_ids)}]")
    finally:
        await engine.shutdown()


asyncio.run(main())
