"""Every script in examples/ runs on the default model and prints what it promises.
The OpenAI-client example talks to a `tinypaged serve` started here on a free port."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
from helpers.server import free_port

ROOT = Path(__file__).resolve().parents[2]


def run_example(name: str, *args: str) -> str:
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_offline_batch():
    lines = run_example("offline_batch.py").splitlines()
    prompts = [
        "The capital of France is",
        "The three primary colors are",
        "A good name for a pet cat is",
        "def fibonacci(n):",
    ]
    assert len(lines) == len(prompts)
    for line, prompt in zip(lines, prompts, strict=True):
        assert line.startswith((f"{prompt!r} -> '", f'{prompt!r} -> "'))
        assert len(line) > len(repr(prompt)) + 6  # some text came back


def test_async_streaming():
    out = run_example("async_streaming.py")
    m = re.search(r"\n\[finish_reason=(stop|length), tokens=(\d+)\]\n$", out)
    assert m, out
    assert 1 <= int(m.group(2)) <= 48
    if m.group(1) == "length":
        assert out[: m.start()].strip()


def test_openai_client_against_tinypaged_serve():
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tinypaged",
            "serve",
            "--port",
            str(port),
            "--num-kv-blocks",
            "64",
            "--max-model-len",
            "512",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, server.stderr.read()
            assert time.monotonic() < deadline
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        out = run_example("openai_client.py", url + "/v1")
    finally:
        server.terminate()
        server.wait(timeout=60)
    completion = re.search(r"^completion: (.+)$", out, re.MULTILINE)
    assert completion and completion.group(1).strip(), out
    chat = re.search(r"^chat: (.*)\n\[(\d+) tokens\]$", out, re.MULTILINE | re.DOTALL)
    assert chat and 1 <= int(chat.group(2)) <= 64, out
