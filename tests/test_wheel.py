"""The built wheel carries the whole package: every module, the data files, the CLI entry point.

Built the way `python -m build` builds it (an sdist first, then the wheel from the unpacked
sdist, so a file the sdist leaves out is missing here too), with setuptools' own build backend
in a subprocess, from a copy of the package, so the checkout gets no build/ or egg-info.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (setuptools' backend rewrites sys.argv while it runs: read the arguments first)
SDIST = """
import sys, tarfile
from pathlib import Path
from setuptools import build_meta
dist, unpacked = sys.argv[1:3]
with tarfile.open(Path(dist) / build_meta.build_sdist(dist)) as tar:
    tar.extractall(unpacked)
"""
WHEEL = """
import sys
from setuptools import build_meta
dist = sys.argv[1]
print(build_meta.build_wheel(dist))
"""


def package_files(root: Path) -> set[str]:
    return {
        p.relative_to(root).as_posix()
        for p in (root / "tinypaged").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_wheel_carries_every_module_the_data_and_the_cli(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "tinypaged", src / "tinypaged",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    dist, unpacked = tmp_path / "dist", tmp_path / "unpacked"
    run = dict(cwd=src, check=True, capture_output=True)
    subprocess.run([sys.executable, "-c", SDIST, str(dist), str(unpacked)], **run)
    (sdist_dir,) = unpacked.iterdir()
    out = subprocess.run([sys.executable, "-c", WHEEL, str(dist)], **{**run, "cwd": sdist_dir})
    wheel = zipfile.ZipFile(dist / out.stdout.decode().strip().splitlines()[-1])
    names = set(wheel.namelist())

    expected = package_files(ROOT)
    assert "tinypaged/data/calibration.txt" in expected  # the data files are part of the check
    assert "tinypaged/kernels/launcher/launch.py" in expected
    assert expected - names == set(), "files the wheel lacks"
    info = {n for n in names if ".dist-info/" in n}
    assert names - expected - info == set(), "files the wheel has that the package does not"

    (entry_points,) = [n for n in info if n.endswith("entry_points.txt")]
    assert "tinypaged = tinypaged.entrypoints.cli:main" in wheel.read(entry_points).decode()
    with tarfile.open(next(dist.glob("*.tar.gz"))) as tar:
        assert any(m.name.endswith("tinypaged/data/heldout.txt") for m in tar.getmembers())
