"""The token ids that score one (query, document) pair.

- Qwen3-Reranker (rerank_format "qwen3"): its chat prompt, as its model card gives it, asking
  whether the document meets the query; the model's next-token logits of "yes" and "no" give
  the score (model.py).
- A cross-encoder classifier: the tokenizer's own pair encoding of (query, document), as vLLM.
"""

from __future__ import annotations

QWEN3_RERANK_INSTRUCTION = (
    "Given a web search query, retrieve relevant passages that answer the query"
)
_QWEN3_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
_QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def qwen3_rerank_text(query: str, document: str,
                      instruction: str = QWEN3_RERANK_INSTRUCTION) -> str:
    return (f"{_QWEN3_PREFIX}<Instruct>: {instruction}\n<Query>: {query}\n"
            f"<Document>: {document}{_QWEN3_SUFFIX}")


def score_prompt_ids(tokenizer, pooler_config: dict, query: str, document: str) -> list[int]:
    if pooler_config.get("rerank_format") == "qwen3":
        return tokenizer.encode(qwen3_rerank_text(query, document), add_special_tokens=False)
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:
        return list(hf(query, document)["input_ids"])
    return tokenizer.encode(query) + tokenizer.encode(document, add_special_tokens=False)


def score_pairs(data_1: str | list[str], data_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing for score: one query against N documents, or N queries and N documents
    pairwise."""
    queries = [data_1] if isinstance(data_1, str) else list(data_1)
    documents = [data_2] if isinstance(data_2, str) else list(data_2)
    if not queries or not documents:
        raise ValueError("score needs at least one query and one document")
    if len(queries) == 1:
        queries = queries * len(documents)
    if len(queries) != len(documents):
        raise ValueError(
            f"score pairs one query with N documents or N queries with N documents; got "
            f"{len(queries)} queries and {len(documents)} documents"
        )
    return list(zip(queries, documents))
