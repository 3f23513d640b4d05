"""The device layout of GGUF weights: the file's blocks regrouped into planes, done once at load.

A GGUF row interleaves small fields with the quants block by block (gguf_format.py): Q6_K's 210
bytes, Q8_0's 34 or Q4_0's 18 leave most blocks at addresses no wide load can start from, and a
thread that reads the quants of a block must also find its scale a few bytes away. The decode
GEMVs (gguf_gemv.py) want one thing: each thread loading 16 contiguous bytes of quants, a warp
reading whole 128-byte lines, and the scales somewhere they can gather from L1. So each row is
regrouped, byte for byte, into PLANES: for every field of a block (table below), the field of all
K / block_elems blocks of the row, one after the other; quant planes first, so they start at the
row's start, 16-byte aligned whenever the row length is.

    type  planes (bytes per block, in row order)   T: 16-byte chunks transposed
    Q8_0  qs 32 T | d 2                             TH: and in the order 0 2 4 6 1 3 5 7
    Q4_0  qs 16 T | d 2                             TQ: and in the order 0 1 4 5 2 3 6 7
    Q4_1  qs 16 T | d 2 | m 2                       S6: the 16 scales in the order of TQ's
    Q4_K  qs 128 TH | d, dmin, scales 16                threads (below)
    Q5_K  qs 128 TH | qh 32 T | d, dmin, scales 16
    Q6_K  ql 128 TQ | qh 64 T | scales 16 S6 | d 2

Inside a quant plane every 16-byte chunk is also transposed as a 4 x 4 byte matrix: byte
4 * w + b of the chunk (byte b of 32-bit word w) holds the file's byte 4 * b + w. A thread that
holds the chunk as four words then finds, at byte position b of its words, four CONSECUTIVE file
bytes 4b .. 4b + 3, so the activations it multiplies them with are one contiguous load, and one
shift of a word lines up the same byte of all four. The chunk orders put the two chunks one GEMV
thread reads 64 bytes apart, so that the four threads of a row read 64 contiguous bytes per load
instruction: Q4_K / Q5_K keep sub-blocks 2g and 2g + 1 in the 32 bytes 32g .. 32g + 31 (chunks
2g and 2g + 1), and a thread takes both chunks of one g, so that it decodes their scales once
(TH: the first halves of the four pairs ahead of the second halves). A Q6_K thread takes the
16 weights l = 16 lh .. 16 lh + 15 of half n in all four quarters (h = 2n + lh): ql chunks
4n + lh (quarters 0 and 2) and 4n + 2 + lh (quarters 1 and 3), which TQ moves to h and 4 + h, and
qh chunk h (its four 2-bit fields); S6 puts the thread's four scales (sub-blocks 8n + 2i + lh,
i = 0..3) in its own 4-byte word h.

The row keeps its length (row_bytes: memory stays the file's size) and its order of rows, so row
gathers (the embedding lookup) and row concatenations (fused QKV) work on it unchanged. F32, F16
and BF16 matrices are not regrouped.
"""

from __future__ import annotations

import torch

from tinypaged.kernels.gguf_format import DENSE_TYPES, ggml_type, row_bytes


def _transposed(size: int) -> list[int]:
    # 16-byte chunks as 4 x 4 byte matrices, transposed: position 4w + b <- file byte 4b + w
    return [p // 16 * 16 + p % 4 * 4 + p % 16 // 4 for p in range(size)]


def _chunks_in_order(order: tuple[int, ...]) -> list[int]:
    # 16-byte chunk j of the plane <- the file's chunk order[j], then transposed
    return [order[p // 16] * 16 + p % 16 for p in _transposed(16 * len(order))]


PLAIN, T = None, "T"
TH = _chunks_in_order((0, 2, 4, 6, 1, 3, 5, 7))
TQ = _chunks_in_order((0, 1, 4, 5, 2, 3, 6, 7))
S6 = [8 * (p // 8) + 2 * (p % 4) + p // 4 % 2 for p in range(16)]  # word h, byte i <- 8n + 2i + lh
# type id -> the planes, in row order: (first byte of the field in a file block, bytes, order:
# position p of the block's field holds the field's byte order[p]; None: as in the file)
PLANES = {
    8: ((2, 32, T), (0, 2, PLAIN)),
    2: ((2, 16, T), (0, 2, PLAIN)),
    3: ((4, 16, T), (0, 2, PLAIN), (2, 2, PLAIN)),
    12: ((16, 128, TH), (0, 16, PLAIN)),
    13: ((48, 128, TH), (16, 32, T), (0, 16, PLAIN)),
    14: ((0, 128, TQ), (128, 64, T), (192, 16, S6), (208, 2, PLAIN)),
}


def _order(kind, size: int) -> torch.Tensor | None:
    if kind is None:
        return None
    return torch.tensor(_transposed(size) if kind == T else kind)


def _check(qweight: torch.Tensor, type_id: int, K: int) -> int:
    t = ggml_type(type_id)
    if qweight.dim() != 2 or qweight.shape[1] != row_bytes(type_id, K):
        raise ValueError(f"a {t.name} matrix with K={K} is uint8 [N, {row_bytes(type_id, K)}]; "
                         f"got {list(qweight.shape)}")
    return K // t.block_elems


def to_device_layout(qweight: torch.Tensor, type_id: int, K: int) -> torch.Tensor:
    """File rows uint8 [N, row_bytes] -> the same bytes in planes [N, row_bytes]."""
    if type_id in DENSE_TYPES:
        return qweight
    nb = _check(qweight, type_id, K)
    blocks = qweight.reshape(qweight.shape[0], nb, -1)  # [N, nb, block_bytes]
    planes = []
    for start, size, kind in PLANES[type_id]:
        plane = blocks[..., start : start + size]  # [N, nb, size]
        order = _order(kind, size)
        if order is not None:
            plane = plane[..., order.to(plane.device)]
        planes.append(plane.reshape(qweight.shape[0], nb * size))
    return torch.cat(planes, dim=1)


def to_file_layout(qweight: torch.Tensor, type_id: int, K: int) -> torch.Tensor:
    """The inverse of to_device_layout: planes [N, row_bytes] -> file rows [N, row_bytes]."""
    if type_id in DENSE_TYPES:
        return qweight
    nb = _check(qweight, type_id, K)
    N = qweight.shape[0]
    blocks = qweight.new_empty(N, nb, ggml_type(type_id).block_bytes)
    offset = 0
    for start, size, kind in PLANES[type_id]:
        plane = qweight[:, offset : offset + nb * size].reshape(N, nb, size)
        order = _order(kind, size)
        if order is not None:
            plane = plane[..., torch.argsort(order).to(plane.device)]
        blocks[..., start : start + size] = plane
        offset += nb * size
    return blocks.reshape(N, -1)
