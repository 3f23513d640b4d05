"""Tiny sentence-transformers embedding checkpoints and their transformers reference, for the
pooling tests (tests/pooling, tests/server)."""

from __future__ import annotations

import json

import torch

from helpers.models import save_byte_tokenizer, tiny_hf_model


def write_embedding_checkpoint(path, kind: str, mode: str, normalize: bool):
    """A sentence-transformers directory like Qwen3-Embedding's: the bare model's weights (no
    "model." prefix, no lm_head) under a *ForCausalLM config, modules.json, 1_Pooling."""
    hf = tiny_hf_model(kind, seed=5)
    hf.model.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = [type(hf).__name__]
    (path / "config.json").write_text(json.dumps(config))
    save_byte_tokenizer(path)
    st = "sentence_transformers.models."
    modules = [{"idx": 0, "name": "0", "path": "", "type": st + "Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": st + "Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": st + "Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": hf.config.hidden_size,
        "pooling_mode_mean_tokens": mode == "mean", "pooling_mode_lasttoken": mode == "last"}))
    return hf.model


def reference_embedding(model, ids: list[int], mode: str, normalize: bool) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]  # [T, hidden]
    vec = hidden[-1] if mode == "last" else hidden.mean(0)
    return torch.nn.functional.normalize(vec, dim=-1) if normalize else vec
