"""The pooling endpoints (vLLM's), served when the model is a pooling model:

    POST /v1/embeddings   OpenAI's: input = a string, strings, token ids or lists of token ids;
                          encoding_format float | base64; dimensions; usage
    POST /pooling         vLLM's: the same input, each result's raw pooled `data`
    POST /classify        vLLM's: the same input -> each input's label and class probabilities
    POST /score           vLLM's: text_1 (one or N) and text_2 (N) -> one score per pair
    POST /rerank, /v1/rerank, /v2/rerank
                          Jina's / Cohere's: query, documents (strings or {"text": ...}),
                          top_n, return_documents -> results sorted by relevance_score

Each input is one engine request with PoolingParams (pooling/params.py); they run batched by the
engine's scheduler. On a generative model these routes answer 400, as the generation routes do
on a pooling model (the engine refuses SamplingParams there). score / rerank on an embedding
model compare embeddings by cosine similarity (as vLLM's); on a reranker or classifier they are
the model's score of the pair's prompt (pooling/prompts.py).
"""

from __future__ import annotations

import asyncio
import base64
from typing import TYPE_CHECKING, Any

import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tinypaged.entrypoints.openai.errors import bad_request, show
from tinypaged.entrypoints.openai.response_bodies import new_id, now
from tinypaged.pooling.outputs import PoolingRequestOutput
from tinypaged.pooling.params import PoolingParams
from tinypaged.pooling.prompts import score_pairs, score_prompt_ids

if TYPE_CHECKING:
    from tinypaged.entrypoints.openai.api_server import OpenAIServer


def pooling_routes(server: OpenAIServer) -> list[Route]:
    """The routes of this module, for build_app."""
    api = PoolingAPI(server)
    e = server.endpoint
    rerank = e(api.rerank, auth=True)
    return [
        Route("/v1/embeddings", e(api.embeddings, auth=True), methods=["POST"]),
        Route("/pooling", e(api.pooling, auth=True), methods=["POST"]),
        Route("/classify", e(api.classify, auth=True), methods=["POST"]),
        Route("/score", e(api.score, auth=True), methods=["POST"]),
        Route("/v1/score", e(api.score, auth=True), methods=["POST"]),
        Route("/rerank", rerank, methods=["POST"]),
        Route("/v1/rerank", rerank, methods=["POST"]),
        Route("/v2/rerank", rerank, methods=["POST"]),
    ]


def _body(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad_request("body", f"the body must be a JSON object, got {show(body)}")
    return body


def _optional_int(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad_request(name, f"'{name}' must be a positive integer, got {show(value)}")
    return value


def _texts(value: Any, param: str) -> list[str]:
    """A string or a non-empty list of strings."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    raise bad_request(param, f"'{param}' must be a string or a non-empty list of strings, got "
                             f"{show(value)}")


class PoolingAPI:
    def __init__(self, server: OpenAIServer) -> None:
        self.server = server

    @property
    def pooler(self) -> dict:
        config = self.server.engine.config
        if config.runner != "pooling":
            raise bad_request(
                "model",
                f"the model {self.server.model_name} is a generative model; embeddings, scores "
                "and rerank need a pooling model (`tinypaged serve <embedding or reranker "
                "model>`, or --runner pooling)",
                code="model_not_supported",
            )
        return config.pooler_config

    async def _inputs(self, value: Any, param: str) -> list[list[int]]:
        """OpenAI's `input`: a string, a list of strings, token ids, a list of token-id lists."""
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list) and value:
            if all(isinstance(v, str) for v in value):
                for v in value:
                    self.server.check_prompt_chars(len(v), param)
                return await self.server.encode(value, param)
            if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                return [value]
            if all(isinstance(v, list) and v and all(
                    isinstance(t, int) and not isinstance(t, bool) for t in v) for v in value):
                return value
        raise bad_request(param, f"'{param}' must be a string, a list of strings, a list of "
                                 f"token ids or a list of token-id lists; got {show(value)}")

    async def _run(self, prompts: list[list[int]], params: PoolingParams,
                   param: str) -> list[PoolingRequestOutput]:
        """Every prompt as one engine request, all at once; a refusal is this request's 400."""
        server = self.server
        server.admit(len(prompts))
        base = new_id("pool")
        server.in_flight += len(prompts)

        async def one(i: int, ids: list[int]) -> PoolingRequestOutput:
            stream = server.engine.generate({"prompt_token_ids": ids}, params, f"{base}-{i}")
            return [out async for out in stream][-1]  # one output: the request ends at once

        tasks = [asyncio.ensure_future(one(i, ids)) for i, ids in enumerate(prompts)]
        try:
            return await asyncio.gather(*tasks)
        except ValueError as exc:
            raise bad_request(param, str(exc)) from None
        finally:
            for task in tasks:  # one input refused (or the handler cancelled): drop the others
                task.cancel()
            server.in_flight -= len(prompts)

    def _params(self, body: dict, task: str) -> PoolingParams:
        normalize = body.get("normalize")
        if normalize is not None and not isinstance(normalize, bool):
            raise bad_request("normalize", f"'normalize' must be a boolean, got {show(normalize)}")
        try:
            return PoolingParams(
                dimensions=_optional_int(body, "dimensions"), normalize=normalize,
                truncate_prompt_tokens=_optional_int(body, "truncate_prompt_tokens"), task=task)
        except ValueError as exc:
            raise bad_request("body", str(exc)) from None

    async def _pool(self, request: Request, task: str):
        body = _body(await self.server.read_json(request))
        model = self.server.check_model(body.get("model"))
        self.pooler  # noqa: B018 - a 400 on a generative model
        if "input" not in body:
            raise bad_request("input", "the request needs 'input'", code="missing_field")
        encoding = body.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise bad_request("encoding_format", "'encoding_format' must be 'float' or "
                                                 f"'base64', got {show(encoding)}")
        prompts = await self._inputs(body["input"], "input")
        outs = await self._run(prompts, self._params(body, task), "input")
        num_tokens = sum(map(len, prompts))
        return model, outs, encoding, {"prompt_tokens": num_tokens, "total_tokens": num_tokens}

    async def _vectors(self, request: Request, task: str, item: str, key: str,
                       id_prefix: str) -> Response:
        """Each input's pooled vector as {"object": item, "index", key: the vector}."""
        model, outs, encoding, usage = await self._pool(request, task)
        data = [{"object": item, "index": i, key: _encode(o.outputs.data, encoding)}
                for i, o in enumerate(outs)]
        return JSONResponse({"id": new_id(id_prefix), "object": "list", "created": now(),
                             "model": model, "data": data, "usage": usage})

    async def embeddings(self, request: Request) -> Response:
        return await self._vectors(request, "embed", "embedding", "embedding", "embd")

    async def pooling(self, request: Request) -> Response:
        return await self._vectors(request, "encode", "pooling", "data", "pool")

    async def classify(self, request: Request) -> Response:
        model, outs, _, usage = await self._pool(request, "classify")
        labels = self.pooler.get("labels") or []
        data = []
        for i, o in enumerate(outs):
            probs = o.outputs.data.tolist()
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append({"index": i, "label": labels[best] if best < len(labels) else str(best),
                         "probs": probs, "num_classes": len(probs)})
        return JSONResponse({"id": new_id("classify"), "object": "list", "created": now(),
                             "model": model, "data": data, "usage": usage})

    async def _scores(self, body: dict, queries: list[str], documents: list[str],
                      param: str) -> tuple[list[float], int]:
        """One score per (query, document) pair and the prompt tokens it took."""
        pooler = self.pooler
        try:
            pairs = score_pairs(queries, documents)
        except ValueError as exc:
            raise bad_request(param, str(exc)) from None
        truncate = _optional_int(body, "truncate_prompt_tokens")
        if pooler["task"] == "embed":
            texts = list(dict.fromkeys(t for pair in pairs for t in pair))
            prompts = await self.server.encode(texts, param)
            outs = await self._run(prompts, PoolingParams(truncate_prompt_tokens=truncate,
                                                          task="embed"), param)
            vec = {t: torch.nn.functional.normalize(o.outputs.data, dim=-1)
                   for t, o in zip(texts, outs)}
            return [float(vec[q] @ vec[d]) for q, d in pairs], sum(map(len, prompts))
        tok = self.server.engine.tokenizer
        prompts = [score_prompt_ids(tok, pooler, q, d) for q, d in pairs]
        outs = await self._run(prompts, PoolingParams(truncate_prompt_tokens=truncate,
                                                      task="score"), param)
        return [float(o.outputs.data[0]) for o in outs], sum(map(len, prompts))

    async def score(self, request: Request) -> Response:
        body = _body(await self.server.read_json(request))
        model = self.server.check_model(body.get("model"))
        first = next((k for k in ("text_1", "data_1", "queries") if k in body), "text_1")
        second = next((k for k in ("text_2", "data_2", "documents") if k in body), "text_2")
        queries, documents = _texts(body.get(first), first), _texts(body.get(second), second)
        scores, num_tokens = await self._scores(body, queries, documents, second)
        data = [{"object": "score", "index": i, "score": s} for i, s in enumerate(scores)]
        return JSONResponse({"id": new_id("score"), "object": "list", "created": now(),
                             "model": model, "data": data,
                             "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})

    async def rerank(self, request: Request) -> Response:
        body = _body(await self.server.read_json(request))
        model = self.server.check_model(body.get("model"))
        query = body.get("query")
        if not isinstance(query, str):
            raise bad_request("query", f"'query' must be a string, got {show(query)}")
        docs = body.get("documents")
        if isinstance(docs, list) and docs and all(isinstance(d, dict) for d in docs):
            docs = [d.get("text") for d in docs]  # Cohere's {"text": ...} documents
        documents = _texts(docs, "documents")
        top_n = _optional_int(body, "top_n") or len(documents)
        return_documents = body.get("return_documents", True)
        scores, num_tokens = await self._scores(body, [query], documents, "documents")
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:top_n]
        results = []
        for i in order:
            result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if return_documents:
                result["document"] = {"text": documents[i]}
            results.append(result)
        return JSONResponse({"id": new_id("rerank"), "model": model, "results": results,
                             "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


def _encode(data: torch.Tensor, encoding: str) -> list[float] | str:
    """float: a JSON list; base64: the float32 little-endian bytes, as OpenAI's API sends."""
    if encoding == "float":
        return data.tolist()
    return base64.b64encode(data.numpy().astype("<f4").tobytes()).decode()

