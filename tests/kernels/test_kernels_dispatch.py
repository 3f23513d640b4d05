"""Who runs a kernel op: Triton on CUDA or under TRITON_INTERPRET=1, else the torch reference; and
`import tinypaged.kernels` without triton installed."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinypaged.kernels import activation, kv_cache, norm, rotary, rotary_kv_cache
from tinypaged.kernels.rotary import build_cos_sin_cache


def op_calls():
    """(module, launcher name, call of the public op) for each elementwise op."""
    x, w = torch.randn(3, 32), torch.randn(32)
    cache = build_cos_sin_cache(16, 8, 10000.0)
    q, k = torch.randn(3, 2, 16), torch.randn(3, 1, 16)
    k_cache = torch.zeros(2, 16, 1, 16)
    return [
        (norm, "rms_norm_triton", lambda: norm.rms_norm(x, w, 1e-6)),
        (activation, "silu_and_mul_triton", lambda: activation.silu_and_mul(x)),
        (rotary, "rotary_embedding_triton",
         lambda: rotary.rotary_embedding(torch.arange(3), q, k, cache, 16)),
        (kv_cache, "store_kv_triton",
         lambda: kv_cache.store_kv(k, k, k_cache, k_cache.clone(), torch.tensor([0, -1, 5]))),
        (rotary_kv_cache, "rotary_store_kv_triton",
         lambda: rotary_kv_cache.rotary_store_kv(torch.arange(3), q, k, k, k_cache,
                                                 k_cache.clone(), torch.tensor([0, -1, 5]),
                                                 cache, 16)),
    ]


@pytest.mark.parametrize("index", range(5),
                         ids=["rms_norm", "silu", "rotary", "store_kv", "rotary_store_kv"])
def test_cpu_tensors_use_triton_only_under_the_interpreter(monkeypatch, index):
    module, launcher, call = op_calls()[index]
    calls = []
    real = getattr(module, launcher)
    monkeypatch.setattr(module, launcher, lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    call()
    assert calls == []
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    call()
    assert calls == []
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read at call time
    call()
    assert calls == [1]


NO_TRITON = """
import sys
sys.modules["triton"] = None  # import triton now raises ImportError
import os
os.environ["TRITON_INTERPRET"] = "1"  # asks for Triton, which is not there
import torch
import tinypaged.kernels as K
assert not K.HAS_TRITON
x, w = torch.randn(4, 32), torch.randn(32)
out = K.rms_norm(x, w, 1e-6)
want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
assert torch.allclose(out, want, atol=1e-5), "rms_norm"
assert K.silu_and_mul(torch.randn(2, 8)).shape == (2, 4)
q, k = torch.randn(2, 2, 16), torch.randn(2, 1, 16)
K.rotary_embedding(torch.arange(2), q, k, K.build_cos_sin_cache(16, 4, 10000.0), 16)
cache = torch.zeros(1, 16, 1, 16)
K.store_kv(k, k, cache, cache.clone(), torch.tensor([3, -1]))
assert torch.equal(cache[0, 3], k[0])
out = K.paged_attention(q, cache, cache.clone(), torch.zeros(1, 1, dtype=torch.int32),
                        torch.tensor([4], dtype=torch.int32),
                        torch.tensor([0, 2], dtype=torch.int32), 0.25)
assert out.shape == q.shape and torch.isfinite(out).all()
print("ok")
"""


def test_import_and_reference_ops_without_triton():
    repo = Path(__file__).resolve().parents[2]  # `python -c` imports tinypaged from its cwd
    result = subprocess.run([sys.executable, "-c", NO_TRITON], cwd=repo, capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
