"""The Gluon prefill kernel (kernels/attention_gluon.py): what it covers, when attention.py picks
it, that CPU tensors never reach it, and that every tile config compiles for the H200 (sm_90) to
SASS with TMA, wgmma and warp specialization (Gluon has no interpreter: its numbers are checked
on a GPU by benchmarks/prefill_gluon.py)."""

import pytest
import torch
from helpers.attention import Batch, assert_close
from helpers.compile_sm90 import compile_for_sm90

from tinypaged.kernels import attention, attention_gluon
from tinypaged.kernels.attention import paged_attention, paged_attention_ref, prefill_kernel
from tinypaged.kernels.attention_gluon import gluon_supports

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")


def cache(block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16):
    return torch.zeros(4, block_size, num_kv_heads, head_dim, dtype=dtype)


def test_supported_shapes():
    q = torch.zeros(8, 32, 128, dtype=torch.bfloat16)
    assert gluon_supports(q, cache(), None, None)
    assert gluon_supports(q.half(), cache(dtype=torch.float16), None, None)
    assert gluon_supports(q, cache(block_size=64), None, None)
    assert not gluon_supports(q, cache(), 128, None)  # sliding window
    assert not gluon_supports(q, cache(), None, 30.0)  # soft-cap
    assert not gluon_supports(q.float(), cache(dtype=torch.float32), None, None)
    assert not gluon_supports(q, cache().to(torch.float8_e4m3fn), None, None)  # FP8 KV
    assert not gluon_supports(q[..., :64], cache(head_dim=64), None, None)
    assert not gluon_supports(q, cache(block_size=128), None, None)  # a block over a key tile
    assert not gluon_supports(q, cache(block_size=4), None, None)  # under the 8-row swizzle
    assert not gluon_supports(q, cache().transpose(1, 2), None, None)  # slots not rows


def test_prefill_kernel_choice(monkeypatch):
    q = torch.zeros(8, 32, 128, dtype=torch.bfloat16)
    monkeypatch.delenv("TINYPAGED_PREFILL_ATTENTION", raising=False)
    assert prefill_kernel(q, cache(), 2048, None, None, True) == "hopper"  # the default
    monkeypatch.setenv("TINYPAGED_PREFILL_ATTENTION", "gluon")
    assert prefill_kernel(q, cache(), 2048, None, None, True) == "gluon"
    assert prefill_kernel(q, cache(), 2048, None, None, False) == "varlen"  # not sm_90
    assert prefill_kernel(q, cache(), 4, None, None, True) == "varlen"  # 16 rows: small tiles
    assert prefill_kernel(q, cache(), 2048, 128, None, True) == "varlen"  # window
    q64 = torch.zeros(8, 32, 64, dtype=torch.bfloat16)
    assert prefill_kernel(q64, cache(head_dim=64), 2048, None, None, True) == "hopper"
    monkeypatch.setenv("TINYPAGED_PREFILL_ATTENTION", "cudnn")
    with pytest.raises(ValueError, match="TINYPAGED_PREFILL_ATTENTION"):
        prefill_kernel(q, cache(), 2048, None, None, True)


def test_cpu_tensors_never_reach_gluon(monkeypatch):
    # asked for, on CPU tensors: the reference, or under the interpreter the varlen kernel
    monkeypatch.setenv("TINYPAGED_PREFILL_ATTENTION", "gluon")
    monkeypatch.setattr(attention, "gluon_attention", lambda *a, **k: pytest.fail("gluon"))
    batch = Batch([40, 3], [40, 20], 4, 128, 16, torch.float16)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ref = batch.run(paged_attention)
    assert_close(ref, batch.run(paged_attention_ref), torch.float16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert_close(batch.run(paged_attention, config={"block_n": 16}), ref, torch.float16)


LAUNCHES = r"""
from tinypaged.kernels import attention, attention_gluon

ptx = []


def keep_ptx(self, *args, grid, warmup, **kwargs):
    kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
    assert kernel.metadata.shared <= 227 * 1024, (self.__name__, kernel.metadata.shared)
    assert kernel.asm["cubin"]  # ptxas ran: SASS for sm_90a
    ptx.append(kernel.asm["ptx"])
    compiled.add(self.__name__)


JITFunction.run = keep_ptx
for dtype in (torch.bfloat16, torch.float16):
    for num_q_heads, num_kv_heads, block_size in ((32, 8, 16), (32, 32, 16), (28, 4, 64)):
        q = torch.randn(4, num_q_heads, 128).to(dtype)
        k_cache = torch.randn(8, block_size, num_kv_heads, 128).to(dtype)
        args = (q, k_cache, k_cache.clone(), torch.zeros(2, 4, dtype=torch.int32),
                torch.tensor([40, 9], dtype=torch.int32),
                torch.tensor([0, 3, 4], dtype=torch.int32), 0.1, torch.empty_like(q))
        configs = [dict(zip(("block_m", "block_n", "num_stages", "mode"), c))
                   for c in attention_gluon.GLUON_CONFIGS]
        if (dtype, num_kv_heads) != (torch.bfloat16, 8):  # the other axes at the default only
            configs = [attention.GLUON_CONFIG]
        for config in configs:
            attention_gluon.gluon_attention(*args, **config)
for text in ptx:  # a producer warp (24 registers) beside consumer warpgroups of 240
    text = " ".join(text.split())
    assert "cp.async.bulk.tensor.2d" in text and "wgmma.mma_async" in text
    assert "setmaxnreg.dec.sync.aligned.u32 24;" in text
    assert "setmaxnreg.inc.sync.aligned.u32 240;" in text
"""


def test_gluon_kernel_compiles_for_sm90():
    assert compile_for_sm90(LAUNCHES) == ["_gluon_attention_kernel"]


def test_default_config_is_one_of_the_benchmarked():
    config = attention.GLUON_CONFIG
    assert tuple(config[k] for k in ("block_m", "block_n", "num_stages", "mode")) in \
        attention_gluon.GLUON_CONFIGS
