"""JSON-schema mode on the real default model (SmolLM2-135M-Instruct): many chat requests with a
nested schema, batched together, and every output parses and validates.

TINYPAGED_JSON_REQUESTS sets the number of requests (default 12; the issue's long mode is 100).
"""

from __future__ import annotations

import json
import os

import jsonschema
import pytest
import torch

from tinypaged import LLM, SamplingParams, StructuredOutputsParams

NUM_REQUESTS = int(os.environ.get("TINYPAGED_JSON_REQUESTS", "12"))
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "pets": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {"kind": {"enum": ["cat", "dog", "fish"]},
                               "age": {"type": "integer", "minimum": 0, "maximum": 30}},
                "required": ["kind", "age"],
                "additionalProperties": False,
            },
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "address", "pets", "active"],
    "additionalProperties": False,
}
TOPICS = ["a retired sailor", "a young programmer", "a baker in Lyon", "a farmer with dogs",
          "a student", "a painter", "a doctor who likes fish", "a chess champion", "a pilot",
          "a librarian with three cats"]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_json_schema_outputs_parse_and_validate():
    llm = LLM(max_model_len=1024)
    conversations = [
        [{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} (person {i}) as JSON "
                                     "with name, age, address, pets and active."}]
        for i in range(NUM_REQUESTS)
    ]
    # Greedy for most, seeded sampling for every third: both must stay inside the schema.
    params = [
        SamplingParams(
            max_tokens=300, structured_outputs=StructuredOutputsParams(json=SCHEMA),
            **({"temperature": 0.8, "seed": i} if i % 3 == 2 else {"temperature": 0.0}),
        )
        for i in range(NUM_REQUESTS)
    ]
    outs = llm.chat(conversations, params, use_tqdm=False)
    for out in outs:
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
