"""The official `openai` client against `tinypaged serve`: a completion, then a streamed chat.

    tinypaged serve                      # in another terminal: SmolLM2 on http://127.0.0.1:8000
    python examples/openai_client.py [BASE_URL]

Set TINYPAGED_API_KEY if the server was started with --api-key.
"""

import os
import sys

from openai import OpenAI

base_url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1"
client = OpenAI(base_url=base_url, api_key=os.environ.get("TINYPAGED_API_KEY", "unused"))
model = client.models.list().data[0].id

completion = client.completions.create(
    model=model, prompt="The capital of France is", max_tokens=16, temperature=0
)
print("completion:", completion.choices[0].text)

stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Name three colors of the rainbow."}],
    max_tokens=64,
    temperature=0.7,
    stream=True,
    stream_options={"include_usage": True},
)
print("chat: ", end="", flush=True)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
    if chunk.usage:  # the last chunk, asked for with include_usage
        print(f"\n[{chunk.usage.completion_tokens} tokens]")
