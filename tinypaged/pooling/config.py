"""Which runner a checkpoint gets and, for a pooling model, what to pool (vLLM's detection).

`resolve_runner(config)` sets `config.runner` ("generate" or "pooling") once and, for pooling,
`config.pooler_config`, a plain dict (it travels to the engine process and the server):

    task          "embed" (a vector per input) or "classify" (labels, rerank scores)
    pooling_type  "LAST" | "MEAN" | "CLS": which hidden states make the input's vector
    normalize     L2-normalize embeddings
    head          "none" (the hidden state itself), "classifier" (score.weight, num_labels
                  logits), "yes_no" (Qwen3-Reranker: logit("yes") - logit("no") from lm_head)
    num_labels, labels (id2label), yes_no_token_ids, rerank_format ("qwen3": its prompt around
    query and document)

runner="auto" picks pooling for: a sentence-transformers checkpoint (modules.json or
1_Pooling/config.json: pooling mode and Normalize read from there), a *ForSequenceClassification
or bare *Model architecture (not a generative one such as ChatGLMModel), and a Qwen3 checkpoint
named *Reranker*. A user's `pooler_config` (pooling_type, normalize) overrides what was read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tinypaged.models.registry import supported_architectures

RUNNERS = ("auto", "generate", "pooling")
POOLING_TYPES = ("LAST", "MEAN", "CLS")
_USER_KEYS = ("pooling_type", "normalize")
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
             "pooling_mode_cls_token": "CLS"}


def _sentence_transformers(model_dir: Path) -> dict[str, Any] | None:
    """pooling_type / normalize of a sentence-transformers checkpoint, or None if it is not."""
    modules_file, pooling_dir = model_dir / "modules.json", "1_Pooling"
    modules = json.loads(modules_file.read_text()) if modules_file.is_file() else []
    kinds = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
    for module, kind in zip(modules, kinds):
        if kind == "Pooling":
            pooling_dir = module.get("path") or pooling_dir
        elif kind not in ("Transformer", "Normalize"):
            raise ValueError(
                f"modules.json of {model_dir} has a {kind!r} module; tinypaged pools with "
                "Transformer, Pooling and Normalize modules only"
            )
    pooling_file = model_dir / pooling_dir / "config.json"
    if not modules and not pooling_file.is_file():
        return None
    pooling_type = "MEAN"  # sentence-transformers' default mode
    if pooling_file.is_file():
        raw = json.loads(pooling_file.read_text())
        modes = [mode for key, mode in _ST_MODES.items() if raw.get(key)]
        others = [k for k, v in raw.items() if k.startswith("pooling_mode") and v
                  and k not in _ST_MODES]
        if others or len(modes) > 1:
            raise ValueError(
                f"{pooling_file}: pooling modes {others or modes} are not supported; "
                "tinypaged pools with one of lasttoken, mean_tokens, cls_token"
            )
        pooling_type = modes[0] if modes else pooling_type
    return {"pooling_type": pooling_type, "normalize": "Normalize" in kinds}


def _token_id(tokenizer, word: str) -> int:
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:
        token_id = hf.convert_tokens_to_ids(word)
        if token_id is not None and token_id != hf.unk_token_id:
            return int(token_id)
    ids = tokenizer.encode(word, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"the reranker's token {word!r} is not a single token of this tokenizer")
    return ids[0]


def detect_pooler(model_dir: Path, hf_config, runner: str, tokenizer_dir: Path,
                  name: str = "") -> dict | None:
    """The pooler of this checkpoint, or None when runner "auto" finds a generative model.
    `name`: how the user named the model (a hub id's folder is a commit hash)."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    model_type = getattr(hf_config, "model_type", "") or ""
    st = _sentence_transformers(model_dir)
    generative = set(supported_architectures())  # ChatGLMModel generates
    pooler = {"task": "embed", "pooling_type": "LAST", "normalize": True, "head": "none"}
    from_tokens = getattr(hf_config, "classifier_from_token", None)  # vLLM's hf_overrides
    names = f"{Path(name).name} {model_dir.name}".lower()
    reranker_name = "reranker" in names and model_type == "qwen3"
    if any(a.endswith("ForSequenceClassification") for a in archs) and not from_tokens:
        labels = getattr(hf_config, "id2label", None) or {}
        num_labels = int(getattr(hf_config, "num_labels", 0) or len(labels) or 1)
        pooler.update(task="classify", head="classifier", num_labels=num_labels,
                      labels=[str(labels.get(i, i)) for i in range(num_labels)])
    elif from_tokens or reranker_name:
        words = list(from_tokens or ["no", "yes"])
        if len(words) != 2:
            raise ValueError(
                f"classifier_from_token must name two tokens (no, yes), got {words!r}")
        from tinypaged.tokenizer.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_dir)
        qwen3 = reranker_name or bool(getattr(hf_config, "is_original_qwen3_reranker", False))
        pooler.update(task="classify", head="yes_no", num_labels=1,
                      yes_no_token_ids=[_token_id(tokenizer, w) for w in words],
                      rerank_format="qwen3" if qwen3 else None)
    elif st is not None:
        pooler.update(st)
    elif runner == "auto" and not any(a.endswith("Model") and a not in generative
                                      for a in archs):  # a bare Qwen2Model: its hidden states
        return None
    return pooler


def resolve_runner(config) -> None:
    """Fill `config.runner` and `config.pooler_config` from the checkpoint (idempotent)."""
    if config.runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}; got {config.runner!r}")
    if config.runner == "generate" or (config.runner == "pooling" and config.pooler_config
                                       and "head" in config.pooler_config):
        return
    from tinypaged.models.loader import load_hf_config, resolve_model
    from tinypaged.tokenizer.tokenizer import tokenizer_path

    model_dir = resolve_model(config.model)
    user = dict(config.pooler_config or {})
    unknown = sorted(set(user) - set(_USER_KEYS))
    if unknown:
        raise ValueError(f"pooler_config: unknown key(s) {unknown}; known: {list(_USER_KEYS)}")
    hf_config = load_hf_config(model_dir)
    pooler = detect_pooler(model_dir, hf_config, config.runner,
                           Path(tokenizer_path(config.tokenizer, model_dir)), str(config.model))
    if pooler is None:
        if user:
            raise ValueError("pooler_config is given but the model is generative; pass "
                             "runner='pooling' to run it as a pooling model")
        config.runner = "generate"
        return
    pooler.update(user)
    if pooler["pooling_type"] not in POOLING_TYPES:
        raise ValueError(f"pooler_config: pooling_type must be one of {', '.join(POOLING_TYPES)}"
                         f"; got {pooler['pooling_type']!r}")
    if config.tensor_parallel_size > 1:
        raise ValueError("pooling models run with tensor_parallel_size=1 only")
    config.runner, config.pooler_config = "pooling", pooler
