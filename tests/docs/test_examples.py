"""Every script in examples/ runs on the default model and prints what it promises.
examples/openai_client.py talks to the README's `tinypaged serve`: test_snippets.py runs it
against the server it starts for the README's blocks (one default-model server for both)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

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
