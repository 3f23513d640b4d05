"""What pooling requests return, with vLLM's class and field names:

    llm.encode(...)   -> PoolingRequestOutput        .outputs.data       (a float32 tensor)
    llm.embed(...)    -> EmbeddingRequestOutput      .outputs.embedding  (list[float])
    llm.classify(...) -> ClassificationRequestOutput .outputs.probs      (list[float])
    llm.score(...)    -> ScoringRequestOutput        .outputs.score      (float)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PoolingOutput:
    data: torch.Tensor  # [dim], float32, on the CPU


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int] | None
    finished: bool = True
    prompt: str | None = None
    num_cached_tokens: int = 0


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int] | None
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(out.request_id, EmbeddingOutput(out.outputs.data.tolist()),
                   out.prompt_token_ids, out.finished)


@dataclass
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int] | None
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> ClassificationRequestOutput:
        return cls(out.request_id, ClassificationOutput(out.outputs.data.tolist()),
                   out.prompt_token_ids, out.finished)


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int] | None
    finished: bool = True
