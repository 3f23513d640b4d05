"""host/: the install hint for a missing optional package, and torch's CPU threads."""

from __future__ import annotations

import pickle
import sys

import pytest
import torch

from tinypaged.host import packages, threads


def test_require_names_the_install_command_of_this_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(packages.MissingPackageError, match=r"pip install 'gguf'") as info:
        packages.require("gguf")
    assert info.value.name == "gguf"
    again = pickle.loads(pickle.dumps(info.value))  # crosses the engine process
    assert type(again) is packages.MissingPackageError and str(again) == str(info.value)
    assert any("gguf" in line for line in packages.missing_optional())
    monkeypatch.setattr(packages, "from_checkout", lambda: False)  # installed from a wheel
    assert packages.install_hint("xgrammar") == "pip install 'tinypaged[structured]'"
    assert packages.install_hint("gguf") == "pip install 'tinypaged[gguf]'"


def test_require_names_the_error_of_an_installed_package_that_fails(monkeypatch, tmp_path):
    # What a wheel installed without its dependencies gives: the package is found, its import
    # fails on another module. The message says so, with that module's name.
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "__init__.py").write_text("import tinypaged_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "gguf", raising=False)
    with pytest.raises(packages.MissingPackageError) as info:
        packages.require("gguf")
    message = str(info.value)
    assert "installed but failed to import" in message and "pip install 'gguf'" in message
    assert "No module named 'tinypaged_no_such_dependency'" in message
    assert info.value.name == "gguf"


def test_checkout_detection():
    assert packages.from_checkout()  # the tests run from the source tree


def test_cpu_threads_default_and_overrides(monkeypatch):
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads.usable_cores() == 4 and threads.default_cpu_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert threads.default_cpu_threads() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")
    assert threads.default_cpu_threads() == 3
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert threads.default_cpu_threads() == 1


def test_apply_cpu_threads_sets_torch_only_where_it_should():
    before = torch.get_num_threads()
    try:
        assert threads.apply_cpu_threads(None, "cuda") is None
        assert torch.get_num_threads() == before
        assert threads.apply_cpu_threads(1, "cpu") == 1 and torch.get_num_threads() == 1
        assert threads.apply_cpu_threads(2, "cuda") == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_engine_config_checks_cpu_threads():
    from tinypaged.config import EngineConfig

    assert EngineConfig(cpu_threads=3).cpu_threads == 3
    with pytest.raises(ValueError, match="cpu_threads must be a positive integer"):
        EngineConfig(cpu_threads=0)
