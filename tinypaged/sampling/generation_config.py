"""The model's own sampling defaults, from its generation_config.json (vLLM's --generation-config).

Instruct models ship the sampling their authors recommend, e.g. Qwen3's

    {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": ...}

With `generation_config="auto"` (the default, as in vLLM) these become the defaults of every
request that does not set the field itself: `LLM.get_default_sampling_params()` offline, and the
server's sampling for fields a request leaves out (`max_new_tokens` caps `max_tokens`). "vllm"
ignores the file (SamplingParams' own defaults); any other value is a folder to read the file
from. Only the sampling fields below are taken.

This module is the one reader of the file: `load_generation_config` gives it as a dict,
`default_sampling_params` the sampling defaults above, and `read_eos_token_ids` the ids that end
a sequence, which the tokenizer adds to its own eos (instruct models often end a turn with a
token that is not the tokenizer's eos, e.g. <|eot_id|>). It imports nothing from tinypaged, so
the tokenizer (and any layer) may import it. The file is read when asked, not cached: an engine
asks twice at start (tokenizer, sampling defaults), and a converter or a test may rewrite the
file within one process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GENERATION_CONFIG = "generation_config.json"

# generation_config.json key -> SamplingParams field
SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def load_generation_config(model_dir: str | Path) -> dict[str, Any]:
    """generation_config.json of `model_dir` as a dict ({} when absent)."""
    path = Path(model_dir) / GENERATION_CONFIG
    return json.loads(path.read_text()) if path.is_file() else {}


def read_eos_token_ids(model_dir: str | Path) -> set[int]:
    """eos ids from generation_config.json, else config.json (as vLLM and transformers derive a
    generation config from the model's config when the file is absent): an int, a list, or
    absent (the empty set)."""
    for load in (load_generation_config, _load_model_config):  # config.json only when needed
        value = load(model_dir).get("eos_token_id")
        if value is not None:
            return {value} if isinstance(value, int) else {int(v) for v in value}
    return set()


def _load_model_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def default_sampling_params(model_dir: str | Path | None, generation_config: str) -> dict[str, Any]:
    """SamplingParams keyword arguments from the model's generation_config.json ({} if none)."""
    if generation_config == "vllm":
        return {}
    folder = model_dir if generation_config == "auto" else generation_config
    if folder is None or not (Path(folder) / GENERATION_CONFIG).is_file():
        if generation_config != "auto":
            raise ValueError(
                f"generation_config={generation_config!r}: no generation_config.json in that "
                "folder; pass 'auto' (the model's), 'vllm' (none) or a folder that has one"
            )
        return {}
    config = load_generation_config(folder)
    return {
        field: config[key]
        for key, field in SAMPLING_FIELDS.items()
        if config.get(key) is not None
    }
