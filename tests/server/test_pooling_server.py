"""The pooling routes through the official openai client and plain HTTP, against the app
`tinypaged serve` builds for a tiny sentence-transformers Qwen3 embedding checkpoint (one
server start); the embeddings must be transformers' (helpers/pooling.py)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch
from helpers.models import single_thread  # noqa: F401
from helpers.pooling import reference_embedding, write_embedding_checkpoint
from helpers.server import FakeEngine, running_server

from tinypaged.engine.async_llm import AsyncLLM
from tinypaged.entrypoints.openai.api_server import build_app

TEXTS = ["hello pooling world", "paged attention", "a"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-embed")
    ref_model = write_embedding_checkpoint(path, "qwen3", "last", normalize=True)
    engine = AsyncLLM(str(path), max_model_len=128, num_kv_blocks=64, dtype="float32")
    try:
        with running_server(build_app(engine, served_model_name="tiny-embed")) as url:
            yield url, engine, ref_model
    finally:
        asyncio.run(engine.shutdown())


def test_openai_client_embeddings(served):
    url, engine, ref_model = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    tok = engine.tokenizer
    refs = [reference_embedding(ref_model, tok.encode(t), "last", True) for t in TEXTS]
    # The SDK asks for base64 by default and decodes it: float32 little-endian bytes.
    resp = client.embeddings.create(model="tiny-embed", input=TEXTS)
    assert [d.index for d in resp.data] == [0, 1, 2]
    assert resp.usage.prompt_tokens == sum(len(tok.encode(t)) for t in TEXTS)
    for d, ref in zip(resp.data, refs):
        got = torch.tensor(d.embedding)
        assert torch.nn.functional.cosine_similarity(got, ref, dim=0) > 1 - 1e-5
    # float, token ids, Matryoshka dimensions (cut, then normalized)
    resp = client.embeddings.create(model="tiny-embed", input=tok.encode(TEXTS[0]),
                                    encoding_format="float", dimensions=8)
    want = torch.nn.functional.normalize(
        reference_embedding(ref_model, tok.encode(TEXTS[0]), "last", False)[:8], dim=-1)
    torch.testing.assert_close(torch.tensor(resp.data[0].embedding), want, atol=1e-5, rtol=1e-4)
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model="tiny-embed", input="x", dimensions=4096)
    # A generation route on a pooling model: a clear 400.
    with pytest.raises(openai.BadRequestError, match="pooling model"):
        client.completions.create(model="tiny-embed", prompt="hi", max_tokens=2)


def test_rerank_and_score_on_an_embedding_model(served):
    url, engine, ref_model = served
    tok = engine.tokenizer
    refs = [reference_embedding(ref_model, tok.encode(t), "last", True) for t in TEXTS]
    cosine = [float(refs[0] @ r) for r in refs[1:]]
    body = {"model": "tiny-embed", "query": TEXTS[0], "documents": TEXTS[1:], "top_n": 1}
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        (best,) = r.json()["results"]
        top = max(range(2), key=lambda i: cosine[i])
        assert best["index"] == top and best["document"] == {"text": TEXTS[1 + top]}
        assert abs(best["relevance_score"] - cosine[top]) < 1e-4
    r = httpx.post(url + "/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:]}, timeout=60)
    assert r.status_code == 200, r.text
    assert [abs(d["score"] - c) < 1e-4 for d, c in zip(r.json()["data"], cosine)] == [True] * 2
    r = httpx.post(url + "/pooling", json={"input": [TEXTS[2]]}, timeout=60)
    assert r.status_code == 200, r.text
    torch.testing.assert_close(torch.tensor(r.json()["data"][0]["data"]), refs[2], atol=1e-5,
                               rtol=1e-4)
    r = httpx.post(url + "/rerank", json={"query": "q", "documents": []}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents"


def test_pooling_routes_on_a_generative_model_are_a_400():
    with running_server(build_app(FakeEngine())) as url:
        r = httpx.post(url + "/v1/embeddings", json={"input": "hi"}, timeout=30)
        assert r.status_code == 400
        assert "generative model" in r.json()["error"]["message"]
