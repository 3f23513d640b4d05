"""Fixtures shared by several test files."""

from __future__ import annotations

import pytest


@pytest.fixture
def unreachable_hub(monkeypatch, tmp_path):
    """A hub endpoint nothing listens on, an empty HF cache, no proxy, offline mode off."""
    from huggingface_hub import constants

    for var in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # discard port: refused
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    return tmp_path / "hf-cache"
