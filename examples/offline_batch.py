"""Offline batch generation: a list of prompts in, one completion each, in input order.

    python examples/offline_batch.py

The engine schedules all prompts together (continuous batching over the paged KV cache), so a
batch costs little more than its longest request.
"""

from tinypaged import LLM, SamplingParams

prompts = [
    "The capital of France is",
    "The three primary colors are",
    "A good name for a pet cat is",
    "def fibonacci(n):",
]
llm = LLM()  # the built-in SmolLM2-135M-Instruct; or LLM("path/to/hf-dir" | "hub/id" | "x.gguf")
params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=0)

for out in llm.generate(prompts, params):
    print(f"{out.prompt!r} -> {out.outputs[0].text!r}")
