"""GGUF Q4_K / Q6_K decode for 2 to 16 rows, one tensor-core product per sub-block:
y [M, N] = x [M, K] @ W^T, W in the device layout (gguf_layout.py).

A k-quant super-block of 256 weights a row holds sub-blocks (Q4_K: 8 of 32 weights, Q6_K: 16 of
16), each with its own scale and, in Q4_K, min: w = s[n, j] q + mn[n, j], with
s = d sc_j, mn = -dmin m_j (Q4_K, q in 0..15) or s = d sc_j, mn = -32 s (Q6_K, q in 0..63). As in
gguf_rows.py the product is computed transposed, y^T [BLOCK_N, BLOCK_M] = W x^T, the weights in
the M slot of tl.dot and x^T, padded to BLOCK_M = 8 or 16 columns, in the N slot. The difference
is the operand: here it is one sub-block, a [BLOCK_N, 32] (Q4_K) or [BLOCK_N, 16] (Q6_K) tile
elementwise from the bytes as loaded (no reshape between the load and the product), so its
scale and min are one number a row, [BLOCK_N, 1], and the tile can reach the MMA from
registers. Two ways to apply them (scale_w):

- scale_w (scales in the weights): the operand is w itself, in x's dtype, and every product
  accumulates in place: acc = tl.dot(w_j, x_j^T, acc). On the GPU the 4-bit types convert two
  weights a PTX instruction (bf16x2 / f16x2): the nibbles of two bytes side by side (prmt),
  ORed into the bits of OFFSET (OFFSET + q exactly), minus OFFSET (exact), then one paired FMA
  with s and mn (rounded once, as dequantize + cuBLAS rounds W).
- raw (the scales on the products): the operand is OFFSET + q, exact in 16 bits, and each
  product is scaled per row in fp32,

      y^T[n, m] += s[n, j] P_j[n, m] + (mn[n, j] - OFFSET s[n, j]) xs_j[m],
      P_j = sum_{k in j} (OFFSET + q[n, k]) x[m, k],  xs_j[m] = sum_{k in j} x[m, k],

  so that a weight costs its bit operations only, and the scaling one FMA pair per (row, row of
  x, sub-block).

The per-step scale fields load as 32-bit words (Q4_K: d|dmin and the 12 scale bytes, one 16-byte
header; Q6_K: 4 int8 scales a word, d in half a word), so that the pipeline can copy them ahead
with the quants; this needs rows of a multiple of 4 bytes (Q6_K: an even number of super-blocks
a row, subdot_supported). K is split as in gguf_rows (split_k.py).
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import cdiv, dot_precision, interpreting, jit, next_power_of_2, tl
from tinypaged.kernels.awq_unpack import MAGIC16
from tinypaged.kernels.gguf_format import check_qweight, gguf_dequantize_reference
from tinypaged.kernels.gguf_layout import to_file_layout
from tinypaged.kernels.gguf_rows import _chunk_pos, _weights
from tinypaged.kernels.split_k import (
    programs_target,
    split_k_finish,
    split_k_range,
    split_k_workspace,
)

SUBDOT_TYPES = (12, 14)  # Q4_K, Q6_K
SUBDOT_MAX_M = 16


def _nibble_asm(high: int, scale_w: bool, magic: int) -> str:
    # PTX: 4 bytes packed in $2 -> 4 16-bit floats in $0 (bytes 0, 1) and $1 (bytes 2, 3):
    # nibble `high` of each byte, as OFFSET + q (raw), or s q + mn with s in $3 $4 and mn in
    # $5 $6 (scale_w; both as pairs). prmt puts bytes 2p and 2p + 1 in the two 16-bit halves,
    # lop3 keeps their nibble and ORs in OFFSET's bits
    one, neg = {0x4300: (0x3F803F80, 0xC300C300), 0x6400: (0x3C003C00, 0xE400E400)}[magic]
    kind = "bf16x2" if magic == 0x4300 else "f16x2"
    lines = [f"{{ .reg .b32 t, m, one, neg; mov.b32 m, {magic << 16 | magic:#x}; "
             f"mov.b32 one, {one:#x}; mov.b32 neg, {neg:#x};"]
    for p in range(2):
        lines.append(f"prmt.b32 t, $2, $2, {0x1100 + 0x2222 * p:#x};")
        if high:
            lines.append("shr.u32 t, t, 4;")
        if scale_w:
            lines.append("lop3.b32 t, t, 0x000F000F, m, 0xEA;")
            lines.append(f"fma.rn.{kind} t, t, one, neg;")  # q, exactly
            lines.append(f"fma.rn.{kind} ${p}, t, ${3 + p}, ${5 + p};")
        else:
            lines.append(f"lop3.b32 ${p}, t, 0x000F000F, m, 0xEA;")
    return " ".join(lines) + " }"


NIBBLE_ASM = tl.constexpr({(high, scale_w, magic): _nibble_asm(high, scale_w, magic)
                           for high in (0, 1) for scale_w in (False, True)
                           for magic in (0x4300, 0x6400)})


@jit
def _x_t(x_ptr, stride_xm, M, k, BLOCK_M: tl.constexpr):
    # x^T [T, BLOCK_M] at the K indices k [T, 1] (rows of x past M: zero)
    m = tl.arange(0, BLOCK_M)[None, :]
    return tl.load(x_ptr + m * stride_xm + k, mask=m < M, other=0.0)


@jit
def _f16_half(word, HALF):
    # the fp16 in half HALF (0: bits 0-15) of an int32 word, as fp32
    return ((word >> (16 * HALF)) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(
        tl.float32)


@jit
def _sub_dot(acc, q, qs, s, mn, xt, BITS: tl.constexpr, HIGH: tl.constexpr,
             SCALE_W: tl.constexpr, MAGIC16: tl.constexpr, OFFSET: tl.constexpr,
             ASM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # acc [BN, BM] + (s q + mn) @ x^T for one sub-block: q int32 [BN, T] in 0 .. 2**BITS - 1
    # (portable), or with ASM the uint8 bytes qs [BN, T] whose nibble HIGH is q; s, mn fp32
    # [BN, 1]; x^T [T, BM]
    DTYPE: tl.constexpr = xt.dtype
    if SCALE_W:
        if ASM:
            w = tl.inline_asm_elementwise(
                NIBBLE_ASM[(HIGH, True, MAGIC16)], "=r,=r,r,r,r,r,r",
                [qs, tl.broadcast_to(s.to(DTYPE), qs.shape),
                 tl.broadcast_to(mn.to(DTYPE), qs.shape)],
                dtype=xt.dtype, is_pure=True, pack=4)
        else:
            w = _weights(q, s, mn, BITS, DTYPE)
        return tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
    if ASM:
        w = tl.inline_asm_elementwise(NIBBLE_ASM[(HIGH, False, MAGIC16)], "=r,=r,r", [qs],
                                      dtype=xt.dtype, is_pure=True, pack=4)
    elif MAGIC16:
        w = (q | MAGIC16).to(tl.int16).to(DTYPE, bitcast=True)  # OFFSET + q, exactly
    else:
        w = q.to(tl.float32)
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
def _q4_k_step(acc, x_ptr, u8_ptr, i32_ptr, row, nb, step, stride_xm, M,
               BLOCK_M: tl.constexpr, SCALE_W: tl.constexpr, MAGIC16: tl.constexpr,
               OFFSET: tl.constexpr, ASM: tl.constexpr, DOT_PRECISION: tl.constexpr):
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
    t = tl.arange(0, 32)[None, :]
    i = tl.arange(0, 32)[:, None]
    for g in tl.static_range(4):
        qs = tl.load(u8_ptr + row + step * 128 + t // 16 * 64 + g * 16 + t % 16)  # [BN, 32]
        k = step * 256 + 64 * g + i // 16 * 16 + _chunk_pos(i % 16)  # [32, 1]
        for h in tl.static_range(2):
            sc, mn = _q4_k_scale_min(a, b, c, 2 * g + h)
            q = (qs.to(tl.int32) >> (4 * h)) & 0xF
            acc = _sub_dot(acc, q, qs, d * sc, -dmin * mn,
                           _x_t(x_ptr, stride_xm, M, k + 32 * h, BLOCK_M), 4, h, SCALE_W,
                           MAGIC16, OFFSET, ASM, DOT_PRECISION)
    return acc


@jit
def _q6_k_step(acc, x_ptr, u8_ptr, i32_ptr, row, nb, step, stride_xm, M,
               BLOCK_M: tl.constexpr, SCALE_W: tl.constexpr, MAGIC16: tl.constexpr,
               OFFSET: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # super-block `step`: for h = 2n + lh, ql chunks h (quarters 0, 2: low / high nibble) and
    # 4 + h (quarters 1, 3) of the TQ plane, qh chunk h (quarter i's 2 high bits at bit 2i);
    # sub-block 8n + 2i + lh is weights 128 n + 32 i + 16 lh + _chunk_pos(c), its int8 scale
    # byte i of S6 word h; d the half `step % 2` of word step // 2 at nb * 208
    d = _f16_half(tl.load(i32_ptr + (row + nb * 208) // 4 + step // 2), step % 2)
    c16 = tl.arange(0, 16)[None, :]
    i16 = tl.arange(0, 16)[:, None]
    for h in tl.static_range(4):
        qh = tl.load(u8_ptr + row + nb * 128 + step * 64 + h * 16 + c16).to(tl.int32)
        lo = tl.load(u8_ptr + row + step * 128 + h * 16 + c16).to(tl.int32)
        hi = tl.load(u8_ptr + row + step * 128 + 64 + h * 16 + c16).to(tl.int32)
        scales = tl.load(i32_ptr + (row + nb * 192 + step * 16) // 4 + h)  # [BN, 1]
        for i in tl.static_range(4):
            if i % 2 == 0:
                ql = lo
            else:
                ql = hi
            q = ((ql >> (4 * (i // 2))) & 0xF) | (((qh >> (2 * i)) & 3) << 4)
            s = d * ((scales << (24 - 8 * i)) >> 24).to(tl.float32)  # signed byte i
            k = step * 256 + 128 * (h // 2) + 32 * i + 16 * (h % 2) + _chunk_pos(i16)
            acc = _sub_dot(acc, q, q, s, -32.0 * s, _x_t(x_ptr, stride_xm, M, k, BLOCK_M), 6,
                           0, SCALE_W, MAGIC16, OFFSET, False, DOT_PRECISION)
    return acc


@jit(do_not_specialize=("M", "split_k"))
def _gguf_subdot_kernel(
    x_ptr, u8_ptr, i32_ptr, y_ptr,  # x [M, K]; qweight [N, stride_w] as uint8 and int32; y [M, N]
    partial_ptr, count_ptr,  # fp32 [M, N] and int32 [cdiv(N, BLOCK_N)], zero before and after
    M, N, K, stride_xm, stride_w, split_k,
    QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT: tl.constexpr,
    STAGES: tl.constexpr, SCALE_W: tl.constexpr, MAGIC16: tl.constexpr, OFFSET: tl.constexpr,
    ASM: tl.constexpr, DOT_PRECISION: tl.constexpr,
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
                             SCALE_W, MAGIC16, OFFSET, ASM, DOT_PRECISION)
        else:
            acc = _q6_k_step(acc, x_ptr, u8_ptr, i32_ptr, row, nb, step, stride_xm, M, BLOCK_M,
                             SCALE_W, MAGIC16, OFFSET, DOT_PRECISION)
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
                asm: bool = False) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T in x's dtype, 1 <= M <= SUBDOT_MAX_M, qweight uint8
    [N, row_bytes] of Q4_K or Q6_K (subdot_supported) in the device layout.

    block_n: rows of W per program (16 and up: the MMA's M slot; 64 and up with 4 warps takes
    sm_90's wgmma, below the m16n8k16 MMA); num_stages: super-blocks in flight; split_k:
    programs sharing a row block's K (default: ~programs_per_sm a SM); min_block_m: x^T padded
    to at least this many columns (8 or 16; the interpreter takes 16); scale_w: scales in the
    weights, else on the products (module docstring); asm: Q4_K's nibbles by PTX, two weights
    an instruction (16-bit x on a GPU; the interpreter runs the portable code)."""
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
        ASM=asm and magic != 0 and type_id == 12 and not interpreting(),
        DOT_PRECISION=dot_precision(x.dtype), num_warps=num_warps,
    )
    return y


def gguf_subdot_reference(x: torch.Tensor, qweight: torch.Tensor, type_id: int,
                          **config) -> torch.Tensor:
    """The torch reference of gguf_subdot (same signature; tile settings are ignored): fp32
    products of the dequantized W, the result in x's dtype."""
    K = x.shape[1]
    w = gguf_dequantize_reference(to_file_layout(qweight, type_id, K), type_id, K)
    return (x.float() @ w.T).to(x.dtype)
