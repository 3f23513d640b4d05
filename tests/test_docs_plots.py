"""benchmarks/kernels.py --json and docs/plots.py agree on the format: rows recorded on the CPU
(torch ops timed for real, ceilings measured the same way) become one PNG per kernel family."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("matplotlib")
pytest.importorskip("triton")  # benchmarks/kernels.py imports triton.testing

ROOT = Path(__file__).resolve().parents[1]


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
    bench = load_script(ROOT / "benchmarks" / "kernels.py")
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
    plots = load_script(ROOT / "docs" / "plots.py")
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"requests": 256}))
    with pytest.raises(SystemExit, match="not a benchmarks/kernels.py --json file"):
        plots.main([str(path)])
