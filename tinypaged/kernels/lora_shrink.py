"""LoRA shrink, Punica-style: each token's hidden row times the A matrix of its own adapter.

A batch mixes tokens of several adapters (and tokens of none). The adapters' A matrices sit in
`max_loras` GPU slots, stacked; a fused layer (qkv, gate-up) stacks its shards' A matrices along
the rank axis, so one launch makes every shard's low-rank activations:

    h[t, :] = x[t, :] @ lora_a[slot(t)]^T            x [T, K], lora_a [L, N, K], h [T, N] fp32
                                                      N = num_shards * max_lora_rank

written as SPLIT_K partial sums, out [SPLIT_K, T, N] with h = out.sum(0), which the expand adds
up as it loads them (lora_expand.py).

Tokens are grouped by slot (`lora_segments`): `sorted_token_ids` lists the batch's rows slot by
slot, and slot l owns entries seg_start[l] .. seg_start[l] + seg_len[l] - 1 (tokens of no adapter,
slot -1, are in no segment: their rows of `out` are left as they were). A row tile is BLOCK_M
rows of one slot's segment; slot l has ceil(seg_len[l] / BLOCK_M) tiles, so the batch has at most
ceil(T / BLOCK_M) + L of them, and that is the grid's first axis (times SPLIT_K): program i walks
the slots (`slot_tile`) to find which slot's tile it is, and returns at once when i is past the
last. So no program is launched per (tile, slot) pair that has no tokens, and the grid depends
only on T and L, never on how the tokens split: a CUDA graph replays it with new segments. A
program gathers its BLOCK_M rows from x and multiplies them by the slot's A tile with tl.dot, so
each A tile is read once per BLOCK_M tokens of its adapter, never once per token.

The K loop (K = 4096 or 14336) is split over SPLIT_K programs whenever the row tiles alone are too
few to fill the GPU (`shrink_splits`: decode and mid-size batches), each storing its partial sum
in its own plane of `out`: no atomics, and no zeroing launch before the shrink.
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import cdiv, dot_precision, jit, next_power_of_2, tl, use_triton


def lora_segments(token_slots: torch.Tensor, num_slots: int):
    """(sorted_token_ids [T] int32, seg_start [L] int32, seg_len [L] int32) of token_slots [T]
    (slot per token, -1 = no adapter). Tokens of no adapter sort last, outside every segment."""
    key = torch.where(token_slots < 0, num_slots, token_slots).long()
    sorted_ids = torch.sort(key, stable=True).indices.to(torch.int32)
    seg_len = torch.bincount(key, minlength=num_slots + 1)[:num_slots]
    seg_start = torch.cumsum(seg_len, 0) - seg_len
    return sorted_ids, seg_start.to(torch.int32), seg_len.to(torch.int32)


def block_rows(num_tokens: int) -> int:
    """BLOCK_M of both LoRA kernels for a batch of num_tokens rows."""
    return 16 if num_tokens <= 64 else 32 if num_tokens <= 512 else 64


def shrink_splits(num_tokens: int, k: int) -> int:
    """How many programs share the K loop (the planes of the shrink's output): enough that
    row tiles x splits reach ~256 programs (two per SM), each keeping >= 256 of K, at most 32."""
    tiles = cdiv(num_tokens, block_rows(num_tokens))
    return max(1, min(32, cdiv(k, 256), cdiv(256, tiles)))


@jit
def slot_tile(SEG_LEN, num_slots, tile, BLOCK_M: tl.constexpr):
    """(slot, row tile within the slot's segment) of the batch's tile-th row tile, counting
    ceil(seg_len / BLOCK_M) tiles per slot in slot order; slot -1 past the last tile."""
    slot = tile * 0 - 1
    local = tile * 0
    first = tile * 0
    for candidate in range(num_slots):
        n = tl.cdiv(tl.load(SEG_LEN + candidate), BLOCK_M)
        hit = (slot < 0) & (tile < first + n)
        slot = tl.where(hit, candidate, slot)
        local = tl.where(hit, tile - first, local)
        first += n
    return slot, local


@jit(do_not_specialize=("K",))
def _lora_shrink_kernel(
    X, A, SORTED, SEG_START, SEG_LEN, OUT,  # x [T, K]; lora_a [L, N, K]; out [SPLIT_K, T, N] fp32
    K, N, num_slots, stride_xm, stride_al, stride_an, stride_os, stride_om,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_mk, pid_n = tl.program_id(0), tl.program_id(1)
    slot, pid_m = slot_tile(SEG_LEN, num_slots, pid_mk // SPLIT_K, BLOCK_M)
    pid_k = pid_mk % SPLIT_K
    if slot < 0:  # past the batch's last row tile
        return
    seg_len = tl.load(SEG_LEN + slot)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < seg_len
    tok = tl.load(SORTED + tl.load(SEG_START + slot) + rows, mask=row_mask, other=0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    a_base = A + slot.to(tl.int64) * stride_al
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, SPLIT_K * BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(X + tok[:, None] * stride_xm + ks[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        a = tl.load(a_base + cols[None, :] * stride_an + ks[:, None],
                    mask=k_mask[:, None] & col_mask[None, :], other=0.0)  # [BK, BN]
        acc += tl.dot(x, a, input_precision=PRECISION)
    ptrs = OUT + pid_k * stride_os + tok[:, None] * stride_om + cols[None, :]
    tl.store(ptrs, acc, mask=row_mask[:, None] & col_mask[None, :])


def lora_shrink_triton(x: torch.Tensor, lora_a: torch.Tensor, sorted_token_ids: torch.Tensor,
                       seg_start: torch.Tensor, seg_len: torch.Tensor,
                       out: torch.Tensor) -> torch.Tensor:
    """The Triton launcher; out.shape[0] programs share each K loop."""
    num_tokens, k = x.shape
    num_slots, n, _ = lora_a.shape
    if num_tokens == 0:
        return out
    block_m = block_rows(num_tokens)
    block_n = min(64, max(16, next_power_of_2(n)))
    block_k = 64 if k >= 64 else max(16, next_power_of_2(k))
    split_k = out.shape[0]
    grid = ((cdiv(num_tokens, block_m) + num_slots) * split_k, cdiv(n, block_n))
    _lora_shrink_kernel[grid](
        x, lora_a, sorted_token_ids, seg_start, seg_len, out,
        k, n, num_slots, x.stride(0), lora_a.stride(0), lora_a.stride(1), out.stride(0),
        out.stride(1),
        SPLIT_K=split_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION=dot_precision(x.dtype), num_warps=4,
    )
    return out


def lora_shrink_ref(x: torch.Tensor, lora_a: torch.Tensor, sorted_token_ids: torch.Tensor,
                    seg_start: torch.Tensor, seg_len: torch.Tensor,
                    out: torch.Tensor) -> torch.Tensor:
    """The torch reference: one matmul per slot over its segment (fp32 products), the whole
    sum in plane 0 of out and zeros in the others."""
    for slot, (start, length) in enumerate(zip(seg_start.tolist(), seg_len.tolist())):
        if length:
            tok = sorted_token_ids[start : start + length].long()
            out[:, tok] = 0.0
            out[0, tok] = x[tok].float() @ lora_a[slot].float().T
    return out


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, sorted_token_ids: torch.Tensor,
                seg_start: torch.Tensor, seg_len: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out.sum(0)[t] = x[t] @ lora_a[slot(t)]^T for every token of an adapter (module
    docstring); x [T, K] (rows contiguous), lora_a [L, N, K], out [SPLIT_K, T, N] float32 with
    SPLIT_K = shrink_splits(T, K) (any count works); returns out."""
    impl = lora_shrink_triton if use_triton(x) else lora_shrink_ref
    return impl(x, lora_a, sorted_token_ids, seg_start, seg_len, out)
