"""GGUF Q4_K / Q6_K decode for 2 to 16 rows, one tensor-core product per sub-block:
y [M, N] = x [M, K] @ W^T, W in the device layout (gguf_layout.py).

A k-quant super-block of 256 weights a row holds sub-blocks (Q4_K: 8 of 32 weights, Q6_K: 16 of
16), each with its own scale and, in Q4_K, min: w = s[n, j] q + mn[n, j], with
s = d sc_j, mn = -dmin m_j (Q4_K, q in 0..15) or s = d sc_j, mn = -32 s (Q6_K, q in 0..63). As in
gguf_rows.py the product is computed transposed, y^T [BLOCK_N, BLOCK_M] = W x^T, the weights in
the M slot of tl.dot and x^T, padded to BLOCK_M = 8 or 16 columns, in the N slot. The difference
is the operand: here it is one sub-block, a [BLOCK_N, 32] (Q4_K) or [BLOCK_N, 16] (Q6_K) tile
elementwise from the bytes as loaded (gguf_rows regroups [BLOCK_N 4, 32] sub-rows into
[BLOCK_N, 128], which sent its weights through shared memory in the sm_90 build), so its scale
and min are one number a row, [BLOCK_N, 1], and the tile reaches the MMA from registers. Two
ways to apply them (scale_w):

- scale_w (scales in the weights): the operand is w itself, in x's dtype, and every product
  accumulates in place: acc = tl.dot(w_j, x_j^T, acc). With asm (16-bit x on a GPU) two
  weights go through each PTX instruction (bf16x2 / f16x2): the quant bits of two bytes side by
  side (prmt), ORed into the bits of OFFSET (OFFSET + q exactly), minus OFFSET (exact), then
  one paired FMA with s and mn (rounded once, as dequantize + cuBLAS rounds W).
- raw (the scales on the products): the operand is OFFSET + q, exact in 16 bits, and each
  product is scaled per row in fp32,

      y^T[n, m] += s[n, j] P_j[n, m] + (mn[n, j] - OFFSET s[n, j]) xs_j[m],
      P_j = sum_{k in j} (OFFSET + q[n, k]) x[m, k],  xs_j[m] = sum_{k in j} x[m, k],

  so that a weight costs its bit operations only, and the scaling one FMA pair per (row, row of
  x, sub-block).

On sm_90 every tl.dot with its operand in registers waits for its wgmma before the next one
starts; join (scale_w only) puts a super-block's scaled sub-blocks side by side (tl.join, a
relabelling of registers) into one product of K = 256 a step, one wait instead of 8 (Q4_K) or
16 (Q6_K), at the price of the whole step's weights in registers at once.

The quant planes transpose each 16-byte chunk (gguf_layout.py). With natural (the default) a
loaded tile is relabelled into the file's order by a reshape and permute (in the sm_90 build:
no data moved for Q4_K's 32-byte tiles, a few warp shuffles for Q6_K's 16-byte ones), so that
x^T is a contiguous load which the pipeline copies ahead with the quants; without it x^T is
gathered in the plane's order (2-byte loads that wait in every sub-block).
The per-step scale fields load as 32-bit words (Q4_K: d|dmin and the 12 scale bytes, one 16-byte
header; Q6_K: 4 int8 scales a word, d in half a word), so that the pipeline can copy them ahead
with the quants; this needs rows of a multiple of 4 bytes (Q6_K: an even number of super-blocks
a row, subdot_supported). K is split as in gguf_rows (split_k.py).
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import cdiv, dot_precision, interpreting, jit, next_power_of_2, tl
from tinypaged.kernels.awq_unpack import MAGIC16
from tinypaged.kernels.gguf_format import check_qweight
from tinypaged.kernels.gguf_rows import _chunk_pos, _weights, gguf_rows_reference
from tinypaged.kernels.split_k import (
    programs_target,
    split_k_finish,
    split_k_range,
    split_k_workspace,
)

SUBDOT_TYPES = (12, 14)  # Q4_K, Q6_K
SUBDOT_MAX_M = 16


def _half2(value: float, magic: int) -> int:
    # the bits of `value` in both 16-bit halves of a register, as bf16 (magic 0x4300) or fp16
    bits = torch.tensor([value], dtype=torch.bfloat16 if magic == 0x4300 else torch.float16)
    half = bits.view(torch.int16).item() & 0xFFFF
    return half << 16 | half


def _quant_asm(kind: int, scale_w: bool, magic: int) -> str:
    # PTX: 4 quant bytes packed in $2 (Q6_K: and their qh bytes in $3) -> 4 16-bit floats in $0
    # (bytes 0, 1) and $1 (bytes 2, 3), OFFSET + q (raw) or s q + mn (scale_w, s and mn as
    # pairs in the next registers). kind 0 / 1: Q4_K's low / high nibble; 2 + i: Q6_K quarter
    # i (nibble i // 2 of ql, bits 2i, 2i + 1 of qh). A pair: prmt puts bytes 2p and 2p + 1
    # in the two 16-bit halves, lop3 keeps the quant bits and ORs in OFFSET's
    q6 = kind >= 2
    i = kind - 2
    high = kind == 1 or i >= 2
    neg = _half2(-{0x4300: 128.0, 0x6400: 1024.0}[magic], magic)
    first = 4 if q6 else 3  # s, then mn
    fma = "fma.rn." + ("bf16x2" if magic == 0x4300 else "f16x2")
    lines = [f"{{ .reg .b32 t, u, m, one, neg; mov.b32 m, {magic << 16 | magic:#x}; "
             f"mov.b32 one, {_half2(1.0, magic):#x}; mov.b32 neg, {neg:#x};"]
    for p in range(2):
        sel = f"{0x1100 + 0x2222 * p:#x}"
        out = "t" if scale_w else f"${p}"
        lines.append(f"prmt.b32 t, $2, $2, {sel};")
        if high:
            lines.append("shr.u32 t, t, 4;")
        if q6:  # qh's bits 2i, 2i + 1 to bits 4, 5, ORed with OFFSET's bits, then the nibble
            lines.append(f"prmt.b32 u, $3, $3, {sel};")
            if i != 2:
                lines.append(f"shl.b32 u, u, {4 - 2 * i};" if i < 2 else "shr.u32 u, u, 2;")
            lines.append("lop3.b32 u, u, 0x00300030, m, 0xEA;")
            lines.append(f"lop3.b32 {out}, t, 0x000F000F, u, 0xEA;")
        else:
            lines.append(f"lop3.b32 {out}, t, 0x000F000F, m, 0xEA;")
        if scale_w:  # q exactly, then s q + mn rounded once
            lines.append(f"{fma} t, t, one, neg;")
            lines.append(f"{fma} ${p}, t, ${first + p}, ${first + 2 + p};")
    return " ".join(lines) + " }"


QUANT_ASM = tl.constexpr({(kind, scale_w, magic): _quant_asm(kind, scale_w, magic)
                          for kind in range(6)
                          for scale_w in (False, True) for magic in (0x4300, 0x6400)})


@jit
def _x_t(x_ptr, stride_xm, M, k, BLOCK_M: tl.constexpr):
    # x^T [T, BLOCK_M] at the K indices k [T, 1] (rows of x past M: zero)
    m = tl.arange(0, BLOCK_M)[None, :]
    return tl.load(x_ptr + m * stride_xm + k, mask=m < M, other=0.0)


@jit
def _file_order(qs, NATURAL: tl.constexpr):
    # quant bytes [BN, T] of transposed 16-byte chunks (position 4w + b holds the file's byte
    # 4b + w) in the file's order when NATURAL: as [BN, T / 16, w, b] with the last two axes
    # swapped: a change of the tile's layout (the module docstring says what it cost on sm_90),
    # after which x^T is a contiguous load that the pipeline copies ahead with the quants
    if NATURAL:
        BN: tl.constexpr = qs.shape[0]
        T: tl.constexpr = qs.shape[1]
        qs = tl.reshape(tl.permute(tl.reshape(qs, (BN, T // 16, 4, 4)), (0, 1, 3, 2)), (BN, T))
    return qs


@jit
def _k_order(i, NATURAL: tl.constexpr):
    # the weight (within its 16-byte chunks) of column i of a _file_order tile
    if NATURAL:
        return i
    return i // 16 * 16 + _chunk_pos(i % 16)


@jit
def _f16_half(word, HALF):
    # the fp16 in half HALF (0: bits 0-15) of an int32 word, as fp32
    return ((word >> (16 * HALF)) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(
        tl.float32)


@jit
def _operand(q, qs, qh, s, mn, xt, KIND: tl.constexpr, BITS: tl.constexpr,
             SCALE_W: tl.constexpr, MAGIC16: tl.constexpr, ASM: tl.constexpr):
    # a sub-block's operand [BN, T] in x^T's dtype: s q + mn (SCALE_W) or OFFSET + q. From
    # q int32 [BN, T] in 0 .. 2**BITS - 1; ASM: from the uint8 bytes qs (and Q6_K's qh) by
    # QUANT_ASM[KIND]; s, mn fp32 [BN, 1]
    if ASM:
        if SCALE_W:
            pairs = [tl.broadcast_to(s.to(xt.dtype), qs.shape),
                     tl.broadcast_to(mn.to(xt.dtype), qs.shape)]
        else:
            pairs = []
        if BITS == 6:
            w = tl.inline_asm_elementwise(
                QUANT_ASM[(KIND, SCALE_W, MAGIC16)], "=r,=r,r,r" + ",r,r,r,r" * SCALE_W,
                [qs, qh] + pairs, dtype=xt.dtype, is_pure=True, pack=4)
        else:
            w = tl.inline_asm_elementwise(
                QUANT_ASM[(KIND, SCALE_W, MAGIC16)], "=r,=r,r" + ",r,r,r,r" * SCALE_W,
                [qs] + pairs, dtype=xt.dtype, is_pure=True, pack=4)
    elif SCALE_W:
        w = _weights(q, s, mn, BITS, xt.dtype)
    elif MAGIC16:
        w = (q | MAGIC16).to(tl.int16).to(xt.dtype, bitcast=True)  # OFFSET + q, exactly
    else:
        w = q.to(tl.float32)
    return w


@jit
def _sub_dot(acc, w, s, mn, xt, SCALE_W: tl.constexpr, OFFSET: tl.constexpr,
             DOT_PRECISION: tl.constexpr):
    # acc [BN, BM] + (s q + mn) @ x^T for one sub-block, w its _operand [BN, T], x^T [T, BM]
    if SCALE_W:
        return tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
    p = tl.dot(w, xt, input_precision=DOT_PRECISION)  # [BN, BM] fp32
    xs = tl.sum(xt.to(tl.float32), axis=0)[None, :]  # [1, BM]
    return acc + s * p + (mn - OFFSET * s) * xs


@jit
def _q4_k_scale_min(a, b, c, J: tl.constexpr):
    # the 6-bit scale and min of sub-block J from the scale words a, b, c (bytes 0-3, 4-7, 8-11
    # of the 12; gguf_format.k_scale_min), as fp32
    SH: tl.constexpr = 8 * (J % 4)
    if J < 4:
        sc = (a >> SH) & 63
        mn = (b >> SH) & 63
    else:
        sc = ((c >> SH) & 0xF) | (((a >> (SH + 6)) & 3) << 4)
        mn = ((c >> (SH + 4)) & 0xF) | (((b >> (SH + 6)) & 3) << 4)
    return sc.to(tl.float32), mn.to(tl.float32)


@jit
def _cat(a, b):
    # [BN, T] and [BN, T] -> [BN, 2T], a's columns then b's (a relabelling of registers)
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (a.shape[0], 2 * a.shape[1]))


@jit
def _q4_k_pair(u8_ptr, row, step, g: tl.constexpr, a, b, c, d, dmin, xt, MAGIC16: tl.constexpr,
               ASM: tl.constexpr, NATURAL: tl.constexpr):
    # the scaled weights [BN, 64] of sub-blocks 2g and 2g + 1 (the low and the high nibbles of
    # the pair's 32 bytes), columns in _k_order; xt only gives the dtype
    t = tl.arange(0, 32)[None, :]
    qs = _file_order(tl.load(u8_ptr + row + step * 128 + t // 16 * 64 + g * 16 + t % 16),
                     NATURAL)
    sc, mn = _q4_k_scale_min(a, b, c, 2 * g)
    lo = _operand(qs.to(tl.int32) & 0xF, qs, qs, d * sc, -dmin * mn, xt, 0, 4, True, MAGIC16,
                  ASM)
    sc, mn = _q4_k_scale_min(a, b, c, 2 * g + 1)
    hi = _operand(qs.to(tl.int32) >> 4, qs, qs, d * sc, -dmin * mn, xt, 1, 4, True, MAGIC16,
                  ASM)
    return _cat(lo, hi)


@jit
def _q4_k_step(acc, x_ptr, u8_ptr, i32_ptr, row, nb, step, stride_xm, M,
               BLOCK_M: tl.constexpr, SCALE_W: tl.constexpr, MAGIC16: tl.constexpr,
               OFFSET: tl.constexpr, ASM: tl.constexpr, DOT_PRECISION: tl.constexpr,
               NATURAL: tl.constexpr, JOIN: tl.constexpr):
    # super-block `step` of the rows whose first byte is row [BN, 1]. TH plane: the 32 bytes of
    # pair g are plane bytes 64 a + 16 g + c (a = 0, 1), weights 64 g + 16 a + _chunk_pos(c) of
    # sub-blocks 2g (low nibble) and 2g + 1 (high, 32 weights on); header words d|dmin, then
    # the 12 scale bytes
    hdr = (row + nb * 128 + step * 16) // 4  # [BN, 1], int32 words
    h0 = tl.load(i32_ptr + hdr)
    a = tl.load(i32_ptr + hdr + 1)
    b = tl.load(i32_ptr + hdr + 2)
    c = tl.load(i32_ptr + hdr + 3)
    d, dmin = _f16_half(h0, 0), _f16_half(h0, 1)
    if JOIN:  # one product of K = 256: the 8 scaled sub-blocks side by side
        xt = _x_t(x_ptr, stride_xm, M, step * 256 + _k_order(tl.arange(0, 256)[:, None], NATURAL),
                  BLOCK_M)
        w = _cat(_cat(_q4_k_pair(u8_ptr, row, step, 0, a, b, c, d, dmin, xt, MAGIC16, ASM,
                                 NATURAL),
                      _q4_k_pair(u8_ptr, row, step, 1, a, b, c, d, dmin, xt, MAGIC16, ASM,
                                 NATURAL)),
                 _cat(_q4_k_pair(u8_ptr, row, step, 2, a, b, c, d, dmin, xt, MAGIC16, ASM,
                                 NATURAL),
                      _q4_k_pair(u8_ptr, row, step, 3, a, b, c, d, dmin, xt, MAGIC16, ASM,
                                 NATURAL)))
        return tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
    t = tl.arange(0, 32)[None, :]
    i = tl.arange(0, 32)[:, None]
    for g in tl.static_range(4):
        qs = tl.load(u8_ptr + row + step * 128 + t // 16 * 64 + g * 16 + t % 16)  # [BN, 32]
        k = step * 256 + 64 * g + _k_order(i, NATURAL)  # [32, 1]
        qs = _file_order(qs, NATURAL)
        for h in tl.static_range(2):
            sc, mn = _q4_k_scale_min(a, b, c, 2 * g + h)
            s, mn = d * sc, -dmin * mn
            xt = _x_t(x_ptr, stride_xm, M, k + 32 * h, BLOCK_M)
            w = _operand((qs.to(tl.int32) >> (4 * h)) & 0xF, qs, qs, s, mn, xt, h, 4,
                         SCALE_W, MAGIC16, ASM)
            acc = _sub_dot(acc, w, s, mn, xt, SCALE_W, OFFSET, DOT_PRECISION)
    return acc


@jit
def _q6_k_quant(lo, hi, qh, i: tl.constexpr):
    # Q6_K's q [BN, 16] int32 of quarter i: nibble i // 2 of ql (chunk lo for even i, hi for
    # odd), bits 2i, 2i + 1 of qh as bits 4, 5; and the ql bytes it came from
    if i % 2 == 0:
        ql = lo
    else:
        ql = hi
    q = ((ql.to(tl.int32) >> (4 * (i // 2))) & 0xF) | (((qh.to(tl.int32) >> (2 * i)) & 3) << 4)
    return q, ql


@jit
def _q6_k_quarters(u8_ptr, i32_ptr, row, nb, step, d, h: tl.constexpr, xt,
                   MAGIC16: tl.constexpr, ASM: tl.constexpr, NATURAL: tl.constexpr):
    # the scaled weights [BN, 64] of the sub-blocks 8n + 2i + lh (h = 2n + lh) of quarters
    # i = 0..3 side by side: column 16 i + c is weight 128 n + 32 i + 16 lh + _k_order(c);
    # xt only gives the dtype
    c16 = tl.arange(0, 16)[None, :]
    qh = _file_order(tl.load(u8_ptr + row + nb * 128 + step * 64 + h * 16 + c16), NATURAL)
    lo = _file_order(tl.load(u8_ptr + row + step * 128 + h * 16 + c16), NATURAL)
    hi = _file_order(tl.load(u8_ptr + row + step * 128 + 64 + h * 16 + c16), NATURAL)
    scales = tl.load(i32_ptr + (row + nb * 192 + step * 16) // 4 + h)  # [BN, 1]
    s0 = d * ((scales << 24) >> 24).to(tl.float32)  # signed byte i
    s1 = d * ((scales << 16) >> 24).to(tl.float32)
    s2 = d * ((scales << 8) >> 24).to(tl.float32)
    s3 = d * (scales >> 24).to(tl.float32)
    q0, ql0 = _q6_k_quant(lo, hi, qh, 0)
    q1, ql1 = _q6_k_quant(lo, hi, qh, 1)
    q2, ql2 = _q6_k_quant(lo, hi, qh, 2)
    q3, ql3 = _q6_k_quant(lo, hi, qh, 3)
    return _cat(_cat(_operand(q0, ql0, qh, s0, -32.0 * s0, xt, 2, 6, True, MAGIC16, ASM),
                     _operand(q1, ql1, qh, s1, -32.0 * s1, xt, 3, 6, True, MAGIC16, ASM)),
                _cat(_operand(q2, ql2, qh, s2, -32.0 * s2, xt, 4, 6, True, MAGIC16, ASM),
                     _operand(q3, ql3, qh, s3, -32.0 * s3, xt, 5, 6, True, MAGIC16, ASM)))


@jit
def _q6_k_step(acc, x_ptr, u8_ptr, i32_ptr, row, nb, step, stride_xm, M,
               BLOCK_M: tl.constexpr, SCALE_W: tl.constexpr, MAGIC16: tl.constexpr,
               OFFSET: tl.constexpr, ASM: tl.constexpr, DOT_PRECISION: tl.constexpr,
               NATURAL: tl.constexpr, JOIN: tl.constexpr):
    # super-block `step`: for h = 2n + lh, ql chunks h (quarters 0, 2: low / high nibble) and
    # 4 + h (quarters 1, 3) of the TQ plane, qh chunk h (quarter i's 2 high bits at bit 2i);
    # sub-block 8n + 2i + lh is weights 128 n + 32 i + 16 lh + _chunk_pos(c), its int8 scale
    # byte i of S6 word h; d the half `step % 2` of word step // 2 at nb * 208
    d = _f16_half(tl.load(i32_ptr + (row + nb * 208) // 4 + step // 2), step % 2)
    if JOIN:  # one product of K = 256: column 64 h + 16 i + c (_q6_k_quarters)
        col = tl.arange(0, 256)[:, None]
        h, i, c = col // 64, col % 64 // 16, col % 16
        xt = _x_t(x_ptr, stride_xm, M, step * 256 + 128 * (h // 2) + 32 * i + 16 * (h % 2)
                  + _k_order(c, NATURAL), BLOCK_M)
        w = _cat(_cat(_q6_k_quarters(u8_ptr, i32_ptr, row, nb, step, d, 0, xt, MAGIC16, ASM,
                                     NATURAL),
                      _q6_k_quarters(u8_ptr, i32_ptr, row, nb, step, d, 1, xt, MAGIC16, ASM,
                                     NATURAL)),
                 _cat(_q6_k_quarters(u8_ptr, i32_ptr, row, nb, step, d, 2, xt, MAGIC16, ASM,
                                     NATURAL),
                      _q6_k_quarters(u8_ptr, i32_ptr, row, nb, step, d, 3, xt, MAGIC16, ASM,
                                     NATURAL)))
        return tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
    c16 = tl.arange(0, 16)[None, :]
    i16 = tl.arange(0, 16)[:, None]
    for h in tl.static_range(4):
        qh = _file_order(tl.load(u8_ptr + row + nb * 128 + step * 64 + h * 16 + c16), NATURAL)
        lo = _file_order(tl.load(u8_ptr + row + step * 128 + h * 16 + c16), NATURAL)
        hi = _file_order(tl.load(u8_ptr + row + step * 128 + 64 + h * 16 + c16), NATURAL)
        scales = tl.load(i32_ptr + (row + nb * 192 + step * 16) // 4 + h)  # [BN, 1]
        for i in tl.static_range(4):
            q, ql = _q6_k_quant(lo, hi, qh, i)
            s = d * ((scales << (24 - 8 * i)) >> 24).to(tl.float32)  # signed byte i
            k = step * 256 + 128 * (h // 2) + 32 * i + 16 * (h % 2) + _k_order(i16, NATURAL)
            xt = _x_t(x_ptr, stride_xm, M, k, BLOCK_M)
            w = _operand(q, ql, qh, s, -32.0 * s, xt, 2 + i, 6, SCALE_W, MAGIC16, ASM)
            acc = _sub_dot(acc, w, s, -32.0 * s, xt, SCALE_W, OFFSET, DOT_PRECISION)
    return acc


@jit(do_not_specialize=("M", "split_k"))
def _gguf_subdot_kernel(
    x_ptr, u8_ptr, i32_ptr, y_ptr,  # x [M, K]; qweight [N, stride_w] as uint8 and int32; y [M, N]
    partial_ptr, count_ptr,  # fp32 [M, N] and int32 [cdiv(N, BLOCK_N)], zero before and after
    M, N, K, stride_xm, stride_w, split_k,
    QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT: tl.constexpr,
    STAGES: tl.constexpr, SCALE_W: tl.constexpr, MAGIC16: tl.constexpr, OFFSET: tl.constexpr,
    ASM: tl.constexpr, DOT_PRECISION: tl.constexpr, NATURAL: tl.constexpr, JOIN: tl.constexpr,
):
    # grid: (cdiv(N, BLOCK_N), split_k); program (n, s) sums super-blocks split_k_range(.., s)
    # of y[:, n * BLOCK_N : (n + 1) * BLOCK_N]
    pid_n = tl.program_id(0)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # rows past N read row n % N (in bounds, unmasked loads) and are not stored
    row = ((rows % N).to(tl.int64) * stride_w)[:, None]  # [BN, 1]: each row's first byte
    nb = K // 256
    first, last = split_k_range(nb, split_k)
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)  # y^T
    for step in tl.range(first, last, num_stages=STAGES):
        if QTYPE == 12:
            acc = _q4_k_step(acc, x_ptr, u8_ptr, i32_ptr, row, nb, step, stride_xm, M, BLOCK_M,
                             SCALE_W, MAGIC16, OFFSET, ASM, DOT_PRECISION, NATURAL, JOIN)
        else:
            acc = _q6_k_step(acc, x_ptr, u8_ptr, i32_ptr, row, nb, step, stride_xm, M, BLOCK_M,
                             SCALE_W, MAGIC16, OFFSET, ASM, DOT_PRECISION, NATURAL, JOIN)
    m = tl.arange(0, BLOCK_M)[None, :]
    at = m * N + rows[:, None]  # y[m, n], [BN, BM]
    mask = (rows < N)[:, None] & (m < M)
    if not SPLIT:
        tl.store(y_ptr + at, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(partial_ptr + at, acc, mask=mask, sem="acq_rel")  # as gguf_rows'
        split_k_finish(y_ptr, partial_ptr, count_ptr, pid_n, split_k, at, mask)


def subdot_supported(type_id: int, K: int) -> bool:
    """Whether gguf_subdot takes this type and row length: Q4_K, or Q6_K with an even number of
    super-blocks a row (its 210-byte blocks then keep rows 4-byte aligned)."""
    return ((type_id == 12 and K % 256 == 0) or (type_id == 14 and K % 512 == 0)) and K > 0


def gguf_subdot(x: torch.Tensor, qweight: torch.Tensor, type_id: int, block_n: int = 64,
                num_warps: int = 4, num_stages: int = 3, split_k: int | None = None,
                programs_per_sm: int = 4, min_block_m: int = 8, scale_w: bool = True,
                asm: bool = False, natural: bool = True,
                join: bool = False) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T in x's dtype, 1 <= M <= SUBDOT_MAX_M, qweight uint8
    [N, row_bytes] of Q4_K or Q6_K (subdot_supported) in the device layout.

    block_n: rows of W per program (16 and up: the MMA's M slot; 64 and up with 4 warps takes
    sm_90's wgmma, below the m16n8k16 MMA); num_stages: super-blocks in flight; split_k:
    programs sharing a row block's K (default: ~programs_per_sm a SM); min_block_m: x^T padded
    to at least this many columns (8 or 16; the interpreter takes 16); scale_w: scales in the
    weights, else on the products (module docstring); asm: the quants by PTX, two weights
    an instruction (16-bit x on a GPU; the interpreter runs the portable code); natural: the
    quants relabelled into the file's order and x^T loaded as it lies (else gathered); join:
    one product a super-block (with scale_w)."""
    M, K = x.shape
    N = qweight.shape[0]
    if not 1 <= M <= SUBDOT_MAX_M or not subdot_supported(type_id, K):
        raise ValueError(f"gguf_subdot takes 1..{SUBDOT_MAX_M} rows of x, Q4_K rows of a "
                         f"multiple of 256 weights or Q6_K of 512; got M={M}, type {type_id}, "
                         f"K={K}")
    check_qweight(qweight, type_id, K, "gguf_subdot")
    x, qweight = x.contiguous(), qweight.contiguous()
    if not x.is_cuda:  # the interpreter's tl.dot takes 16 columns and up
        min_block_m = max(min_block_m, 16)
    n_blocks, steps = cdiv(N, block_n), K // 256
    if split_k is None:
        target = programs_target(x.device) * programs_per_sm // 4
        split_k = max(1, min(steps, cdiv(target, n_blocks)))
    split_k = cdiv(steps, cdiv(steps, split_k))  # drop splits that would get no step
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    # sized as gguf_rows' (the same shared workspace), so no batch size reallocates it
    partial, count = split_k_workspace(x.device, SUBDOT_MAX_M * N, cdiv(N, 8))
    magic, offset = MAGIC16[x.dtype]
    _gguf_subdot_kernel[(n_blocks, split_k)](
        x, qweight, qweight.view(torch.int32), y, partial, count,
        M, N, K, x.stride(0), qweight.shape[1], split_k,
        QTYPE=type_id, BLOCK_N=block_n, BLOCK_M=max(min_block_m, next_power_of_2(M)),
        SPLIT=split_k > 1, STAGES=num_stages, SCALE_W=scale_w, MAGIC16=magic, OFFSET=offset,
        ASM=asm and magic != 0 and not interpreting(),
        DOT_PRECISION=dot_precision(x.dtype), NATURAL=natural,
        JOIN=join and scale_w, num_warps=num_warps,
    )
    return y


# The torch reference of gguf_subdot (same signature; tile settings are ignored): gguf_rows'
# product, fp32 products of the dequantized W, the result in x's dtype.
gguf_subdot_reference = gguf_rows_reference
