"""Moving a step's inputs to where the verification before it ended: one program per sequence.

With overlapped verification (spec_decode/decoder.py) step N+1 is built on the host before step
N's emitted tokens are known, as if N accepted every draft: a sequence whose verification N had
n drafts is assumed to have grown by A = n + 1 tokens, and its rows in N+1 sit at the positions
that follow. On the device, once N's walk has run, each such sequence b moves back by what N
really emitted:

    e       = number of tokens in EMITTED[r]            (r = ROWS[b], its row in N's output)
    shift   = e - ASSUMED[b]                            (<= 0)
    positions[t]    += shift                            for every row t of b
    slot_mapping[t]  = BLOCK_TABLES[b, pos // bs] * bs + pos % bs   (at the new position)
    seq_lens[b]     += shift
    input_ids[first row of b] = EMITTED[r, e - 1]       (N's last token: the bonus or the
                                                         target's correction)

Sequences with ROWS[b] = -1 (nothing in flight) are left as they are. The host allocated blocks
for the assumed positions, which are the furthest the rows can be, so every moved slot is in the
sequence's own blocks; the KV rows N wrote for rejected drafts are at positions the moved rows
write again.
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import jit, tl, use_triton

_MAX_WIDTH = 128  # emitted row width bound: num_speculative_tokens <= 64, so K + 1 <= 65
_BLOCK_Q = 16  # rows of a sequence moved at a time


# Widths, strides and the block size are runtime values, and no pointer is assumed aligned (a
# CUDA graph's inputs are views at offsets into one buffer): each new value or alignment would
# compile the kernel again in the middle of serving.
@jit(do_not_specialize=("width", "block_size", "table_stride"),
     do_not_specialize_on_alignment=("EMITTED", "ROWS", "ASSUMED", "QUERY_START_LOC",
                                     "BLOCK_TABLES", "INPUT_IDS", "POSITIONS", "SLOT_MAPPING",
                                     "SEQ_LENS"))
def _shift_kernel(
    EMITTED,  # [S, width] int64, -1 after each row's tokens
    ROWS,  # [B] int64, -1 = nothing in flight
    ASSUMED,  # [B] int64
    QUERY_START_LOC,  # [B + 1] int32
    BLOCK_TABLES,  # [B, table_stride] int32
    INPUT_IDS,  # [T] int64 (in place)
    POSITIONS,  # [T] int64 (in place)
    SLOT_MAPPING,  # [T] int64 (in place)
    SEQ_LENS,  # [B] int32 (in place)
    width,
    block_size,
    table_stride,
    MAX_WIDTH: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    r = tl.load(ROWS + b)
    if r >= 0:
        cols = tl.arange(0, MAX_WIDTH)
        row = tl.load(EMITTED + r * width + cols, mask=cols < width, other=-1)
        e = tl.sum((row >= 0).to(tl.int64), axis=0)
        last = tl.sum(tl.where(cols == e - 1, row, 0), axis=0)
        shift = e - tl.load(ASSUMED + b)
        start = tl.load(QUERY_START_LOC + b).to(tl.int64)
        end = tl.load(QUERY_START_LOC + b + 1).to(tl.int64)
        for t0 in range(start, end, BLOCK_Q):
            t = t0 + tl.arange(0, BLOCK_Q)
            live = t < end
            pos = tl.load(POSITIONS + t, mask=live, other=0) + shift
            block = tl.load(BLOCK_TABLES + b * table_stride + pos // block_size, mask=live,
                            other=0).to(tl.int64)
            tl.store(POSITIONS + t, pos, mask=live)
            tl.store(SLOT_MAPPING + t, block * block_size + pos % block_size, mask=live)
        tl.store(INPUT_IDS + start, last)
        tl.store(SEQ_LENS + b, (tl.load(SEQ_LENS + b) + shift).to(tl.int32))


def shift_to_verified_triton(
    emitted: torch.Tensor, rows: torch.Tensor, assumed: torch.Tensor,
    query_start_loc: torch.Tensor, block_tables: torch.Tensor, block_size: int,
    input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """The Triton launcher; see `shift_to_verified`."""
    num_seqs = rows.shape[0]
    if num_seqs == 0:
        return
    _shift_kernel[(num_seqs,)](
        emitted, rows, assumed, query_start_loc, block_tables, input_ids, positions,
        slot_mapping, seq_lens, emitted.shape[1], block_size, block_tables.stride(0),
        MAX_WIDTH=_MAX_WIDTH, BLOCK_Q=_BLOCK_Q, num_warps=1,
    )


def shift_to_verified_ref(
    emitted: torch.Tensor, rows: torch.Tensor, assumed: torch.Tensor,
    query_start_loc: torch.Tensor, block_tables: torch.Tensor, block_size: int,
    input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """The torch reference: the same moves, batched over the sequences (reads the host for the
    rows' counts)."""
    num_seqs = rows.shape[0]
    if num_seqs == 0:
        return
    active = rows >= 0  # [B]
    row = emitted[rows.clamp(min=0)]  # [B, width]
    e = (row >= 0).sum(1)  # [B]
    last = row.gather(1, (e - 1).clamp(min=0)[:, None])[:, 0]  # [B]
    shift = torch.where(active, e - assumed, 0)  # [B]
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()  # [B]
    n = int(query_start_loc[-1])
    seq_idx = torch.repeat_interleave(torch.arange(num_seqs, device=rows.device), q_lens)  # [n]
    moved = active[seq_idx]  # [n]
    pos = positions[:n] + shift[seq_idx]
    slot = block_tables[seq_idx, pos // block_size].long() * block_size + pos % block_size
    positions[:n] = pos
    slot_mapping[:n] = torch.where(moved, slot, slot_mapping[:n])
    first = query_start_loc[:-1].long()  # [B]
    input_ids[first] = torch.where(active, last, input_ids[first])
    seq_lens[:num_seqs] += shift.to(seq_lens.dtype)


def shift_to_verified(
    emitted: torch.Tensor, rows: torch.Tensor, assumed: torch.Tensor,
    query_start_loc: torch.Tensor, block_tables: torch.Tensor, block_size: int,
    input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """Move the rows of the sequences that follow a verification in flight, in place (module
    docstring). emitted [S, W] int64 (W <= 128), rows / assumed [B] int64, query_start_loc
    [B + 1] int32, block_tables [B, max_blocks] int32; input_ids, positions, slot_mapping
    [>= T] int64 and seq_lens [>= B] int32 are changed in place (rows past T and B untouched)."""
    if emitted.dim() != 2 or emitted.shape[1] > _MAX_WIDTH:
        raise ValueError(f"emitted must be [S, W] with W <= {_MAX_WIDTH}, "
                         f"got {tuple(emitted.shape)}")
    args = (emitted, rows, assumed, query_start_loc, block_tables, block_size, input_ids,
            positions, slot_mapping, seq_lens)
    if use_triton(rows):
        shift_to_verified_triton(*args)
    else:
        shift_to_verified_ref(*args)
