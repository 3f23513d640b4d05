"""What pooling requests return, with vLLM's class and field names:

    llm.encode(...)   -> PoolingRequestOutput        .outputs.data       (a float32 tensor)
    llm.embed(...)    -> EmbeddingRequestOutput      .outputs.embedding  (list[float])
    llm.classify(...) -> ClassificationRequestOutput .outputs.probs      (list[float])
    llm.score(...)    -> ScoringRequestOutput        .outputs.score      (float)

As in vLLM, the last three are PoolingRequestOutput with a typed `outputs`: the same request
fields, and `from_base` to turn the engine's tensor output into the task's list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

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


_O = TypeVar("_O")


@dataclass
class PoolingRequestOutput(Generic[_O]):
    request_id: str
    outputs: _O  # PoolingOutput from the engine; the task's output in the subclasses
    prompt_token_ids: list[int] | None
    finished: bool = True
    prompt: str | None = None
    num_cached_tokens: int = 0

    # what `from_base` builds from the pooled tensor, as a list (embed and classify)
    output_type: ClassVar[Any] = None

    @classmethod
    def from_base(cls, out: PoolingRequestOutput[PoolingOutput]) -> PoolingRequestOutput:
        if cls.output_type is None:
            raise TypeError(f"{cls.__name__} is not made from one pooled output")
        return cls(out.request_id, cls.output_type(out.outputs.data.tolist()),
                   out.prompt_token_ids, out.finished, out.prompt, out.num_cached_tokens)


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    output_type = EmbeddingOutput


class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    output_type = ClassificationOutput


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    """Built by LLM.score itself: a score comes from one or two pooled outputs."""
