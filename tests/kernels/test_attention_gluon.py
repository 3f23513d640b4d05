"""The Gluon prefill kernel (kernels/attention_gluon.py): what it covers, when attention.py picks
it, that CPU tensors never reach it, and that every tile config compiles for the H200 (sm_90) to
SASS with TMA, wgmma and warp specialization (Gluon has no interpreter: its numbers are checked
on a GPU by benchmarks/prefill_gluon.py)."""

import re
import subprocess
import types
from pathlib import Path

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
    assert prefill_kernel(q, cache(), 2048, None, None, True) == "gluon"  # the default
    monkeypatch.setenv("TINYPAGED_PREFILL_ATTENTION", "triton")
    assert prefill_kernel(q, cache(), 2048, None, None, True) == "hopper"
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
from tinypaged.kernels.launcher.launch import launch_source

ptx = []


def keep_ptx(self, *args, grid, warmup, **kwargs):
    kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
    assert kernel.metadata.shared <= 227 * 1024, (self.__name__, kernel.metadata.shared)
    assert kernel.asm["cubin"]  # ptxas ran: SASS for sm_90a
    assert kernel.metadata.num_warps == 12  # launched with the producer's warpgroup too
    # the ctypes launcher (TINYPAGED_TRITON_LAUNCHER=python) takes Gluon's TMA descriptors
    launch_source(list(kernel.src.signature.values()), kernel.metadata.tensordesc_meta)
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
        configs = [dict(zip(attention_gluon.CONFIG_KEYS, c))
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


SASS_LAUNCH = r"""
from tinypaged.kernels import attention, attention_gluon


def keep_cubin(self, *args, grid, warmup, **kwargs):
    kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
    open(CUBIN, "wb").write(kernel.asm["cubin"])
    compiled.add(self.__name__)


JITFunction.run = keep_cubin
q = torch.randn(4, HQ, 128).to(torch.bfloat16)
k_cache = torch.randn(8, 16, HK, 128).to(torch.bfloat16)
attention_gluon.gluon_attention(q, k_cache, k_cache.clone(), torch.zeros(2, 4, dtype=torch.int32),
                                torch.tensor([40, 9], dtype=torch.int32),
                                torch.tensor([0, 3, 4], dtype=torch.int32), 0.1,
                                torch.empty_like(q), **attention.GLUON_CONFIG)
"""


def tile_loops(sass: str) -> list[list[str]]:
    """The consumers' tile loops, as lists of instructions: of the ranges a backward branch
    closes that issue wgmmas (HGMMA) and a tile's softmax (>= 128 MUFU.EX2), the shortest that
    do not overlap (the barrier waits' retry stubs at the end of the code branch back into the
    middle, closing longer ranges)."""
    code = [(int(a, 16), text) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    index = {addr: i for i, (addr, _) in enumerate(code)}
    loops = []
    for i, (addr, text) in enumerate(code):
        target = re.search(r"BRA\s+0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr and int(target.group(1), 16) in index:
            loops.append((index[int(target.group(1), 16)], i))
    mma = [(a, b) for a, b in loops if any("HGMMA" in t for _, t in code[a:b + 1])
           and sum("MUFU.EX2" in t for _, t in code[a:b + 1]) >= 128]
    chosen = []
    for a, b in sorted(mma, key=lambda r: r[1] - r[0]):
        if all(b < c or d < a for c, d in chosen):
            chosen.append((a, b))
    return [[t for _, t in code[a:b + 1]] for a, b in sorted(chosen)]


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(32, 8), (32, 32)])
def test_default_config_tile_loop_stays_uniform(tmp_path, num_q_heads, num_kv_heads):
    # The consumers' tile loop at GLUON_CONFIG: no spilled registers anywhere, and the ring's
    # stage / phase arithmetic on the uniform datapath (no R2UR moving per-thread values into
    # the wgmma descriptors' registers). A persistent variant that lost both ran 4-9% slower on
    # the H200 (benchmarks/RESULTS-log.md, 2026-12-03), so a change that loses them shows here.
    import triton  # (here: tinypaged's kernels import it first, the interpreter's way)

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        pytest.skip("this Triton wheel carries no cuobjdump")
    cubin = tmp_path / "kernel.cubin"
    launch = SASS_LAUNCH.replace("CUBIN", repr(str(cubin))).replace("HQ", str(num_q_heads))
    assert compile_for_sm90(launch.replace("HK", str(num_kv_heads))) == \
        ["_gluon_attention_kernel"]
    sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True,
                          text=True, check=True).stdout
    assert not re.search(r"\b(LDL|STL)\b", sass)  # no spills
    loops = tile_loops(sass)
    assert len(loops) == 2  # one tile loop a consumer warpgroup
    for loop in loops:
        assert sum("HGMMA" in t for t in loop) == 16  # QK^T: 8 of K = 16; P @ V: 8 of K = 16
        assert not any(t.split()[0].startswith("R2UR") for t in loop if t.split())


def test_default_config_is_one_of_the_benchmarked():
    config = attention.GLUON_CONFIG
    assert tuple(config[k] for k in attention_gluon.CONFIG_KEYS) in \
        attention_gluon.GLUON_CONFIGS


def emulated_tile(rows2d, t, g):
    """The producer: one box of block_size rows per cache block, zeros out of bounds."""
    parts = []
    for j in range(g.block_n // g.block_size):
        idx = t * (g.block_n // g.block_size) + j
        block = int(g.block_tables[g.seq, min(idx, g.last_block)])
        row = block * g.block_size if idx <= g.last_block else g.num_rows
        col = g.kv_head * g.head_dim
        box = rows2d[row:row + g.block_size, col:col + g.head_dim]
        parts.append(box if row < g.num_rows else torch.zeros(g.block_size, g.head_dim))
    return torch.cat(parts)


def emulated_softmax(s, m_i, l_i, start_n, q_pos, g):
    c = g.scale * 1.4426950408889634  # scale * log2(e)
    if start_n + g.block_n > g.unmasked_end:
        k_pos = start_n + torch.arange(g.block_n)
        s = torch.where(k_pos[None, :] <= q_pos[:, None], s * c, -1e6)
        m_new = torch.maximum(m_i, s.max(1).values)
        p = torch.exp2(s - m_new[:, None])
    else:
        m_new = torch.maximum(m_i, s.max(1).values * c)
        p = torch.exp2(s * c - m_new[:, None])
    alpha = torch.exp2(m_i - m_new)
    return p.to(g.dtype).float(), alpha, m_new, l_i * alpha + p.sum(1)


def emulate(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, block_n,
            consumers, head_group):
    """The kernel's schedule in torch, line for line (program order, the producer's TMA rows,
    out-of-bounds zeros, the V rows zeroed past seq_len, the pipelined online softmax), so that
    its index arithmetic runs somewhere before a GPU does (Gluon has no interpreter)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    block_q, rows_per = 128 // group, 128 // consumers
    k_rows, v_rows = (c.reshape(num_blocks * block_size, num_kv_heads * head_dim).float()
                      for c in (k_cache, v_cache))
    g = types.SimpleNamespace(block_n=block_n, block_size=block_size, head_dim=head_dim,
                              block_tables=block_tables, num_rows=num_blocks * block_size,
                              scale=scale, dtype=q.dtype)
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    num_q_blocks = num_tokens // block_q + len(seq_lens)
    done = set()
    for w in range(num_q_blocks * num_kv_heads):  # the programs, in launch order
        kv_head = w // (head_group * num_q_blocks) * head_group + w % head_group
        q_block = num_q_blocks - 1 - w % (head_group * num_q_blocks) // head_group
        assert (q_block, kv_head) not in done  # each (tile, KV head) once
        done.add((q_block, kv_head))
        seq = max(b for b in range(len(seq_lens)) if starts[b] // block_q + b <= q_block)
        q_start, q_len = starts[seq], starts[seq + 1] - starts[seq]
        q_begin = (q_block - (q_start // block_q + seq)) * block_q
        if q_begin >= q_len:
            continue
        seq_len = int(seq_lens[seq])
        prefix_len = seq_len - q_len
        key_end = prefix_len + min(q_begin + block_q, q_len)
        num_tiles = -(-key_end // block_n)
        g.seq, g.kv_head, g.last_block = seq, kv_head, (key_end - 1) // block_size
        g.unmasked_end = (prefix_len + q_begin + 1) // block_n * block_n
        for c in range(consumers):
            rows = c * rows_per + torch.arange(rows_per)
            q_idx = q_begin + rows // group
            row_valid = (rows < block_q * group) & (q_idx < q_len)
            q_pos = torch.where(row_valid, prefix_len + q_idx, -1)
            head = kv_head * group + rows % group
            token = (q_start + q_idx).clamp(max=num_tokens - 1)
            qt = torch.where(row_valid[:, None], q[token, head].float(), 0.0)
            o = torch.zeros(rows_per, head_dim)
            m_i, l_i = torch.full((rows_per,), float("-inf")), torch.zeros(rows_per)
            p, _, m_i, l_i = emulated_softmax(qt @ emulated_tile(k_rows, 0, g).T, m_i, l_i, 0,
                                              q_pos, g)
            for t in range(1, num_tiles):
                s = qt @ emulated_tile(k_rows, t, g).T
                o = o + p @ emulated_tile(v_rows, t - 1, g)
                p, alpha, m_i, l_i = emulated_softmax(s, m_i, l_i, t * block_n, q_pos, g)
                o = o * alpha[:, None]
            v = emulated_tile(v_rows, num_tiles - 1, g)
            if seq_len % block_size != 0 and (key_end - 1) // block_size == \
                    (seq_len - 1) // block_size:
                v[key_end - (num_tiles - 1) * block_n:] = 0.0
            o = (o + p @ v) / l_i[:, None]
            out[token[row_valid], head[row_valid]] = o[row_valid].to(q.dtype)
    return out

@pytest.mark.parametrize("block_n,consumers,group,head_group",
                         [(128, 1, 4, 1), (64, 2, 4, 2), (128, 2, 1, 1), (64, 1, 3, 1)])
def test_schedule_emulation_matches_reference(block_n, consumers, group, head_group):
    # prefills and chunks inside a cached prefix; every sequence ends inside a cache block,
    # whose unowned slots hold NaN (as the engine's torch.empty cache may)
    batch = Batch([1, 17, 150, 5, 40], [1, 17, 150, 300, 170], group, 128, 16, torch.float16)
    got = emulate(*batch.args(), block_n, consumers, head_group)
    assert_close(got, batch.run(paged_attention_ref), torch.float16)
