"""Optional packages: which are installed, and the install command that works for this install.

A feature that needs a package the user may not have calls `require(...)`; when it is missing
the caller gets `MissingPackageError` (an ImportError) whose message names the feature and one
`pip install` command. The server answers it with a 400 naming the package (never a 500), and
warns at start-up for each optional package that is missing (`missing_optional()`).

The command depends on how tinypaged was installed: from a wheel, the extra
(`pip install 'tinypaged[structured]'`) works; from a checkout (`pip install -e .` or the source
tree on `sys.path`) pip cannot resolve `tinypaged[...]` from PyPI, so the hint names the package
itself (`pip install 'xgrammar>=0.2.9'`), which works for both.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

# package -> (pip requirement, the extra of pyproject.toml that adds it, what needs it)
OPTIONAL = {
    "xgrammar": ("xgrammar>=0.2.9", "structured",
                 "structured output (response_format, structured_outputs, guided_*, "
                 "tool_choice required or named)"),
    "gguf": ("gguf", "gguf", "GGUF files (the built-in default model included)"),
}


class MissingPackageError(ImportError):
    """An optional package a feature needs is not installed; the message says how to add it.

    Built from the message alone (by `require`), so it pickles across the engine process."""

    @property
    def package(self) -> str | None:
        return self.name


def from_checkout() -> bool:
    """Whether tinypaged runs from a source tree (an editable install or a clone on sys.path)."""
    return (Path(__file__).resolve().parents[2] / "pyproject.toml").is_file()


def install_hint(package: str) -> str:
    """The one install command that adds `package` to this install."""
    requirement, extra, _ = OPTIONAL[package]
    if from_checkout():
        return f"pip install '{requirement}'"
    return f"pip install 'tinypaged[{extra}]'"


def missing_message(package: str) -> str:
    return f"{OPTIONAL[package][2]} needs the {package} package, which is not installed: " \
        f"{install_hint(package)}"


def require(package: str):
    """Import and return `package`, or raise MissingPackageError naming the install command.
    A package that is there but fails to import (one of its own dependencies missing) is named
    as such, with the import's error: reinstalling it with pip brings what it lacks."""
    try:
        return importlib.import_module(package)
    except ImportError as exc:
        message = missing_message(package)
        if sys.modules.get(package, 0) is not None and is_installed(package):
            message = (f"{OPTIONAL[package][2]} needs the {package} package, which is installed "
                       f"but failed to import ({type(exc).__name__}: {exc}): "
                       f"{install_hint(package)}")
        raise MissingPackageError(message, name=package) from None


def is_installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def missing_optional() -> list[str]:
    """One line per optional package that is not installed: what it enables, how to add it."""
    return [missing_message(p) for p in OPTIONAL if not is_installed(p)]
