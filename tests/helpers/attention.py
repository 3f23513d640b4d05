"""A batch of paged attention for the kernel tests: random K/V in permuted cache blocks (the
slots no sequence owns hold NaN), its dense float64 softmax, and the tolerance per dtype."""

from __future__ import annotations

import torch


class Batch:
    """B sequences of random dense K/V, scattered into randomly permuted cache blocks."""

    def __init__(
        self, q_lens, seq_lens, group, head_dim, block_size, dtype, num_kv_heads=2, seed=0
    ):
        g = torch.Generator().manual_seed(seed)
        self.num_q_heads, self.scale = group * num_kv_heads, head_dim**-0.5
        blocks = [-(-s // block_size) for s in seq_lens]
        num_blocks = sum(blocks) + 2
        # every slot no sequence owns holds NaN: reading one unmasked poisons the output
        self.k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"),
                                  dtype=dtype)
        self.v_cache = self.k_cache.clone()
        poison_block = num_blocks - 1
        self.block_tables = torch.full((len(seq_lens), max(blocks) + 2), poison_block,
                                       dtype=torch.int32)
        perm = torch.randperm(num_blocks - 1, generator=g).tolist()  # not 0..n
        self.k, self.v = [], []  # dense [seq_len, Hk, D] per sequence
        for b, seq_len in enumerate(seq_lens):
            table = [perm.pop() for _ in range(blocks[b])]
            self.block_tables[b, : blocks[b]] = torch.tensor(table, dtype=torch.int32)
            k = torch.randn(seq_len, num_kv_heads, head_dim, generator=g).to(dtype)
            v = torch.randn(seq_len, num_kv_heads, head_dim, generator=g).to(dtype)
            for pos in range(seq_len):
                self.k_cache[table[pos // block_size], pos % block_size] = k[pos]
                self.v_cache[table[pos // block_size], pos % block_size] = v[pos]
            self.k.append(k)
            self.v.append(v)
        self.q = torch.randn(sum(q_lens), self.num_q_heads, head_dim, generator=g).to(dtype)
        self.q_lens, self.seq_lens_list = q_lens, seq_lens
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        self.query_start_loc = torch.tensor(starts, dtype=torch.int32)

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, self.scale)

    def run(self, fn, **kwargs):
        kwargs.setdefault("max_query_len", max(self.q_lens))
        kwargs.setdefault("max_seq_len", max(self.seq_lens_list))
        return fn(*self.args(), **kwargs)

    def poison_before_windows(self, window, block_n):
        """NaN in every cache row of the key tiles wholly before each sequence's first new
        token's window: reading one (even masked, since 0 * NaN = NaN in the P @ V product)
        poisons that sequence's output."""
        block_size = self.k_cache.shape[1]
        for b, (q_len, seq_len) in enumerate(zip(self.q_lens, self.seq_lens_list)):
            skipped = (seq_len - q_len + 1 - window) // block_n * block_n
            assert skipped >= block_n  # else the test would check nothing
            for pos in range(skipped):
                block = self.block_tables[b, pos // block_size]
                self.k_cache[block, pos % block_size] = float("nan")
                self.v_cache[block, pos % block_size] = float("nan")

    def dense_float64(self, sliding_window=None, softcap=None):
        """Causal softmax attention per sequence, from the dense K/V, in float64: keys
        max(0, pos - sliding_window + 1) .. pos, scores soft-capped when asked."""
        out = torch.empty(self.q.shape, dtype=torch.float64)
        start = 0
        for q_len, seq_len, k, v in zip(self.q_lens, self.seq_lens_list, self.k, self.v):
            group = self.num_q_heads // k.shape[1]
            for i in range(q_len):
                pos = seq_len - q_len + i
                first = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
                for h in range(self.num_q_heads):
                    keys = k[first : pos + 1, h // group].double()
                    values = v[first : pos + 1, h // group].double()
                    scores = keys @ self.q[start + i, h].double() * self.scale
                    if softcap is not None:
                        scores = softcap * torch.tanh(scores / softcap)
                    weights = torch.softmax(scores, dim=0)
                    out[start + i, h] = weights @ values
            start += q_len
        return out


def assert_close(actual, expected, dtype):
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert not actual.isnan().any()
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol, rtol=tol)
