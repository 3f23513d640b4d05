"""The code blocks of README.md and docs/**/*.md, and how tests/docs/test_snippets.py runs them.

A block runs as written unless the markdown says otherwise in an HTML comment on the line
right before it (invisible on GitHub):

    <!-- snippet: skip (needs a GPU) -->     never run here; the reason is listed by the test
    <!-- snippet: long (minutes on a CPU) -->    run with TINYPAGED_LONG_TESTS=1 only

Every block, skipped or not, is checked in CI at least for its syntax: python blocks compile,
each `tinypaged ...` command parses with the CLI's own parser, each pytest command names files
that exist, each script exists, `pip install` names extras pyproject.toml has.

Running it as `python tests/helpers/snippets.py JOBS.json RESULTS.json` executes jobs (python
blocks, `tinypaged generate` commands, `python -m MODULE`) one after the other in this one
process, so the default model loads once: `LLM(...)` is built once per engine configuration
(the README's `LLM()` and `tinypaged generate` without engine flags share one engine).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import re
import shlex
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"<!--\s*snippet:\s*(skip|long)\s*\(([^)]+)\)\s*-->")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SERVER_URL = "http://127.0.0.1:8000"


@dataclasses.dataclass
class Block:
    path: str  # relative to the repository root
    line: int  # of the opening fence
    lang: str
    code: str
    mark: str | None  # None, "skip" or "long"
    reason: str | None

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def uses_server(self) -> bool:
        return "127.0.0.1:8000" in self.code


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks() -> list[Block]:
    found = []
    for path in markdown_files():
        text = path.read_text()
        for m in FENCE.finditer(text):
            lang = m.group(1)
            if lang not in ("bash", "python", "sh", "console"):
                continue  # diagrams and file trees
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            mark = MARKER.search(before)
            found.append(Block(str(path.relative_to(ROOT)), text[: m.start()].count("\n") + 1,
                               lang, m.group(2), mark and mark.group(1), mark and mark.group(2)))
    return found


@dataclasses.dataclass
class Command:
    env: dict[str, str]
    argv: list[str]
    background: bool


def commands(code: str) -> list[Command]:
    """The shell commands of a bash block: continuation lines joined, quotes kept across lines,
    comments dropped, split at `&&`, `;` and a trailing `&`."""
    logical, pending = [], ""
    for line in code.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the command goes on on the next line
            continue
        logical.append(pending)
        pending = ""
    assert not pending, f"unfinished shell command: {pending!r}"
    out = []
    for line in logical:
        lex = shlex.shlex(line, posix=True, punctuation_chars="&;|")
        lex.whitespace_split = True
        lex.commenters = "#"
        words, current = list(lex), []
        for i, word in enumerate(words + [";"]):
            if word in ("&&", ";", "&", "|", "||"):
                if word == "|":
                    raise AssertionError(f"pipes are not run by the snippet test: {line!r}")
                if current:
                    env = {}
                    while current and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", current[0]):
                        key, _, value = current.pop(0).partition("=")
                        env[key] = value
                    out.append(Command(env, current, word == "&" and i < len(words)))
                current = []
            else:
                current.append(word)
    return out


def kind(cmd: Command) -> str:
    a = cmd.argv
    if a[0] == "tinypaged" or a[:3] == ["python", "-m", "tinypaged"]:
        return "tinypaged"
    if a[:3] == ["python", "-m", "pytest"]:
        return "pytest"
    if a[:2] == ["python", "-m"]:
        return "module"
    if a[:2] == ["python", "-c"]:
        return "python-c"
    if a[0] == "python":
        return "script"
    return a[0]  # pip, curl, git, cd, ...


def cli_argv(cmd: Command) -> list[str]:
    return cmd.argv[1:] if cmd.argv[0] == "tinypaged" else cmd.argv[3:]


class _Parsed(Exception):
    pass


def check_cli_args(argv: list[str]) -> None:
    """Parse `tinypaged ARGV` with the CLI's own parsers (bench and quantize included) without
    running anything; argparse's SystemExit(2) on a bad flag propagates."""
    from tinypaged.entrypoints import cli

    real = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        ns = real(self, args, namespace)
        if getattr(ns, "command", None) not in ("bench", "quantize"):
            raise _Parsed()
        return ns

    argparse.ArgumentParser.parse_args = parse_only
    try:
        cli.main(argv)
    except _Parsed:
        return
    finally:
        argparse.ArgumentParser.parse_args = real
    raise AssertionError(f"tinypaged {' '.join(argv)} ran instead of stopping after parsing")


def optional_dependencies() -> set[str]:
    """The extras pyproject.toml declares (no tomllib on Python 3.10)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([\w-]+)\s*=", section, re.M))


def check_syntax(block: Block) -> None:
    """The CI check every block gets: it compiles, its commands parse, its files exist."""
    if block.lang == "python":
        compile(block.code, block.where, "exec")
        return
    extras = optional_dependencies()
    for cmd in commands(block.code):
        k = kind(cmd)
        if k == "tinypaged":
            check_cli_args(cli_argv(cmd))
        elif k == "pytest":
            for arg in cmd.argv[3:]:
                if arg.startswith("tests/"):
                    assert (ROOT / arg.split("::")[0]).exists(), f"{block.where}: no {arg}"
        elif k == "python-c":
            compile(cmd.argv[2], block.where, "exec")
        elif k == "script":
            assert (ROOT / cmd.argv[1]).is_file(), f"{block.where}: no {cmd.argv[1]}"
        elif k == "module":
            name = cmd.argv[2]
            assert (ROOT / (name.replace(".", "/") + ".py")).is_file(), f"no module {name}"
        elif k == "pip":
            for arg in cmd.argv:
                for extra in re.findall(r"\[([\w,-]+)\]", arg):
                    assert set(extra.split(",")) <= set(extras), f"{block.where}: {arg}"
        elif k == "curl":
            assert any(a.startswith(SERVER_URL) for a in cmd.argv), block.where
        elif block.mark != "skip":
            raise AssertionError(f"{block.where}: the snippet test cannot run {cmd.argv[0]!r}; "
                                 "mark the block <!-- snippet: skip (why) -->")


# ------------------------------------------------------------------------------- the runner


def _shared_llm_factory():
    """LLM(...) built once per engine configuration (module docstring)."""
    import tinypaged.engine.llm as llm_module
    from tinypaged.config import EngineConfig

    real, built = llm_module.LLM, {}

    def LLM(model=None, **kwargs):  # noqa: N802 - stands in for the class
        key = repr(EngineConfig.from_kwargs(model=model, **kwargs))
        if key not in built:
            built[key] = real(model, **kwargs)
        return built[key]

    llm_module.LLM = LLM


def run_jobs(jobs: list[dict]) -> dict:
    import runpy

    from tinypaged.entrypoints import cli

    _shared_llm_factory()
    results = {}
    for job in jobs:
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                if job["kind"] == "python":
                    exec(compile(job["code"], job["id"], "exec"), {"__name__": "__main__"})
                elif job["kind"] == "cli":
                    rc = cli.main(job["argv"])
                    assert rc == 0, f"exit status {rc}"
                else:  # module
                    runpy.run_module(job["module"], run_name="__main__", alter_sys=True)
            results[job["id"]] = {"ok": True, "out": out.getvalue()}
        except BaseException:  # noqa: BLE001 - SystemExit too: each job reports its own failure
            results[job["id"]] = {"ok": False, "out": out.getvalue(),
                                  "error": traceback.format_exc()[-3000:]}
    return results


if __name__ == "__main__":
    import os

    sys.path.insert(0, str(ROOT))
    jobs = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(run_jobs(jobs)))
    sys.stdout.flush()
    os._exit(0)  # engines' threads need no orderly goodbye
