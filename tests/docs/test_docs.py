"""The guide's scripts: docs/walkthrough.py runs as the guide says; benchmarks/kernel_bench.py
--json and docs/plots.py agree on the format (rows recorded on the CPU, torch ops timed for real
and ceilings measured the same way, become one PNG per kernel family)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_walkthrough_shows_a_prefix_hit_and_the_flat_batch():
    result = subprocess.run([sys.executable, "-m", "docs.walkthrough"], cwd=ROOT, text=True,
                            capture_output=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    step1 = lines[lines.index("--- step 1") + 1 : lines.index("--- step 2")]
    # b's first block is a's: only its last 3 prompt tokens run, and it shares block 0
    assert "b: positions [4, 7) blocks [0, 3] sample=True" in step1
    assert "  slot_mapping     [8, 9, 12, 13, 14]" in step1


def load_script(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpu_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - start)


def test_kernel_json_becomes_one_png_per_family(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    pytest.importorskip("triton")  # benchmarks/kernel_bench.py imports triton.testing
    bench = load_script(ROOT / "benchmarks" / "kernel_bench.py")
    plots = load_script(ROOT / "docs" / "plots.py")
    monkeypatch.setattr(bench, "bench_ms", cpu_ms)
    src = torch.randn(2**20)
    dst = torch.empty_like(src)
    bench.CEILING["GB/s"] = 2 * 4 * src.numel() / cpu_ms(lambda: dst.copy_(src)) / 1e6
    a = torch.randn(256, 256)
    bench.CEILING["TFLOP/s"] = 2 * 256**3 / cpu_ms(lambda: a @ a) / 1e9

    x, w = torch.randn(512, 256), torch.randn(256)
    bench.record("rms_norm", "512x256", "torch reference",
                 lambda: bench.norm.rms_norm_ref(x, w, 1e-6), bytes_moved=8 * x.numel(),
                 flops=4 * x.numel())
    bench.record("store_kv", "T512", "torch reference", lambda: dst.copy_(src),
                 bytes_moved=8 * src.numel())  # no arithmetic: a bar, no roofline point

    def unsupported():
        raise NotImplementedError("no such backend here")

    bench.record("prefill dense", "B1 L256", "SDPA nowhere", unsupported, bytes_moved=1.0,
                 flops=1.0, compute_bound=True)
    bench.record("prefill dense", "B1 L256", "a @ a", lambda: a @ a, bytes_moved=3 * 4 * a.numel(),
                 flops=2 * 256**3, compute_bound=True)
    bench.record("prefill tune", "B1 L256", "{}", lambda: a @ a, bytes_moved=1.0, flops=1.0,
                 compute_bound=True)
    path = tmp_path / "run.json"
    bench.write_json(str(path), {"date": "today", "device": "cpu", "commit": "x", "torch": "t"})

    run = json.loads(path.read_text())
    assert [r["us"] is None for r in run["rows"]] == [False, False, True, False, False]
    assert run["rows"][0]["pct"] > 0 and run["ceilings"]["copy_GB_s"] > 0

    written = plots.main([str(path), "--out", str(tmp_path / "png")])
    names = sorted(p.name for p in written)
    assert names == ["kv_cache.png", "norm_activation.png", "prefill_attention.png"]
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_reject_a_file_that_is_not_a_kernel_run(tmp_path):
    pytest.importorskip("matplotlib")
    plots = load_script(ROOT / "docs" / "plots.py")
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"requests": 256}))
    with pytest.raises(SystemExit, match="not a benchmarks/kernel_bench.py --json file"):
        plots.main([str(path)])


def test_kernels_gguf_check_drives_every_type_m_and_shape(monkeypatch):
    """benchmarks/kernel_bench.py --gguf checks through benchmarks/gguf_gemv.py's checks(): the call
    between the two scripts, run on the CPU with the GPU work stubbed (it broke on the GPU once,
    where nothing else runs it)."""
    pytest.importorskip("triton")  # benchmarks/kernel_bench.py imports triton.testing
    pytest.importorskip("gguf")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    bench = load_script(ROOT / "benchmarks" / "kernel_bench.py")
    import gguf_gemv

    seen = []
    monkeypatch.setattr(gguf_gemv, "DEVICE", "cpu")
    monkeypatch.setattr(gguf_gemv, "random_qweight", lambda type_id, N, K: (type_id, N, K))
    monkeypatch.setattr(gguf_gemv, "check",
                        lambda x, qweight, type_id: seen.append((x.shape[0], *qweight)) or 0.0)
    bench.check_gguf()
    assert not bench.FAILURES
    assert sorted(seen) == sorted((m, t, N, K) for t in bench.GGUF_TYPES.values() for m in (1, 8)
                                  for K, N in ((4096, 4096), (2048, 1000)))


ROWS_STAGE = r"""
import sys

import torch

sys.path.insert(0, "benchmarks")
import gguf_gemv

for name, value in (("DEVICE", "cpu"), ("X_DTYPE", torch.float16), ("L2_BYTES", 1),
                    ("graph_us", lambda calls, reps=20: (calls[0](), 1.0)[1]),
                    ("copy_bandwidth", lambda: 1e12),
                    ("dense_linear", torch.nn.functional.linear),
                    ("SHAPES", {"qkv": (512, 48), "o": (256, 32), "gate_up": (256, 64),
                                "down": (512, 32)})):
    setattr(gguf_gemv, name, value)
sys.argv = ["gguf_gemv.py", "--only", "rows", "--types", "Q4_K", "--shapes", "o", *sys.argv[1:]]
gguf_gemv.main()
"""


SUBDOT_STAGE = ROWS_STAGE.replace('"--only", "rows", "--types", "Q4_K", "--shapes", "o"',
                                  '"--only", "subdot", "--types", "Q4_K", "Q6_K"').replace(
    '"down": (512, 32)})', '"down": (512, 32)}), ("CHECK_SHAPES", ["512x20"]), '
    '("SUBDOT_CHECKS", ["16/4/2/a"])').replace(
    '"qkv": (512, 48), "o": (256, 32), "gate_up": (256, 64)',
    '"qkv": (512, 48), "o": (512, 32), "gate_up": (512, 64)')


def test_gguf_subdot_stage_runs_on_the_cpu():
    """benchmarks/gguf_gemv.py --only subdot (gguf_subdot's checks, its tile sweep and its table
    beside gguf_rows and bf16) under the interpreter on tiny layers with the timing stubbed: it
    prints a SUBDOT_CONFIGS table for Q4_K that covers 16 rows and a row per M (Q6_K, which
    gguf_subdot does not take, skipped)."""
    pytest.importorskip("gguf")
    argv = ["--subdot-configs", "16/4/2/a", "32/4/2/j", "--subdot-m", "4", "16"]
    result = subprocess.run([sys.executable, "-c", SUBDOT_STAGE, *argv], cwd=ROOT, text=True,
                            capture_output=True, timeout=900, check=False,
                            env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "FAILED" not in result.stdout, result.stdout[-3000:]
    assert "    12: (  # Q4_K\n        (16, dict(block_n=" in result.stdout
    assert "| Q6_K |" not in result.stdout and "# Q6_K" not in result.stdout
    for M in (4, 16):
        assert f"| Q4_K | {M} | " in result.stdout


@pytest.mark.parametrize("argv", [["--rows-m", "1", "8"],
                                  ["--sweep-rows", "--sweep-m", "8", "--rows-configs", "16/4/2",
                                   "32/4/1/2/a"]], ids=["table", "sweep"])
def test_gguf_rows_stage_runs_on_the_cpu(argv):
    """benchmarks/gguf_gemv.py --only rows (the 2..16-row kernel vs the old paths and bf16) and
    its tile sweep, under the interpreter on tiny layers with the timing stubbed: every path is
    checked against the reference, and the sweep prints a ROWS_CONFIGS table. In a child: an
    earlier `import triton.testing` (benchmarks/kernel_bench.py) leaves Triton unable to
    interpret."""
    pytest.importorskip("gguf")
    result = subprocess.run([sys.executable, "-c", ROWS_STAGE, *argv], cwd=ROOT, text=True,
                            capture_output=True, timeout=600, check=False,
                            env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT),
                                 "TINYPAGED_GGUF_SUBDOT": "0"})  # the paths before gguf_subdot
    assert result.returncode == 0, result.stderr[-3000:]
    assert "FAILED" not in result.stdout
    if "--sweep-rows" in argv:
        assert "    12: (  # Q4_K\n        (8, dict(block_n=" in result.stdout
    else:
        assert "| o | 256x32 | Q4_K | 8 | rows | 1.0 | 1.0 |" in result.stdout
