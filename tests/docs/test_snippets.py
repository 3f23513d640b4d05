"""Every code block of README.md and docs/ runs as written (tests/helpers/snippets.py says how
blocks are found, marked and checked).

In CI: every block's syntax and CLI flags are checked; the python blocks, `tinypaged generate`
commands and `python -m` modules run in one process (the default model loads once per engine
configuration); the README's `tinypaged serve` starts once, on a free port instead of 8000, and
its curl and openai blocks run against it, then examples/openai_client.py (one default-model
server for both). With TINYPAGED_LONG_TESTS=1 also: the blocks marked `long`, the pytest
commands of the guide (the suite runs them in CI anyway) and the `TRITON_INTERPRET=1 python -c`
kernel blocks. Blocks marked `skip` are listed with their reason.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest
from helpers import snippets
from helpers.server import free_port

ROOT = snippets.ROOT
BLOCKS = snippets.blocks()
LONG = os.environ.get("TINYPAGED_LONG_TESTS") == "1"
CI_KINDS = {"tinypaged", "module", "curl", "pip"}  # pip: CI's own install step, not rerun
LONG_KINDS = {"pytest", "python-c", "script"}


def runs_now(block: snippets.Block) -> bool:
    return block.mark is None or (block.mark == "long" and LONG)


def test_every_block_parses_and_skips_say_why(capsys):
    assert len(BLOCKS) >= 20, "the markdown files were not found"
    for block in BLOCKS:
        snippets.check_syntax(block)
        if block.mark is None and block.lang != "python":
            kinds = {snippets.kind(c) for c in snippets.commands(block.code)}
            assert kinds <= CI_KINDS | LONG_KINDS, (block.where, kinds)
    skipped = [b for b in BLOCKS if b.mark == "skip"]
    with capsys.disabled():
        print("\nREADME/docs blocks not run here:")
        for b in skipped:
            print(f"  {b.where}: {b.reason}")
    assert all(b.reason.strip() for b in skipped)
    # the fixes of issue 36 stay fixed
    readme = {b.line: b for b in BLOCKS if b.path == "README.md"}
    stream = next(b for b in readme.values() if "stream=True" in b.code)
    assert "max_tokens" in stream.code


def test_a_bad_flag_fails_the_check():
    block = snippets.Block("x.md", 1, "bash", "tinypaged generate --max-tokns 8 hi\n", None, None)
    with pytest.raises(SystemExit):
        snippets.check_syntax(block)
    with pytest.raises(SyntaxError):
        snippets.check_syntax(snippets.Block("x.md", 1, "python", "async for x in y: pass\n",
                                             None, None))


def offline_jobs() -> list[dict]:
    jobs = []
    for block in BLOCKS:
        if not runs_now(block) or block.uses_server:
            continue
        if block.lang == "python":
            jobs.append({"id": block.where, "kind": "python", "code": block.code})
            continue
        for i, cmd in enumerate(snippets.commands(block.code)):
            k, job_id = snippets.kind(cmd), f"{block.where}#{i}"
            if k == "tinypaged" and snippets.cli_argv(cmd)[0] == "generate":
                jobs.append({"id": job_id, "kind": "cli", "argv": snippets.cli_argv(cmd)})
            elif k == "module":
                jobs.append({"id": job_id, "kind": "module", "module": cmd.argv[2]})
    return jobs


def test_offline_blocks_run(tmp_path):
    jobs = offline_jobs()
    assert any(j["kind"] == "python" for j in jobs) and any(j["kind"] == "cli" for j in jobs)
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    r = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "helpers" / "snippets.py"),
         str(tmp_path / "jobs.json"), str(tmp_path / "results.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=900, check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    failed = {k: v["error"] for k, v in results.items() if not v["ok"]}
    assert not failed, "\n\n".join(f"{k}:\n{v}" for k, v in failed.items())
    for job in jobs:
        assert results[job["id"]]["out"].strip(), f"{job['id']} printed nothing"


def shell_env(cmd: snippets.Command) -> dict:
    return {**os.environ, **cmd.env, "PYTHONPATH": str(ROOT)}


@pytest.mark.skipif(not LONG, reason="TINYPAGED_LONG_TESTS=1: the guide's pytest and kernel "
                    "commands (the suite runs those tests in CI anyway)")
def test_long_commands_run():
    for block in BLOCKS:
        if not runs_now(block) or block.lang == "python":
            continue
        for cmd in snippets.commands(block.code):
            k = snippets.kind(cmd)
            if k not in LONG_KINDS or (k == "pytest" and not any(
                    a.startswith("tests/") for a in cmd.argv)):  # bare pytest: the suite itself
                continue
            argv = [sys.executable, *cmd.argv[1:]]
            r = subprocess.run(argv, cwd=ROOT, env=shell_env(cmd), capture_output=True,
                               text=True, timeout=900, check=False)
            assert r.returncode == 0, f"{block.where}: {cmd.argv}\n{r.stdout[-2000:]}" \
                f"{r.stderr[-2000:]}"


@pytest.fixture(scope="module")
def server_url():
    serve = next(
        c for b in BLOCKS if b.mark is None
        for c in snippets.commands(b.code)
        if snippets.kind(c) == "tinypaged" and snippets.cli_argv(c)[0] == "serve"
    )
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tinypaged", *snippets.cli_argv(serve), "--port", str(port)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_server_blocks_run(server_url):
    ran = 0
    for block in BLOCKS:
        if not runs_now(block) or not block.uses_server:
            continue
        code = block.code.replace(snippets.SERVER_URL, server_url)
        if block.lang == "python":
            out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                                 text=True, timeout=600, check=False)
            assert out.returncode == 0, f"{block.where}\n{out.stderr[-3000:]}"
            assert out.stdout.strip(), block.where
            ran += 1
            continue
        for cmd in snippets.commands(code):
            if snippets.kind(cmd) != "curl":
                continue  # the serve commands: one server, started above
            assert shutil.which("curl"), "curl is not installed"
            out = subprocess.run(["curl", "-sS", *cmd.argv[1:]], capture_output=True,
                                 text=True, timeout=600, check=False)
            assert out.returncode == 0, out.stderr
            assert json.loads(out.stdout)["choices"][0]["message"]["content"], out.stdout
            ran += 1
    assert ran >= 3  # curl, the streamed openai client, the offline-ready tool call



def test_openai_client_example(server_url):
    """examples/openai_client.py (its docstring: run it against `tinypaged serve`) on the
    README's server, after the README's own blocks (their sampled requests come first, as on a
    fresh server)."""
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "openai_client.py"),
                        server_url + "/v1"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    completion = re.search(r"^completion: (.+)$", r.stdout, re.MULTILINE)
    assert completion and completion.group(1).strip(), r.stdout
    chat = re.search(r"^chat: (.*)\n\[(\d+) tokens\]$", r.stdout, re.MULTILINE | re.DOTALL)
    assert chat and 1 <= int(chat.group(2)) <= 64, r.stdout
