"""Structured-output test data: a bounded JSON schema and a tiny model with SmolLM2's vocabulary."""

from __future__ import annotations

import shutil

from helpers.models import tiny_hf_model
from tinypaged.models.default_model import ensure_default_model

VOCAB = 49152  # SmolLM2's
SCHEMA = {  # bounded everywhere, so even a random model finishes it in a few dozen tokens
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["cat", "dog"]},
        "owner": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 4}, "vip": {"type": "boolean"}},
            "required": ["name", "vip"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "kind", "owner"],
    "additionalProperties": False,
}


def save_tiny_with_smollm2_vocab(path) -> None:
    """A tiny random Llama with SmolLM2's tokenizer and chat template (eos 2 = <|im_end|>)."""
    hf = tiny_hf_model("llama", seed=5, vocab_size=VOCAB, eos_token_id=2, bos_token_id=1)
    hf.save_pretrained(path)
    source = ensure_default_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(source / name, path / name)


def run_to_end(engine) -> tuple[dict, dict]:
    """Step `engine` until no request is left -> ({request_id: its finished RequestOutput},
    {request_id: the error that failed it})."""
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished, dict(engine.pop_request_errors())
