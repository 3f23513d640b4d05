"""--generation-config: the model's generation_config.json sampling defaults, offline and in the
server, as vLLM applies them ("auto"), or not ("vllm")."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers.server import FakeEngine, build_tiny_model, post, running_server

from tinypaged import LLM
from tinypaged.entrypoints.openai.api_server import build_app
from tinypaged.sampling.generation_config import (
    default_sampling_params,
    load_generation_config,
    read_eos_token_ids,
)

QWEN3_LIKE = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 5,
              "do_sample": True, "eos_token_id": [1, 2], "min_p": None}


def test_read_from_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN3_LIKE))
    want = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 5}
    assert default_sampling_params(tmp_path, "auto") == want
    assert default_sampling_params(tmp_path, "vllm") == {}
    assert default_sampling_params(None, str(tmp_path)) == want  # a folder of its own
    assert default_sampling_params(tmp_path / "nothing-here", "auto") == {}
    with pytest.raises(ValueError, match="no generation_config.json"):
        default_sampling_params(None, str(tmp_path / "nothing-here"))


def test_the_file_as_a_dict_is_read_again_when_rewritten(tmp_path):
    assert load_generation_config(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 7], "bos_token_id": 1}')
    assert load_generation_config(tmp_path) == {"eos_token_id": [2, 7], "bos_token_id": 1}
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 3}')
    assert load_generation_config(tmp_path) == {"eos_token_id": 3}  # no stale copy


def test_eos_ids_from_generation_config_else_config_json(tmp_path):
    assert read_eos_token_ids(tmp_path) == set()
    (tmp_path / "config.json").write_text('{"eos_token_id": 5}')
    assert read_eos_token_ids(tmp_path) == {5}
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6}')
    assert read_eos_token_ids(tmp_path) == {5}  # no eos_token_id there: config.json's
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 7]}')
    assert read_eos_token_ids(tmp_path) == {2, 7}
    (tmp_path / "config.json").write_text("not json")  # not read once generation_config answers
    assert read_eos_token_ids(tmp_path) == {2, 7}


def test_no_other_module_reads_the_file():
    package = Path(__file__).resolve().parents[2] / "tinypaged"
    writers = {"models/gguf_file.py", "quantization/quantize.py"}  # write or copy it, never read
    naming = {str(p.relative_to(package)) for p in package.rglob("*.py")
              if re.search(r"""["']generation_config\.json["']""", p.read_text())}
    assert naming - writers == {"sampling/generation_config.py"}


def test_server_fills_fields_the_request_left_out():
    engine = FakeEngine(default_sampling_params={"temperature": 0.6, "top_k": 20, "max_tokens": 5})
    with running_server(build_app(engine)) as url:
        post(url, "/v1/completions", {"prompt": "a"})
        p = engine.seen_params[-1]
        assert (p.temperature, p.top_k, p.max_tokens) == (0.6, 20, 5)
        post(url, "/v1/completions", {"prompt": "a", "temperature": 0.1, "max_tokens": 50})
        p = engine.seen_params[-1]  # the request wins; max_new_tokens still caps max_tokens
        assert (p.temperature, p.top_k, p.max_tokens) == (0.1, 20, 5)


def test_llm_default_sampling_params(tmp_path):
    model_dir = build_tiny_model(tmp_path)
    (model_dir / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": 3, "eos_token_id": 2})
    )
    args = {"max_model_len": 64, "num_kv_blocks": 16, "dtype": "float32"}
    llm = LLM(str(model_dir), **args)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.max_tokens) == (0.0, 3)
    out = llm.generate("Hello there", use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3
