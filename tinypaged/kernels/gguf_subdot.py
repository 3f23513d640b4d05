"""GGUF Q4_K decode for 2 to 16 rows, one tensor-core product per sub-block:
y [M, N] = x [M, K] @ W^T, W in the device layout (gguf_layout.py).

A Q4_K super-block of 256 weights a row holds 8 sub-blocks of 32, each with its own 6-bit scale
and min: w = s[n, j] q + mn[n, j], s = d sc_j, mn = -dmin m_j, q in 0..15. As in gguf_rows.py
the product is computed transposed, y^T [BLOCK_N, BLOCK_M] = W x^T, the weights in the M slot
of tl.dot and x^T, padded to BLOCK_M = 8 or 16 columns, in the N slot. The difference is the
operand: here it is one sub-block, a [BLOCK_N, 32] tile built elementwise from the bytes as
loaded (gguf_rows regroups [BLOCK_N 4, 32] sub-rows into [BLOCK_N, 128], which sent its weights
through shared memory in the sm_90 build), so its scale and min are one number a row,
[BLOCK_N, 1], and the tile reaches the MMA from registers. The operand is w itself, in x's
dtype, and every product accumulates in place: acc = tl.dot(w_j, x_j^T, acc). With asm (16-bit
x on a GPU) two weights go through each PTX instruction (bf16x2 / f16x2): the nibbles of two
bytes side by side (prmt), ORed into the bits of OFFSET (OFFSET + q exactly), minus OFFSET
(exact), then one paired FMA with s and mn (rounded once, as dequantize + cuBLAS rounds W);
without it (the interpreter, fp32 x, other GPUs) gguf_rows' _weights builds the same w.

On sm_90 every tl.dot with its operand in registers waits for its wgmma before the next one
starts; join puts a super-block's 8 scaled sub-blocks side by side (tl.join, a relabelling of
registers) into one product of K = 256 a step, one wait instead of 8, at the price of the whole
step's weights in registers at once.

The quant planes transpose each 16-byte chunk (gguf_layout.py); a loaded tile is relabelled
into the file's order by a reshape and permute (in the sm_90 build: no data moved for the
32-byte tiles), so that x^T is a contiguous load which the pipeline copies ahead with the
quants. The per-step scale fields load as 32-bit words (d|dmin and the 12 scale bytes, one
16-byte header) for the same reason. K is split as in gguf_rows (split_k.py).

Earlier versions also put the scales on the products (raw quants in the operand), gathered x^T
in the planes' order instead of relabelling the quants, and took Q6_K; each measured slower on
the H200 (benchmarks/gguf_gemv.py --only subdot), so they were dropped.
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import dot_precision, interpreting, jit, tl
from tinypaged.kernels.awq_unpack import MAGIC16
from tinypaged.kernels.gguf_format import check_qweight
from tinypaged.kernels.gguf_rows import _weights, gguf_rows_reference, rows_launch
from tinypaged.kernels.pdl import launch_kwargs, pdl_enabled, pdl_trigger, pdl_wait, prefetch_rows
from tinypaged.kernels.split_k import (
    split_k_finish,
    split_k_range,
)

SUBDOT_MAX_M = 16


def _half2(value: float, magic: int) -> int:
    # the bits of `value` in both 16-bit halves of a register, as bf16 (magic 0x4300) or fp16
    bits = torch.tensor([value], dtype=torch.bfloat16 if magic == 0x4300 else torch.float16)
    half = bits.view(torch.int16).item() & 0xFFFF
    return half << 16 | half


def _quant_asm(high: int, magic: int) -> str:
    # PTX: 4 quant bytes packed in $2 -> 4 16-bit floats s q + mn in $0 (bytes 0, 1) and $1
    # (bytes 2, 3), q the low (high 0) or high nibble, s and mn as pairs in $3, $4 and $5, $6. A
    # pair: prmt puts bytes 2p and 2p + 1 in the two 16-bit halves, lop3 keeps the nibbles and
    # ORs in OFFSET's bits, a paired FMA takes OFFSET off (q exactly), another gives s q + mn
    neg = _half2(-{0x4300: 128.0, 0x6400: 1024.0}[magic], magic)
    fma = "fma.rn." + ("bf16x2" if magic == 0x4300 else "f16x2")
    lines = [f"{{ .reg .b32 t, m, one, neg; mov.b32 m, {magic << 16 | magic:#x}; "
             f"mov.b32 one, {_half2(1.0, magic):#x}; mov.b32 neg, {neg:#x};"]
    for p in range(2):
        lines.append(f"prmt.b32 t, $2, $2, {0x1100 + 0x2222 * p:#x};")
        if high:
            lines.append("shr.u32 t, t, 4;")
        lines.append("lop3.b32 t, t, 0x000F000F, m, 0xEA;")
        lines.append(f"{fma} t, t, one, neg;")
        lines.append(f"{fma} ${p}, t, ${3 + p}, ${5 + p};")
    return " ".join(lines) + " }"


QUANT_ASM = tl.constexpr({(high, magic): _quant_asm(high, magic)
                          for high in (0, 1) for magic in (0x4300, 0x6400)})


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
def _pair_bytes(u8_ptr, row, step, g: tl.constexpr):
    # the 32 bytes [BN, 32] of pair g (sub-blocks 2g: low nibbles, 2g + 1: high) in the file's
    # order. TH plane: they are plane bytes 64 a + 16 g + c (a = 0, 1), each 16-byte chunk
    # transposed (position 4w + b holds the file's byte 4b + w): viewed as [BN, 2, w, b], the
    # last two axes swapped
    t = tl.arange(0, 32)[None, :]
    qs = tl.load(u8_ptr + row + step * 128 + t // 16 * 64 + g * 16 + t % 16)
    BN: tl.constexpr = qs.shape[0]
    return tl.reshape(tl.permute(tl.reshape(qs, (BN, 2, 4, 4)), (0, 1, 3, 2)), (BN, 32))


@jit
def _sub_block(qs, g: tl.constexpr, h: tl.constexpr, a, b, c, d, dmin, xt,
               MAGIC16: tl.constexpr, ASM: tl.constexpr):
    # the scaled weights s q + mn [BN, 32] of sub-block 2g + h (nibble h of the pair's bytes
    # qs), in x^T's dtype (xt only gives it); s, mn fp32 [BN, 1]
    sc, mn = _q4_k_scale_min(a, b, c, 2 * g + h)
    s, mn = d * sc, -dmin * mn
    if ASM:
        return tl.inline_asm_elementwise(
            QUANT_ASM[(h, MAGIC16)], "=r,=r,r,r,r,r,r",
            [qs, tl.broadcast_to(s.to(xt.dtype), qs.shape),
             tl.broadcast_to(mn.to(xt.dtype), qs.shape)],
            dtype=xt.dtype, is_pure=True, pack=4)
    return _weights((qs.to(tl.int32) >> (4 * h)) & 0xF, s, mn, 4, xt.dtype)


@jit
def _cat(a, b):
    # [BN, T] and [BN, T] -> [BN, 2T], a's columns then b's (a relabelling of registers)
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (a.shape[0], 2 * a.shape[1]))


@jit
def _pair(u8_ptr, row, step, g: tl.constexpr, a, b, c, d, dmin, xt, MAGIC16: tl.constexpr,
          ASM: tl.constexpr):
    # the scaled weights [BN, 64] of sub-blocks 2g and 2g + 1 side by side
    qs = _pair_bytes(u8_ptr, row, step, g)
    return _cat(_sub_block(qs, g, 0, a, b, c, d, dmin, xt, MAGIC16, ASM),
                _sub_block(qs, g, 1, a, b, c, d, dmin, xt, MAGIC16, ASM))


@jit
def _q4_k_step(acc, x_ptr, u8_ptr, i32_ptr, row, nb, step, stride_xm, M,
               BLOCK_M: tl.constexpr, MAGIC16: tl.constexpr, ASM: tl.constexpr,
               DOT_PRECISION: tl.constexpr, JOIN: tl.constexpr):
    # acc [BN, BM] + super-block `step` of the rows whose first byte is row [BN, 1]; the header
    # words d|dmin, then the 12 scale bytes
    hdr = (row + nb * 128 + step * 16) // 4  # [BN, 1], int32 words
    h0 = tl.load(i32_ptr + hdr)
    a = tl.load(i32_ptr + hdr + 1)
    b = tl.load(i32_ptr + hdr + 2)
    c = tl.load(i32_ptr + hdr + 3)
    d, dmin = _f16_half(h0, 0), _f16_half(h0, 1)
    if JOIN:  # one product of K = 256: the 8 scaled sub-blocks side by side
        xt = _x_t(x_ptr, stride_xm, M, step * 256 + tl.arange(0, 256)[:, None], BLOCK_M)
        w = _cat(_cat(_pair(u8_ptr, row, step, 0, a, b, c, d, dmin, xt, MAGIC16, ASM),
                      _pair(u8_ptr, row, step, 1, a, b, c, d, dmin, xt, MAGIC16, ASM)),
                 _cat(_pair(u8_ptr, row, step, 2, a, b, c, d, dmin, xt, MAGIC16, ASM),
                      _pair(u8_ptr, row, step, 3, a, b, c, d, dmin, xt, MAGIC16, ASM)))
        return tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
    k = step * 256 + tl.arange(0, 32)[:, None]  # [32, 1]
    for g in tl.static_range(4):
        qs = _pair_bytes(u8_ptr, row, step, g)
        for h in tl.static_range(2):  # sub-block 2g + h: weights 64 g + 32 h on
            xt = _x_t(x_ptr, stride_xm, M, k + 64 * g + 32 * h, BLOCK_M)
            w = _sub_block(qs, g, h, a, b, c, d, dmin, xt, MAGIC16, ASM)
            acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
    return acc


@jit(do_not_specialize=("M", "split_k"))
def _gguf_subdot_kernel(
    x_ptr, u8_ptr, i32_ptr, y_ptr,  # x [M, K]; qweight [N, stride_w] as uint8 and int32; y [M, N]
    partial_ptr, count_ptr,  # fp32 [M, N] and int32 [cdiv(N, BLOCK_N)], zero before and after
    M, N, K, stride_xm, stride_w, split_k,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr,
    MAGIC16: tl.constexpr, ASM: tl.constexpr, DOT_PRECISION: tl.constexpr, JOIN: tl.constexpr,
    USE_PDL: tl.constexpr,  # chained to the kernels around it (kernels/pdl.py)
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
    # PDL: the first two super-blocks' quant bytes into L2 while the kernel before this one runs
    prefetch_rows(u8_ptr, rows % N, stride_w, first * 128, nb * 128, 256, USE_PDL)
    pdl_wait(USE_PDL)
    for step in tl.range(first, last, num_stages=STAGES):
        acc = _q4_k_step(acc, x_ptr, u8_ptr, i32_ptr, row, nb, step, stride_xm, M, BLOCK_M,
                         MAGIC16, ASM, DOT_PRECISION, JOIN)
    pdl_trigger(USE_PDL)  # the next kernel's programs may take the SMs this one leaves
    m = tl.arange(0, BLOCK_M)[None, :]
    at = m * N + rows[:, None]  # y[m, n], [BN, BM]
    mask = (rows < N)[:, None] & (m < M)
    if not SPLIT:
        tl.store(y_ptr + at, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(partial_ptr + at, acc, mask=mask, sem="acq_rel")  # as gguf_rows'
        split_k_finish(y_ptr, partial_ptr, count_ptr, pid_n, split_k, at, mask)


def subdot_supported(type_id: int, K: int) -> bool:
    """Whether gguf_subdot takes this type and row length: Q4_K (type 12) only."""
    return type_id == 12 and K > 0 and K % 256 == 0


def gguf_subdot(x: torch.Tensor, qweight: torch.Tensor, type_id: int, block_n: int = 64,
                num_warps: int = 4, num_stages: int = 3, split_k: int | None = None,
                programs_per_sm: int = 4, min_block_m: int = 8, asm: bool = False,
                join: bool = False) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T in x's dtype, 1 <= M <= SUBDOT_MAX_M, qweight uint8
    [N, row_bytes] of Q4_K (subdot_supported) in the device layout.

    block_n: rows of W per program (16 and up: the MMA's M slot; 64 and up with 4 warps takes
    sm_90's wgmma, below the m16n8k16 MMA); num_stages: super-blocks in flight; split_k:
    programs sharing a row block's K (default: ~programs_per_sm a SM); min_block_m: x^T padded
    to at least this many columns (8 or 16; the interpreter takes 16); asm: the quants by PTX,
    two weights an instruction (16-bit x on a GPU; the interpreter runs the portable code);
    join: one product a super-block (module docstring)."""
    M, K = x.shape
    N = qweight.shape[0]
    if not 1 <= M <= SUBDOT_MAX_M or not subdot_supported(type_id, K):
        raise ValueError(f"gguf_subdot takes 1..{SUBDOT_MAX_M} rows of x and Q4_K (type 12) "
                         f"rows of a multiple of 256 weights; got M={M}, type {type_id}, K={K}")
    check_qweight(qweight, type_id, K, "gguf_subdot")
    x, qweight = x.contiguous(), qweight.contiguous()
    block_m, (n_blocks, split_k), y, partial, count = rows_launch(
        x, N, K, block_n, split_k, programs_per_sm, min_block_m)  # gguf_rows' shape, workspace
    magic = MAGIC16[x.dtype][0]
    pdl = pdl_enabled(x)
    _gguf_subdot_kernel[(n_blocks, split_k)](
        x, qweight, qweight.view(torch.int32), y, partial, count,
        M, N, K, x.stride(0), qweight.shape[1], split_k,
        BLOCK_N=block_n, BLOCK_M=block_m, SPLIT=split_k > 1,
        STAGES=num_stages, MAGIC16=magic, ASM=asm and magic != 0 and not interpreting(),
        DOT_PRECISION=dot_precision(x.dtype), JOIN=join, USE_PDL=pdl, num_warps=num_warps,
        **launch_kwargs(pdl),
    )
    return y


# The torch reference of gguf_subdot (same signature; tile settings are ignored): gguf_rows'
# product, fp32 products of the dequantized W, the result in x's dtype.
gguf_subdot_reference = gguf_rows_reference
