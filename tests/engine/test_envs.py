"""tinypaged/envs.py: every TINYPAGED_* variable the package mentions is declared there once, read
when used (not at import), parsed as before, and listed in README's "Environment variables"."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tinypaged import envs

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tinypaged"
NAME = re.compile(r"TINYPAGED_[A-Z0-9_]*[A-Z0-9]")


@pytest.fixture
def clean_env(monkeypatch):
    for name in envs.ENVIRONMENT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def sources() -> dict[Path, str]:
    return {path: path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}


def test_every_name_the_package_mentions_is_declared():
    mentioned = {name: path for path, text in sources().items() for name in NAME.findall(text)}
    undeclared = {n: str(p.relative_to(ROOT)) for n, p in mentioned.items()
                  if n not in envs.ENVIRONMENT_VARIABLES}
    assert not undeclared, f"declare these in tinypaged/envs.py: {undeclared}"


def test_only_envs_reads_them_and_each_is_read_somewhere():
    direct = re.compile(r"""(environ\b[^\n]{0,12}|getenv\()\s*\(?\s*\[?\s*["']TINYPAGED_"""
                        r"""|["']TINYPAGED_\w+["']\s+(not\s+)?in\s+(os\.)?environ""")
    readers = [str(p.relative_to(ROOT)) for p, text in sources().items()
               if p.name != "envs.py" and direct.search(text)]
    assert not readers, f"read these through tinypaged.envs instead: {readers}"
    used = "".join(text for p, text in sources().items() if p.name != "envs.py")
    unused = [n for n in envs.ENVIRONMENT_VARIABLES if f"envs.{n}" not in used]
    assert not unused, f"declared but never read: {unused}"


def test_defaults_when_unset(clean_env):
    for name, var in envs.ENVIRONMENT_VARIABLES.items():
        assert getattr(envs, name) == var.default, name
    assert (envs.TINYPAGED_KERNELS, envs.TINYPAGED_DENSE_GEMV, envs.TINYPAGED_GC_DEBUG) == (
        "auto", True, False)


@pytest.mark.parametrize(("name", "text", "value"), [
    ("TINYPAGED_KERNELS", "triton", "triton"),
    ("TINYPAGED_KERNELS", "fast", "fast"),  # EngineConfig refuses it, naming the variable
    ("TINYPAGED_ENABLE_MULTIPROCESSING", "1", True),
    ("TINYPAGED_ENABLE_MULTIPROCESSING", "0", False),
    ("TINYPAGED_WORKER_MULTIPROC_METHOD", "spawn", "spawn"),
    ("TINYPAGED_WORKER_MULTIPROC_METHOD", "", None),
    ("TINYPAGED_API_KEY", "sk-1", "sk-1"),
    ("TINYPAGED_API_KEY", "", None),
    ("TINYPAGED_CACHE", "", None),
    ("TINYPAGED_GC_DEBUG", "1", True),
    ("TINYPAGED_GC_DEBUG", "true", False),  # only "1" turns the switch on, as before
    ("TINYPAGED_DENSE_GEMV", "0", False),
    ("TINYPAGED_DENSE_GEMV", "no", True),  # only "0" turns it off
    ("TINYPAGED_PIECEWISE_UNCHECKED", "1", True),
    ("TINYPAGED_SPEC_DECODE_ATTENTION", "multi_query", "multi_query"),
    ("TINYPAGED_SPEC_DECODE_ATTENTION", "0", "varlen"),  # the on/off switch it was
    ("TINYPAGED_SPEC_DECODE_ATTENTION", "1", "decodes"),
    ("TINYPAGED_PIECEWISE_UNCHECKED", "0", False),
])
def test_parsing_is_read_at_each_lookup(clean_env, name, text, value):
    clean_env.setenv(name, text)  # after `import envs`: the lookup must still see it
    assert getattr(envs, name) == value
    clean_env.delenv(name)
    assert getattr(envs, name) == envs.ENVIRONMENT_VARIABLES[name].default


def test_cache_expands_the_home_directory(clean_env):
    clean_env.setenv("HOME", "/home/someone")
    clean_env.setenv("TINYPAGED_CACHE", "~/models")
    assert envs.TINYPAGED_CACHE == Path("/home/someone/models")

    from tinypaged.models.default_model import default_model_dir

    assert default_model_dir() == Path("/home/someone/models/models/SmolLM2-135M-Instruct")


@pytest.mark.parametrize(("name", "text", "message"), [
    ("TINYPAGED_ENABLE_MULTIPROCESSING", "yes",
     "TINYPAGED_ENABLE_MULTIPROCESSING must be 0 or 1, got 'yes'"),
    ("TINYPAGED_ENABLE_MULTIPROCESSING", "", "must be 0 or 1, got ''"),
    ("TINYPAGED_WORKER_MULTIPROC_METHOD", "forkserver",
     "TINYPAGED_WORKER_MULTIPROC_METHOD must be 'fork' or 'spawn', got 'forkserver'"),
    ("TINYPAGED_SPEC_DECODE_ATTENTION", "split",
     "TINYPAGED_SPEC_DECODE_ATTENTION must be one of auto, multi_query, decodes, varlen, "
     "got 'split'"),
])
def test_a_value_outside_the_choices_names_the_variable(clean_env, name, text, message):
    clean_env.setenv(name, text)
    with pytest.raises(ValueError, match=re.escape(message)):
        getattr(envs, name)


def test_the_start_method_refuses_a_bad_value(clean_env):
    from tinypaged.worker.tp_worker import start_method

    clean_env.setenv("TINYPAGED_WORKER_MULTIPROC_METHOD", "thread")
    with pytest.raises(ValueError, match="'fork' or 'spawn', got 'thread'"):
        start_method()
    clean_env.setenv("TINYPAGED_WORKER_MULTIPROC_METHOD", "fork")
    assert start_method() == "fork"


def test_engine_config_names_the_variable_a_bad_kernels_value_came_from(clean_env):
    from tinypaged.config import EngineConfig

    clean_env.setenv("TINYPAGED_KERNELS", "torch")
    assert EngineConfig().kernels == "torch"
    clean_env.setenv("TINYPAGED_KERNELS", "cuda")
    with pytest.raises(ValueError, match=r"got 'cuda' \(from \$TINYPAGED_KERNELS\)$"):
        EngineConfig()
    with pytest.raises(ValueError, match="got 'fast'$"):  # an argument: no mention of the env
        EngineConfig(kernels="fast")


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="TINYPAGED_NOPE"):
        envs.TINYPAGED_NOPE  # noqa: B018
    assert "TINYPAGED_CACHE" in dir(envs)


def test_readme_lists_exactly_the_declared_variables():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Environment variables\n", 1)[1].split("\n## ", 1)[0]
    listed = [line for line in section.splitlines() if line.startswith("- `TINYPAGED_")]
    assert [NAME.search(line).group() for line in listed] == list(envs.ENVIRONMENT_VARIABLES)
    for line, (name, var) in zip(listed, envs.ENVIRONMENT_VARIABLES.items()):
        assert line == f"- `{name}` ({var.type}, default `{var.default!r}`): {var.meaning}"
