"""Logits ops of the sampler: a packed token bitmask (-inf where a token is not allowed) and a
sparse additive bias, each one launch for the whole batch.

Bitmask (structured output, allowed_token_ids, bad_words). Row r of `bitmask` [R, W] int32,
W = ceil(V / 32), describes logits row `rows[r]`; token t is allowed when bit t % 32 of word
t // 32 is set (the layout xgrammar and llguidance fill):

    logits[rows[r], t] = -inf   if (bitmask[r, t // 32] >> (t % 32)) & 1 == 0
                         unchanged otherwise

Only the R listed rows are touched, so unconstrained requests in the batch cost nothing. The grid
is (R, V / BLOCK); each program reads BLOCK / 32 words and writes only the masked logits.

Logit bias (OpenAI `logit_bias`). K entries (row, token, bias), at most one per (row, token):

    logits[rows[k], token_ids[k]] += bias[k]

The grid is K / BLOCK; each program gathers, adds and scatters BLOCK entries.
"""

from __future__ import annotations

import sys

import torch

from tinypaged.kernels._triton import cdiv, jit, next_power_of_2, tl, use_triton


@jit(do_not_specialize=("vocab_size",))
def _token_bitmask_kernel(
    LOGITS,  # [N, V], last dim contiguous
    BITMASK,  # [R, W] int32, contiguous
    ROWS,  # [R] int64: the logits row of each bitmask row
    stride_logits, num_words, vocab_size,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < vocab_size
    row = tl.load(ROWS + r).to(tl.int64)
    words = tl.load(BITMASK + r * num_words + cols // 32, mask=in_vocab, other=0)
    allowed = ((words >> (cols % 32)) & 1) != 0
    neg_inf = tl.full([BLOCK], float("-inf"), tl.float32).to(LOGITS.dtype.element_ty)
    tl.store(LOGITS + row * stride_logits + cols, neg_inf, mask=in_vocab & ~allowed)


@jit
def _logit_bias_kernel(
    LOGITS,  # [N, V], last dim contiguous
    ROWS, TOKEN_IDS,  # [K] int64
    BIAS,  # [K] float32
    stride_logits, num_entries,
    BLOCK: tl.constexpr,
):
    k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = k < num_entries
    rows = tl.load(ROWS + k, mask=live, other=0)
    ids = tl.load(TOKEN_IDS + k, mask=live, other=0)
    ptrs = LOGITS + rows * stride_logits + ids
    x = tl.load(ptrs, mask=live, other=0.0).to(tl.float32)
    bias = tl.load(BIAS + k, mask=live, other=0.0)
    tl.store(ptrs, (x + bias).to(LOGITS.dtype.element_ty), mask=live)


def apply_token_bitmask_triton(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, *, block: int = 4096
) -> None:
    """The Triton launcher (in place); `block` (a power of two >= 32) is tokens per program."""
    vocab = logits.shape[1]
    if rows.numel() == 0 or vocab == 0:
        return
    block = min(block, max(32, next_power_of_2(vocab)))
    grid = (rows.numel(), cdiv(vocab, block))
    _token_bitmask_kernel[grid](
        logits, bitmask, rows, logits.stride(0), bitmask.shape[1], vocab, BLOCK=block,
        num_warps=4,
    )


def apply_token_bitmask_ref(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> None:
    """The torch reference (in place)."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()  # [R, V]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_token_bitmask_cpu(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> None:
    """The reference's result on the CPU, ~10x faster: numpy unpacks each little-endian word's
    bits in token order (one byte per token) instead of a [R, W, 32] int32 shift."""
    import numpy as np

    vocab = logits.shape[1]
    packed = bitmask.contiguous().numpy().view(np.uint8)  # [R, 4W], bit k of byte b = token 8b+k
    bits = np.unpackbits(packed, axis=1, bitorder="little")[:, :vocab]
    blocked = torch.from_numpy(bits.view(np.bool_)).logical_not_()
    sub = logits.index_select(0, rows)
    logits.index_copy_(0, rows, sub.masked_fill_(blocked, float("-inf")))


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Set logits[rows[r], t] = -inf for every token t whose bit in bitmask[r] is 0.

    logits [N, V] float (changed in place); bitmask [R, ceil(V / 32)] int32; rows [R] int64,
    distinct, on the logits' device."""
    words = (logits.shape[1] + 31) // 32
    if logits.dim() != 2 or logits.stride(1) != 1 or not logits.is_floating_point():
        raise ValueError(
            f"logits must be a float [N, V] tensor with contiguous rows, got {logits.dtype} "
            f"{tuple(logits.shape)} with strides {logits.stride()}"
        )
    if bitmask.dtype != torch.int32 or bitmask.shape != (rows.numel(), words):
        raise ValueError(
            f"bitmask must be int32 [{rows.numel()}, {words}] (one row per entry of rows, "
            f"ceil(V / 32) words), got {bitmask.dtype} {tuple(bitmask.shape)}"
        )
    if use_triton(logits):
        apply_token_bitmask_triton(logits, bitmask.contiguous(), rows)
    elif logits.device.type == "cpu" and sys.byteorder == "little":
        apply_token_bitmask_cpu(logits, bitmask, rows)
    else:
        apply_token_bitmask_ref(logits, bitmask, rows)


def apply_logit_bias_triton(
    logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, bias: torch.Tensor,
    *, block: int = 1024,
) -> None:
    """The Triton launcher (in place)."""
    if rows.numel() == 0:
        return
    block = min(block, max(16, next_power_of_2(rows.numel())))
    _logit_bias_kernel[(cdiv(rows.numel(), block),)](
        logits, rows, token_ids, bias, logits.stride(0), rows.numel(), BLOCK=block, num_warps=4,
    )


def apply_logit_bias_ref(
    logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, bias: torch.Tensor
) -> None:
    """The torch reference (in place)."""
    logits.index_put_((rows, token_ids), bias.to(logits.dtype), accumulate=True)


def apply_logit_bias_(
    logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, bias: torch.Tensor
) -> None:
    """logits[rows[k], token_ids[k]] += bias[k]. logits [N, V] float (in place); rows and
    token_ids [K] int64, bias [K] float32, all on the logits' device; (row, token) pairs unique."""
    if not rows.shape == token_ids.shape == bias.shape or rows.dim() != 1:
        raise ValueError(
            f"rows, token_ids and bias must be 1-D of one length, got {tuple(rows.shape)}, "
            f"{tuple(token_ids.shape)} and {tuple(bias.shape)}"
        )
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [N, V] with contiguous rows, got {tuple(logits.shape)}")
    if use_triton(logits):
        apply_logit_bias_triton(logits, rows, token_ids, bias.float())
    else:
        apply_logit_bias_ref(logits, rows, token_ids, bias)
