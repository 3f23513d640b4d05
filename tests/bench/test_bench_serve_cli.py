"""`tinypaged serve --load-format dummy | --model-shape`, and `bench serve`'s flag checks
(bench serve against the default model: server/test_server_smollm2.py)."""

from __future__ import annotations

import httpx
import pytest
from helpers.server import build_tiny_model, post, running_server

from tinypaged.bench.model_shapes import SHAPES, shape_dir
from tinypaged.entrypoints.cli import main
from tinypaged.entrypoints.openai.api_server import GracefulServer
from tinypaged.tokenizer.tokenizer import load_tokenizer

ENGINE_FLAGS = ["--max-model-len", "256", "--num-kv-blocks", "64", "--dtype", "float32",
                "--max-num-batched-tokens", "256"]
TINY_SHAPE = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64,
    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=3000, tie_word_embeddings=False, max_position_embeddings=256,
    rms_norm_eps=1e-5, rope_theta=10000.0,
)


def serve_in_process(monkeypatch, argv: list[str], work) -> None:
    """Run `tinypaged serve ARGV` here, with `work(url)` in place of uvicorn's blocking loop."""

    def run(self) -> None:
        with running_server(self.config.app) as url:
            work(url)

    monkeypatch.setattr(GracefulServer, "run", run)
    assert main(["serve", *argv]) == 1  # 1: the real loop never started


def test_dummy_weights_need_no_weight_files(tmp_path, monkeypatch, capsys):
    model_dir = build_tiny_model(tmp_path)
    for weights in model_dir.glob("*.safetensors"):
        weights.unlink()
    seen = {}

    def work(url: str) -> None:
        seen["models"] = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        seen["answer"] = post(url, "/v1/completions",
                              {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True}).json()

    serve_in_process(monkeypatch, [str(model_dir), "--load-format", "dummy", *ENGINE_FLAGS], work)
    assert seen["answer"]["usage"] == {"prompt_tokens": len(load_tokenizer(model_dir).encode(
        "Hello")), "completion_tokens": 4, "total_tokens": seen["answer"]["usage"]["total_tokens"]}
    assert seen["models"] == str(model_dir)
    # without it the same folder has nothing to load
    assert main(["generate", str(model_dir), "hi", *ENGINE_FLAGS]) == 1
    assert "tinypaged: error: cannot load" in capsys.readouterr().err


def test_a_model_shape_is_served_with_a_word_tokenizer(monkeypatch):
    monkeypatch.setitem(SHAPES, "tiny-llama", TINY_SHAPE)
    seen = {}

    def work(url: str) -> None:
        seen["models"] = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        seen["answer"] = post(url, "/v1/completions", {"prompt": "t5 t17 t2999", "max_tokens": 6,
                                                       "ignore_eos": True}).json()

    serve_in_process(monkeypatch, ["--model-shape", "tiny-llama", *ENGINE_FLAGS], work)
    assert seen["models"] == "tiny-llama"
    assert seen["answer"]["usage"]["prompt_tokens"] == 3  # one id per word
    words = seen["answer"]["choices"][0]["text"].split()
    assert len(words) == 6 and all(w.startswith(("t", "<")) for w in words), words


def test_word_tokenizer_covers_the_shape_vocabulary():
    tok = load_tokenizer(shape_dir("llama3-8b", tokenizer=True))
    assert tok.vocab_size == SHAPES["llama3-8b"]["vocab_size"] == 128256
    assert tok.encode("t5 t128255", add_special_tokens=False) == [5, 128255]
    assert tok.decode([1000, 128255, 3]) == "t1000 t128255 t3"
    assert tok.eos_token_ids == {2}


def test_model_and_shape_together_is_one_line(tmp_path, capsys):
    assert main(["serve", str(tmp_path), "--model-shape", "llama3-8b"]) == 1
    assert capsys.readouterr().err.startswith("tinypaged: error: give MODEL")


@pytest.mark.parametrize("flag", ["--request-rate=0", "--random-range-ratio=1.5",
                                  "--max-concurrency=0", "--endpoint=/v1/chat/completions"])
def test_bench_serve_refuses_bad_values(flag):
    with pytest.raises(SystemExit, match=flag.split("=")[0]):
        main(["bench", "serve", flag])
