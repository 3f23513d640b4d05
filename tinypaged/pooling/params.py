"""PoolingParams: what one pooling request asks for (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass

TASKS = ("embed", "classify", "score", "encode")


@dataclass
class PoolingParams:
    """`dimensions`: keep the first N dimensions of an embedding (Matryoshka), before it is
    normalized. `normalize`: L2-normalize embeddings (None = the model's default).
    `use_activation`: sigmoid (one label) or softmax over a classifier's logits (None = True).
    `truncate_prompt_tokens`: keep only the last N prompt tokens. `task`: filled by the caller
    (LLM.embed, /v1/embeddings, ...)."""

    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: str | None = None

    def __post_init__(self) -> None:
        for name in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.task is not None and self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}; got {self.task!r}")

    @property
    def max_tokens(self) -> int:
        """What the scheduler reads: a pooling request ends after its prefill, which the
        scheduler counts as one sampled token."""
        return 1
