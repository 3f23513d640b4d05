"""The `tinypaged` command in subprocesses, on a tiny random llama: serve (startup log, health, a
completion, graceful SIGTERM), generate, chat, and one-line errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from helpers.server import build_tiny_model, free_port

from tinypaged import LLM, SamplingParams
from tinypaged.entrypoints.cli import main

ROOT = Path(__file__).resolve().parents[2]
ENGINE_FLAGS = ["--max-model-len", "256", "--num-kv-blocks", "64", "--dtype", "float32"]


def tinypaged(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tinypaged", *args],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=kw.pop("timeout", 180),
        **kw,
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), max_model_len=256, num_kv_blocks=64, dtype="float32")


@pytest.mark.parametrize("engine_process", [False, True], ids=["engine-thread", "engine-process"])
def test_serve_answers_and_stops_gracefully(model_dir, engine_process):
    # The engine in its own process (serve's default on a GPU) behaves the same from outside;
    # one torch thread there keeps a busy 2-core CI machine from thrashing.
    env = {**os.environ, "TINYPAGED_ENABLE_MULTIPROCESSING": str(int(engine_process))}
    if engine_process:
        env["OMP_NUM_THREADS"] = "1"
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tinypaged",
            "serve",
            str(model_dir),
            "--port",
            str(port),
            "--served-model-name",
            "tiny",
            "--shutdown-timeout",
            "60",
            *ENGINE_FLAGS,
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, "".join(log)
            assert time.monotonic() < deadline, "".join(log)
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        r = httpx.post(
            url + "/v1/completions",
            json={"model": "tiny", "prompt": "Hello", "max_tokens": 4},
            timeout=30,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        # SIGTERM while a stream is in flight: within --shutdown-timeout the stream still
        # finishes, then the process exits.
        body = {
            "prompt": "Hi",
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][len("data: ") :])["usage"]["completion_tokens"] == 200
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=5)
    text = "".join(log)
    for needed in (
        "model:",
        "device: cpu",
        "dtype: float32",
        "KV cache: 64 blocks x 16 tokens",
        f"http://127.0.0.1:{port}/v1",
    ):
        assert needed in text, text
    assert "Traceback" not in text, text


def test_generate_prints_the_greedy_completion(model_dir, llm):
    want = (
        llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
        .outputs[0]
        .text
    )
    r = tinypaged("generate", str(model_dir), "Hello there", "--max-tokens", "8", *ENGINE_FLAGS)
    assert r.returncode == 0, r.stderr
    assert r.stdout == want + "\n"


def test_chat_streams_and_keeps_history(model_dir, llm):
    params = SamplingParams(temperature=0, max_tokens=6)
    first = [{"role": "user", "content": "Hi"}]
    reply1 = llm.chat(first, params, use_tqdm=False)[0].outputs[0].text
    second = first + [{"role": "assistant", "content": reply1}, {"role": "user", "content": "More"}]
    reply2 = llm.chat(second, params, use_tqdm=False)[0].outputs[0].text
    r = tinypaged(
        "chat", str(model_dir), "--max-tokens", "6", *ENGINE_FLAGS, input="Hi\nMore\n/exit\n"
    )
    assert r.returncode == 0, r.stderr
    assert reply1 + "\n" in r.stdout and reply2 + "\n" in r.stdout
    assert r.stdout.index(reply1) < r.stdout.rindex(reply2)


@pytest.mark.parametrize(
    "args,words",
    [
        (["serve", "--bogus-flag"], ["unrecognized arguments", "--bogus-flag"]),
        (["serve", "--port", "abc"], ["--port", "invalid int"]),
        (["generate"], ["required"]),
        (["serve", "--quantization", "bitsandbytes"], ["--quantization", "invalid choice"]),
        (["generate", "hi", "--kernels", "cuda"], ["--kernels", "invalid choice"]),
    ],
)
def test_bad_flag_is_one_line(args, words):
    r = tinypaged(*args, timeout=60)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    for word in words:
        assert word in r.stderr


def test_unloadable_model_is_one_line(tmp_path, model_dir):
    for args in (
        ["serve", str(tmp_path / "missing")],
        ["generate", str(model_dir), "hi", "--block-size", "3"],
        ["serve", str(model_dir), "--chat-template", str(tmp_path / "none.jinja")],
    ):
        r = tinypaged(*args)
        assert r.returncode == 1, r.stderr
        lines = [line for line in r.stderr.splitlines() if line.startswith("tinypaged: error:")]
        assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr


def test_download_and_forwarding(capsys, monkeypatch):
    from tinypaged.models.default_model import ensure_default_model

    assert main(["download"]) == 0
    assert capsys.readouterr().out.strip() == str(ensure_default_model())
    seen = []
    import tinypaged.quantization.quantize

    quantize = tinypaged.quantization.quantize
    monkeypatch.setattr(quantize, "main", lambda argv: seen.append(argv) or 0)
    assert main(["quantize", "in", "--out", "x"]) == 0
    assert seen == [["in", "--out", "x"]]


def test_serve_reads_the_api_key_from_the_environment(model_dir, monkeypatch):
    import uvicorn

    seen = {}

    def fake_run(self) -> None:  # stands in for the blocking server loop
        seen["key"] = self.config.app.state.server.api_key
        seen["names"] = self.config.app.state.server.model_names

    monkeypatch.setattr(uvicorn.Server, "run", fake_run)
    monkeypatch.setenv("TINYPAGED_API_KEY", "from-env")
    argv = ["serve", str(model_dir), "--served-model-name", "a", "b", *ENGINE_FLAGS]
    assert main(argv) == 1  # the fake loop never started a server
    assert seen == {"key": "from-env", "names": ["a", "b"]}
    assert main([*argv, "--api-key", "from-flag"]) == 1
    assert seen["key"] == "from-flag"


def test_kernels_flag_reaches_the_engine(model_dir):
    pytest.importorskip("triton")
    # the one combination the engine refuses shows that --kernels got there
    r = tinypaged("generate", str(model_dir), "hi", "--kernels", "triton", "--dtype", "bfloat16")
    assert r.returncode == 1, r.stderr
    assert "tinypaged: error:" in r.stderr and "Triton interpreter" in r.stderr, r.stderr
