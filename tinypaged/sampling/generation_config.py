"""The model's own sampling defaults, from its generation_config.json (vLLM's --generation-config).

Instruct models ship the sampling their authors recommend, e.g. Qwen3's

    {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": ...}

With `generation_config="auto"` (the default, as in vLLM) these become the defaults of every
request that does not set the field itself: `LLM.get_default_sampling_params()` offline, and the
server's sampling for fields a request leaves out (`max_new_tokens` caps `max_tokens`). "vllm"
ignores the file (SamplingParams' own defaults); any other value is a folder to read the file
from. Only the sampling fields below are taken; eos ids are read by the tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# generation_config.json key -> SamplingParams field
SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def default_sampling_params(model_dir: str | Path | None, generation_config: str) -> dict[str, Any]:
    """SamplingParams keyword arguments from the model's generation_config.json ({} if none)."""
    if generation_config == "vllm":
        return {}
    folder = model_dir if generation_config == "auto" else generation_config
    path = Path(folder) / "generation_config.json" if folder is not None else None
    if path is None or not path.is_file():
        if generation_config != "auto":
            raise ValueError(
                f"generation_config={generation_config!r}: no generation_config.json in that "
                "folder; pass 'auto' (the model's), 'vllm' (none) or a folder that has one"
            )
        return {}
    config = json.loads(path.read_text())
    return {
        field: config[key]
        for key, field in SAMPLING_FIELDS.items()
        if config.get(key) is not None
    }
