"""LLM's pooling methods (vLLM's names): encode, embed, classify, score.

    llm = LLM("Qwen/Qwen3-Embedding-0.6B")          # runner="pooling" found in the checkpoint
    llm.embed(["a", "b"])[0].outputs.embedding       # list[float]
    llm = LLM("Qwen/Qwen3-Reranker-0.6B")
    llm.score("query", ["doc 1", "doc 2"])[1].outputs.score

score on an embedding model is the cosine similarity of the two embeddings; on a classifier or
reranker it is the model's score of the pair's prompt (pooling/prompts.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from tinypaged.pooling.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from tinypaged.pooling.params import PoolingParams
from tinypaged.pooling.prompts import score_pairs, score_prompt_ids

if TYPE_CHECKING:
    from tinypaged.engine.engine import Engine, PromptType


def add_requests(engine: Engine, ids: Iterator[int], requests: Iterable[tuple]) -> dict[str, int]:
    """Each request's arguments after its id (prompt, params[, lora]) as an engine request with
    the next id; returns {request id: position}. LLM.generate and the pooling methods share it.
    A refused request raises, after aborting those added before it: the engine is left clean
    for the next call."""
    order: dict[str, int] = {}
    for args in requests:
        request_id = str(next(ids))
        try:
            engine.add_request(request_id, *args)
        except Exception:
            for rid in order:
                engine.abort_request(rid)
            raise
        order[request_id] = len(order)
    return order


class PoolingLLMMixin:
    engine: Engine
    _ids: itertools.count

    def _check_pooling(self, what: str) -> dict:
        pooler = self.engine.config.pooler_config
        if self.engine.config.runner != "pooling":
            raise ValueError(
                f"{what}() needs a pooling model; {self.engine.model_name} runs as a generative "
                "model (pass runner='pooling' to pool its hidden states)"
            )
        return pooler

    def _pool(self, prompts: PromptType | Sequence[PromptType],
              params: PoolingParams | None, task: str, use_tqdm: bool,
              truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        self._check_pooling(task)
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        params = PoolingParams() if params is None else params
        params = PoolingParams(params.dimensions, params.normalize, params.use_activation,
                               truncate_prompt_tokens or params.truncate_prompt_tokens, task)
        order = add_requests(self.engine, self._ids, [(prompt, params) for prompt in prompts])
        results: list[PoolingRequestOutput | None] = [None] * len(order)
        bar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm, unit="req")
        while self.engine.has_unfinished_requests():
            for out in self.engine.step(finished_only=True):
                results[order[out.request_id]] = out
                bar.update(1)
        bar.close()
        return results  # type: ignore[return-value]

    def encode(self, prompts, pooling_params: PoolingParams | None = None, use_tqdm: bool = True,
               truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """The pooled output of each prompt as a tensor (embedding, or classifier output)."""
        return self._pool(prompts, pooling_params, "encode", use_tqdm, truncate_prompt_tokens)

    def embed(self, prompts, pooling_params: PoolingParams | None = None, use_tqdm: bool = True,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        outs = self._pool(prompts, pooling_params, "embed", use_tqdm, truncate_prompt_tokens)
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(self, prompts, pooling_params: PoolingParams | None = None,
                 use_tqdm: bool = True, truncate_prompt_tokens: int | None = None,
                 ) -> list[ClassificationRequestOutput]:
        outs = self._pool(prompts, pooling_params, "classify", use_tqdm, truncate_prompt_tokens)
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def score(self, data_1: str | list[str], data_2: str | list[str], *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """One score per (query, document) pair: one query and N documents, or N and N."""
        pooler = self._check_pooling("score")
        pairs = score_pairs(data_1, data_2)
        if pooler["task"] == "embed":
            texts = list(dict.fromkeys(t for pair in pairs for t in pair))
            embs = self._pool(texts, pooling_params, "embed", use_tqdm, truncate_prompt_tokens)
            vec = {t: torch.nn.functional.normalize(o.outputs.data, dim=-1)
                   for t, o in zip(texts, embs)}
            scores = [float(vec[q] @ vec[d]) for q, d in pairs]
            ids = [None] * len(pairs)
        else:
            tok = self.engine.tokenizer
            prompts = [{"prompt_token_ids": score_prompt_ids(tok, pooler, q, d)} for q, d in pairs]
            outs = self._pool(prompts, pooling_params, "score", use_tqdm, truncate_prompt_tokens)
            scores = [float(o.outputs.data[0]) for o in outs]
            ids = [o.prompt_token_ids for o in outs]
        return [ScoringRequestOutput(str(next(self._ids)), ScoringOutput(s), i)
                for s, i in zip(scores, ids)]
