"""LoRA over HTTP, as vLLM's: `model` picks the adapter, /v1/models lists adapters with their
parent, runtime load/unload behind the env switch, 404 for an unknown adapter, counts in
/metrics; and the CLI flags."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from helpers.lora import save_peft_adapter
from helpers.models import single_thread  # noqa: F401 (autouse)
from helpers.server import build_tiny_model, metric, running_server

from tinypaged import LLM, AsyncLLM, LoRARequest, SamplingParams
from tinypaged.entrypoints.cli import UserError, _engine_kwargs, _lora_modules, build_parser
from tinypaged.entrypoints.openai.api_server import build_app

ENGINE = {"max_model_len": 128, "num_kv_blocks": 64, "dtype": "float32", "enable_lora": True,
          "max_loras": 2}
PROMPT = [5, 17, 301, 42, 9]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora-server")
    base = build_tiny_model(root)
    hf = AutoModelForCausalLM.from_pretrained(str(base))
    for i in (1, 2):
        save_peft_adapter(hf, root / f"a{i}", 8, 16, seed=i)
    return root


def test_serving_adapters(dirs, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    monkeypatch.delenv("TINYPAGED_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(dirs), **ENGINE)
    want = {name: llm.generate({"prompt_token_ids": PROMPT}, greedy, use_tqdm=False,
                               lora_request=lora)[0].outputs[0].text
            for name, lora in (("tiny", None), ("a1", LoRARequest("a1", 1, str(dirs / "a1"))),
                               ("a2", LoRARequest("a2", 2, str(dirs / "a2"))))}
    assert len(set(want.values())) == 3  # each adapter changes the text
    engine = AsyncLLM(str(dirs), **ENGINE)
    app = build_app(engine, served_model_name="tiny", lora_modules={"a1": str(dirs / "a1")})
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    try:
        with running_server(app) as url, httpx.Client(base_url=url, timeout=60) as http:
            models = http.get("/v1/models").json()["data"]
            assert [(m["id"], m.get("parent")) for m in models] == [("tiny", None),
                                                                     ("a1", "tiny")]
            for model in ("tiny", "a1"):
                r = http.post("/v1/completions", json={**body, "model": model})
                assert r.json()["choices"][0]["text"] == want[model], model
            r = http.post("/v1/completions", json={**body, "model": "a2"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            load = {"lora_name": "a2", "lora_path": str(dirs / "a2")}
            assert http.post("/v1/load_lora_adapter", json=load).status_code == 404  # off
            monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
            assert http.post("/v1/load_lora_adapter", json=load).status_code == 200
            bad = {"lora_name": "a3", "lora_path": str(dirs / "nowhere")}
            r = http.post("/v1/load_lora_adapter", json=bad)
            assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]
            r = http.post("/v1/completions", json={**body, "model": "a2"})
            assert r.json()["choices"][0]["text"] == want["a2"]
            text = http.get("/metrics").text
            assert metric(text, "tinypaged:lora_requests_total", lora_name="a1") == 1
            assert metric(text, "tinypaged:lora_requests_info", max_lora="2") > 0
            assert http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"}).status_code == 200
            r = http.post("/v1/completions", json={**body, "model": "a2"})
            assert r.status_code == 404
            r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
            assert r.status_code == 404
    finally:
        asyncio.run(engine.shutdown())


def test_cli_flags():
    args = build_parser().parse_args(
        ["serve", "m", "--enable-lora", "--lora-modules", "x=/a", '{"name": "y", "path": "/b"}',
         "--max-loras", "4", "--max-lora-rank", "64", "--max-cpu-loras", "8"])
    kwargs = _engine_kwargs(args, "m")
    assert (kwargs["enable_lora"], kwargs["max_loras"], kwargs["max_lora_rank"],
            kwargs["max_cpu_loras"]) == (True, 4, 64, 8)
    assert _lora_modules(args) == {"x": "/a", "y": "/b"}
    assert "enable_lora" not in _engine_kwargs(build_parser().parse_args(["serve"]), None)
    with pytest.raises(UserError, match="needs --enable-lora"):
        _lora_modules(build_parser().parse_args(["serve", "--lora-modules", "x=/a"]))
