"""The GGUF decode GEMV for 2 to 64 rows: y [M, N] = x [M, K] @ W^T on tensor cores, W in its
GGUF blocks (device layout, gguf_layout.py), every quantized type. Batched decode takes up to 16
rows; a speculative verification takes k + 1 rows a sequence (40 at batch 8, k = 4).

At decode sizes the product is bound by reading W once. The one-row GEMV (gguf_gemv.py) spends
one FMA per weight and row of x on CUDA cores, so at 8 rows its arithmetic, not its bytes, sets
the time. Here each weight is dequantized once, in registers, into x's dtype, and the rows of x
go through the tensor cores, as the dense GEMV (dense_gemv.py) does:

- y^T [BLOCK_N, BLOCK_M] = W x^T: a program owns BLOCK_N rows of W (the M slot of tl.dot) and a
  range of K steps; x^T, padded to BLOCK_M = 8 to 64 columns, is the N slot. A step is 256
  weights a row: one k-quant super-block, or 8 blocks of 32 (Q8_0, Q4_0, Q4_1).
- A step's quant bytes are contiguous in the quant plane (128 bytes a row; Q8_0 256) and load
  as 16-byte vectors into a [BLOCK_N G, bytes / G] uint8 tile: each row of W as G sub-rows
  whose weights share one scale and min ([BLOCK_N G, 1], broadcast along the sub-row; with a
  4-D [BLOCK_N, a, g, byte] tile instead, the compiler spread the bytes one a thread). Read
  row-major, a row's sub-rows are its bytes in plane order, so a reshape makes the tile
  [BLOCK_N, K step] for tl.dot; the bytes stay where they are, and x^T is gathered in their K
  order (inside a 16-byte chunk position 4w + b holds weight 4b + w).
- w = scale * q + min per weight, in fp32 with one FMA: q is OR-ed into the mantissa of 1.0,
  f = 1 + q 2**-BITS exactly (gguf_gemv_step.py's trick), and w = f a + (min - a) with
  a = scale 2**BITS; then rounded to x's dtype (as dequantize + cuBLAS rounds W). With asm the
  4-bit types take the nibbles of 4 bytes from one register by PTX (2 instructions a weight).
- fp32 accumulation; K is split so that ~programs_per_sm programs per SM stream weights, and the
  split sums finish as split_k.py says (atomics into the shared workspace, the last program of a
  row block writes y). Rows past N read row n % N (unmasked loads) and are not stored.

gguf_mma.py (Q4_K / Q6_K only) computes the same product one sub-block at a time: 8 (Q4_K) or
16 (Q6_K) tl.dot calls of K = 32 / 16 a super-block, each staging its operands, applying the
sub-block's scale to the fp32 accumulator, and loading the scale bytes one sub-block at a time.
This kernel makes one or two products of K = 256 or 128 a step, with scales applied to the
weights before the product, and pipelines the steps' loads (num_stages).
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import (
    cdiv,
    dot_precision,
    interpreting,
    jit,
    next_power_of_2,
    tl,
)
from tinypaged.kernels.gguf_format import check_qweight, gguf_dequantize_reference
from tinypaged.kernels.gguf_layout import to_file_layout
from tinypaged.kernels.pdl import launch_kwargs, pdl_enabled, pdl_trigger, pdl_wait, prefetch_rows
from tinypaged.kernels.split_k import (
    programs_target,
    split_k_finish,
    split_k_range,
    split_k_workspace,
)

ROWS_TYPES = (2, 3, 8, 12, 13, 14)  # Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K
ROWS_MAX_M = 64
K_QUANTS = (12, 13, 14)
# type id -> sub-rows a row of W takes in a step (_step): one per group of weights that share
# a scale
SUB_ROWS = tl.constexpr({2: 8, 3: 8, 8: 8, 12: 4, 13: 4, 14: 8})


@jit
def _weights(q, scale, mn, BITS: tl.constexpr, DTYPE: tl.constexpr):
    # scale * q + mn in DTYPE for integers 0 <= q < 2**BITS (scale, mn broadcast against q):
    # f = 1 + q 2**-BITS by OR-ing q into 1.0's mantissa, then one FMA with a = scale 2**BITS
    return _scaled(((q << (23 - BITS)) | 0x3F800000).to(tl.float32, bitcast=True), scale, mn,
                   BITS, DTYPE)


@jit
def _scaled(f, scale, mn, BITS: tl.constexpr, DTYPE: tl.constexpr):
    # scale * q + mn in DTYPE from f = 1 + q 2**-BITS: one FMA with a = scale 2**BITS
    a = scale * (1 << BITS)
    return (f * a + (mn - a)).to(DTYPE)


def _nibble_asm(at: int, high: int) -> str:
    # PTX for 4 bytes packed in $4 -> $0..$3: nibble `high` of byte j moved to bits at..at + 3
    # (one shift) and masked and OR-ed into 1.0's bits (one lop3: (a & b) | c)
    lines = ["{ .reg .b32 t, one; mov.b32 one, 0x3F800000;"]
    for j in range(4):
        shift = at - 8 * j - 4 * high
        lines.append(f"shl.b32 t, $4, {shift};" if shift >= 0 else f"shr.u32 t, $4, {-shift};")
        lines.append(f"lop3.b32 ${j}, t, {0xF << at:#x}, one, 0xEA;")
    return " ".join(lines) + " }"


# (bit the nibble goes to, which nibble) -> the PTX of _nibble_bits (Q4_K / Q4_0 / Q4_1: 19,
# Q5_K: 18, below its fifth bit)
NIBBLE_ASM = tl.constexpr({(at, high): _nibble_asm(at, high) for at in (18, 19) for high in (0, 1)})


@jit
def _nibble_bits(qs, HIGH: tl.constexpr, AT: tl.constexpr, ASM: tl.constexpr):
    # uint8 qs -> int32: nibble HIGH of each byte at bits AT .. AT + 3, OR-ed into 1.0's bits.
    # ASM (GPU only): 4 bytes of one register a PTX block, 2 instructions a weight; portable:
    # each byte unpacked to a register first
    if ASM:
        return tl.inline_asm_elementwise(NIBBLE_ASM[(AT, HIGH)], "=r,=r,=r,=r,r", [qs],
                                         dtype=tl.int32, is_pure=True, pack=4)
    return (((qs.to(tl.int32) >> (4 * HIGH)) & 0xF) << AT) | 0x3F800000


@jit
def _chunk_pos(c):
    # the file byte (within its 16-byte chunk) at position c of a transposed chunk
    return 4 * (c % 4) + c // 4


@jit
def _x_t(x_ptr, stride_xm, M, K, k, BLOCK_M: tl.constexpr):
    # x^T [KT, BLOCK_M] for the K indices k [KT, 1] (rows of x past M and k past K: zero)
    m = tl.arange(0, BLOCK_M)[None, :]
    return tl.load(x_ptr + m * stride_xm + k, mask=(m < M) & (k < K), other=0.0)


@jit
def _k_scale_min(u8_ptr, sc_off, s):
    # Q4_K / Q5_K: the 6-bit scale and min of sub-blocks s [R, 1] from the 12 bytes at
    # sc_off [R, 1] (gguf_format.k_scale_min), as fp32 [R, 1]
    a = tl.load(u8_ptr + sc_off + s % 4).to(tl.int32)
    b = tl.load(u8_ptr + sc_off + 4 + s % 4).to(tl.int32)
    c = tl.load(u8_ptr + sc_off + 8 + s % 4).to(tl.int32)
    low = s < 4
    sc = tl.where(low, a & 63, (c & 0xF) | ((a >> 6) << 4))
    mn = tl.where(low, b & 63, (c >> 4) | ((b >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@jit
def _dot(acc, w, x_ptr, stride_xm, M, K, k, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
         DOT_PRECISION: tl.constexpr):
    # acc [BN, BM] + w @ x^T: w [BN * G, T] (G sub-rows of T weights a row of W, row-major)
    # as [BN, G * T], x^T gathered at the K indices k [G * T, 1] of its columns
    KT: tl.constexpr = w.shape[0] // BLOCK_N * w.shape[1]
    return tl.dot(tl.reshape(w, (BLOCK_N, KT)), _x_t(x_ptr, stride_xm, M, K, k, BLOCK_M), acc,
                  input_precision=DOT_PRECISION)


@jit
def _step(acc, x_ptr, u8_ptr, i8_ptr, f16_ptr, row, nb, step, stride_xm, M, K,
          QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
          DOT_PRECISION: tl.constexpr, ASM: tl.constexpr):
    # one step (256 weights) of BLOCK_N rows of W, each as G sub-rows r = G n + u (G: SUB_ROWS)
    # so that a scale is one number a sub-row [BN G, 1], broadcast along it; row [BN G, 1]: the
    # first byte of each sub-row's row of W. A row's sub-rows, read row-major, are its step in
    # plane order
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    if QTYPE == 12 or QTYPE == 13:
        # TH plane: sub-row g, byte t = 16 a + c is plane byte 64 a + 16 g + c (file chunk
        # 2g + a), weight l = 16 a + 4 (c % 4) + c // 4 of sub-blocks 2g (low nibble) and 2g + 1
        # (high); header d, dmin, 12 scale bytes
        g = tl.arange(0, BLOCK_N * 4)[:, None] % 4  # [BN 4, 1]
        t = tl.arange(0, 32)[None, :]
        qs = tl.load(u8_ptr + row + step * 128 + t // 16 * 64 + g * 16 + t % 16)
        hdr = row + nb * (128 if QTYPE == 12 else 160) + step * 16
        d = tl.load(f16_ptr + hdr // 2).to(tl.float32)
        dmin = tl.load(f16_ptr + hdr // 2 + 1).to(tl.float32)
        sc_lo, mn_lo = _k_scale_min(u8_ptr, hdr + 4, 2 * g)
        sc_hi, mn_hi = _k_scale_min(u8_ptr, hdr + 4, 2 * g + 1)
        BITS: tl.constexpr = 4 if QTYPE == 12 else 5
        f_lo = _nibble_bits(qs, 0, 23 - BITS, ASM)  # q at bits 23 - BITS .. 22
        f_hi = _nibble_bits(qs, 1, 23 - BITS, ASM)
        if QTYPE == 13:  # bit s of qh[l] (the T plane puts l's byte at t) at bit 22
            qh = tl.load(u8_ptr + row + nb * 128 + step * 32 + t).to(tl.int32)
            f_lo |= ((qh >> (2 * g)) & 1) << 22
            f_hi |= ((qh >> (2 * g + 1)) & 1) << 22
        f_lo = f_lo.to(tl.float32, bitcast=True)
        f_hi = f_hi.to(tl.float32, bitcast=True)
        i = tl.arange(0, 128)[:, None]  # the product's column 32 g + t
        k_lo = step * 256 + i // 32 * 64 + i % 32 // 16 * 16 + _chunk_pos(i % 16)
        acc = _dot(acc, _scaled(f_lo, d * sc_lo, -dmin * mn_lo, BITS, DTYPE), x_ptr,
                   stride_xm, M, K, k_lo, BLOCK_N, BLOCK_M, DOT_PRECISION)
        acc = _dot(acc, _scaled(f_hi, d * sc_hi, -dmin * mn_hi, BITS, DTYPE), x_ptr,
                   stride_xm, M, K, k_lo + 32, BLOCK_N, BLOCK_M, DOT_PRECISION)
    elif QTYPE == 14:
        # Q6_K TQ plane: sub-row u = 4 a + h, byte c is plane byte 64 a + 16 h + c: ql chunk h
        # of quarter a (low nibble) and 2 + a (high); qh chunk h holds quarter i's 2 high bits
        # at bit 2i; weight 128 (h // 2) + 32 i + 16 (h % 2) + file byte; int8 scale of quarter
        # i at byte 4h + i of the S6 plane, d at nb * 208
        u = tl.arange(0, BLOCK_N * 8)[:, None] % 8
        a, h = u // 4, u % 4
        c = tl.arange(0, 16)[None, :]
        qs = tl.load(u8_ptr + row + step * 128 + u * 16 + c).to(tl.int32)
        qh = tl.load(u8_ptr + row + nb * 128 + step * 64 + h * 16 + c).to(tl.int32)
        d = tl.load(f16_ptr + (row + nb * 208) // 2 + step).to(tl.float32)
        s_ptr = i8_ptr + row + nb * 192 + step * 16 + 4 * h
        s_lo = d * tl.load(s_ptr + a).to(tl.float32)  # quarter a
        s_hi = d * tl.load(s_ptr + 2 + a).to(tl.float32)  # quarter 2 + a
        q_lo = (qs & 0xF) | (((qh >> (2 * a)) & 3) << 4)
        q_hi = (qs >> 4) | (((qh >> (4 + 2 * a)) & 3) << 4)
        # one product of K = 256: the two nibbles of a byte side by side ([BN 8, 16, 2], each
        # thread then holds 32 consecutive weights of a row, which it stores to shared memory
        # for the MMA as whole vectors; two [BN 8, 16] products stored them 2 bytes at a time)
        w = tl.join(_weights(q_lo, s_lo, -32.0 * s_lo, 6, DTYPE),
                    _weights(q_hi, s_hi, -32.0 * s_hi, 6, DTYPE))
        i = tl.arange(0, 256)[:, None]  # the product's column 32 u + 2 c + nibble
        iu, ic = i // 32, i % 32 // 2
        k = (step * 256 + iu % 4 // 2 * 128 + (iu // 4 + i % 2 * 2) * 32 + iu % 2 * 16
             + _chunk_pos(ic))
        acc = _dot(acc, tl.reshape(w, (BLOCK_N * 8, 32)), x_ptr, stride_xm, M, K, k, BLOCK_N,
                   BLOCK_M, DOT_PRECISION)
    else:  # legacy: sub-row b is block 8 step + b (those < nb: a row's last step may be short)
        blk = step * 8 + tl.arange(0, BLOCK_N * 8)[:, None] % 8  # [BN 8, 1]
        ok = blk < nb
        if QTYPE == 8:  # Q8_0: qs 32 T | d
            t = tl.arange(0, 32)[None, :]
            q = tl.load(i8_ptr + row + blk * 32 + t, mask=ok, other=0).to(tl.int32)
            d = tl.load(f16_ptr + (row + nb * 32) // 2 + blk, mask=ok, other=0.0)
            d = d.to(tl.float32)
            # int8 q: 1 + (q + 128) 2**-8 is the float of bits (q << 15) + those of 1 + 2**-1
            # (q + 128 < 256 never carries into the exponent): one multiply-add a weight
            f = ((q << 15) + 0x3FC00000).to(tl.float32, bitcast=True)
            i = tl.arange(0, 256)[:, None]  # the product's column 32 b + t
            k = (step * 8 + i // 32) * 32 + i % 32 // 16 * 16 + _chunk_pos(i % 16)
            acc = _dot(acc, _scaled(f, d, -128.0 * d, 8, DTYPE), x_ptr, stride_xm, M, K, k,
                       BLOCK_N, BLOCK_M, DOT_PRECISION)
        else:  # Q4_0: qs 16 T | d; Q4_1: qs 16 T | d | m; byte j: weights j and 16 + j
            c = tl.arange(0, 16)[None, :]
            qs = tl.load(u8_ptr + row + blk * 16 + c, mask=ok, other=0)
            d = tl.load(f16_ptr + (row + nb * 16) // 2 + blk, mask=ok, other=0.0)
            d = d.to(tl.float32)
            if QTYPE == 3:
                mn = tl.load(f16_ptr + (row + nb * 18) // 2 + blk, mask=ok, other=0.0)
                mn = mn.to(tl.float32)
            else:
                mn = -8.0 * d
            f_lo = _nibble_bits(qs, 0, 19, ASM).to(tl.float32, bitcast=True)
            f_hi = _nibble_bits(qs, 1, 19, ASM).to(tl.float32, bitcast=True)
            i = tl.arange(0, 128)[:, None]  # the product's column 16 b + c
            k_lo = (step * 8 + i // 16) * 32 + _chunk_pos(i % 16)
            acc = _dot(acc, _scaled(f_lo, d, mn, 4, DTYPE), x_ptr, stride_xm, M, K, k_lo,
                       BLOCK_N, BLOCK_M, DOT_PRECISION)
            acc = _dot(acc, _scaled(f_hi, d, mn, 4, DTYPE), x_ptr, stride_xm, M, K, k_lo + 16,
                       BLOCK_N, BLOCK_M, DOT_PRECISION)
    return acc


@jit(do_not_specialize=("M", "split_k"))
def _gguf_rows_kernel(
    x_ptr, u8_ptr, i8_ptr, f16_ptr, y_ptr,  # x [M, K]; qweight [N, stride_w] as uint8, int8 and
    # fp16 (planes at gguf_layout.PLANES); y [M, N]
    partial_ptr, count_ptr,  # fp32 [M, N] and int32 [cdiv(N, BLOCK_N)], zero before and after
    M, N, K, stride_xm, stride_w, split_k,
    QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT: tl.constexpr,
    STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr, ASM: tl.constexpr,
    USE_PDL: tl.constexpr,  # chained to the kernels around it (kernels/pdl.py)
):
    # grid: (cdiv(N, BLOCK_N), split_k); program (n, s) sums steps split_k_range(.., s) of
    # y[:, n * BLOCK_N : (n + 1) * BLOCK_N]
    pid_n = tl.program_id(0)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    G: tl.constexpr = SUB_ROWS[QTYPE]
    # the first byte of the row of each sub-row (_step); rows past N read row n % N (in bounds,
    # unmasked loads) and are not stored
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N * G) // G
    row = ((n % N).to(tl.int64) * stride_w)[:, None]  # [BN G, 1]
    nb = K // (256 if QTYPE == 12 or QTYPE == 13 or QTYPE == 14 else 32)
    first, last = split_k_range(tl.cdiv(K, 256), split_k)
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)  # y^T
    # PDL: the first two steps' quant bytes into L2 while the kernel before this one runs (a
    # row's quant plane: nb blocks of 128 bytes (k-quants), 32 (Q8_0) or 16 (Q4_0, Q4_1))
    QB: tl.constexpr = 128 if QTYPE == 12 or QTYPE == 13 or QTYPE == 14 else (
        32 if QTYPE == 8 else 16)
    STEP: tl.constexpr = 128 if QB == 128 else 8 * QB  # quant bytes of a step
    prefetch_rows(u8_ptr, rows % N, stride_w, first * STEP, nb * QB, 2 * STEP, USE_PDL)
    pdl_wait(USE_PDL)
    for step in tl.range(first, last, num_stages=STAGES):
        acc = _step(acc, x_ptr, u8_ptr, i8_ptr, f16_ptr, row, nb, step, stride_xm, M, K, QTYPE,
                    BLOCK_N, BLOCK_M, DOT_PRECISION, ASM)
    pdl_trigger(USE_PDL)  # the next kernel's programs may take the SMs this one leaves
    m = tl.arange(0, BLOCK_M)[None, :]
    at = m * N + rows[:, None]  # y[m, n], [BN, BM]
    mask = (rows < N)[:, None] & (m < M)
    if not SPLIT:
        tl.store(y_ptr + at, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        # acq_rel, as gguf_mma's: its relaxed adds were once read late on an H200
        tl.atomic_add(partial_ptr + at, acc, mask=mask, sem="acq_rel")
        split_k_finish(y_ptr, partial_ptr, count_ptr, pid_n, split_k, at, mask)


def rows_supported(type_id: int, K: int) -> bool:
    """Whether gguf_rows takes this type and row length (whole blocks: every quantized type)."""
    return type_id in ROWS_TYPES and K % (256 if type_id in K_QUANTS else 32) == 0


def gguf_rows(x: torch.Tensor, qweight: torch.Tensor, type_id: int, block_n: int = 64,
              num_warps: int = 4, num_stages: int = 2, split_k: int | None = None,
              programs_per_sm: int = 4, min_block_m: int = 8, asm: bool = False) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T in x's dtype, 1 <= M <= ROWS_MAX_M, qweight uint8
    [N, row_bytes] of GGML type `type_id` in the device layout.

    block_n: rows of W per program (16 and up: the MMA's M slot); num_stages: K steps whose
    loads are in flight at once; split_k: programs sharing a row block's K (default: about
    programs_per_sm programs per SM); min_block_m: x^T padded to at least this many columns
    (8 or 16; the interpreter takes 16); asm: the 4-bit types' nibbles to floats by PTX, 4 bytes
    of a register at a time (compiled kernels; the interpreter runs the portable shifts)."""
    M, K = x.shape
    N = qweight.shape[0]
    if not 1 <= M <= ROWS_MAX_M or not rows_supported(type_id, K):
        raise ValueError(f"gguf_rows takes 1..{ROWS_MAX_M} rows of x and types {ROWS_TYPES} "
                         f"in whole blocks; got M={M}, type {type_id}, K={K}")
    check_qweight(qweight, type_id, K, "gguf_rows")
    x, qweight = x.contiguous(), qweight.contiguous()
    block_m, (n_blocks, split_k), y, partial, count = rows_launch(
        x, N, K, block_n, split_k, programs_per_sm, min_block_m)
    pdl = pdl_enabled(x)
    _gguf_rows_kernel[(n_blocks, split_k)](
        x, qweight, qweight.view(torch.int8), qweight.view(torch.float16), y, partial, count,
        M, N, K, x.stride(0), qweight.shape[1], split_k,
        QTYPE=type_id, BLOCK_N=block_n, BLOCK_M=block_m,
        SPLIT=split_k > 1, STAGES=num_stages, DOT_PRECISION=dot_precision(x.dtype),
        ASM=asm and not interpreting(), USE_PDL=pdl, num_warps=num_warps, **launch_kwargs(pdl),
    )
    return y


def rows_launch(x: torch.Tensor, N: int, K: int, block_n: int, split_k: int | None,
                programs_per_sm: int, min_block_m: int):
    """What a launch of gguf_rows or gguf_subdot (kernels/gguf_subdot.py) over x [M, K] and N
    rows of W needs: (BLOCK_M, grid (row blocks, split_k), y [M, N], partial, count).

    BLOCK_M: x^T padded to a power of two of at least min_block_m columns (16 in the
    interpreter, whose tl.dot takes no fewer). split_k: by default about programs_per_sm
    programs an SM, and never a split left without a 256-weight step. The split-K workspace is
    sized for ROWS_MAX_M rows and 8-row blocks whatever M and the tiles are (as dense_gemv's),
    so no batch size reallocates it after another one's CUDA graph captured it."""
    if not x.is_cuda:
        min_block_m = max(min_block_m, 16)
    n_blocks, steps = cdiv(N, block_n), cdiv(K, 256)
    if split_k is None:
        target = programs_target(x.device) * programs_per_sm // 4
        split_k = max(1, min(steps, cdiv(target, n_blocks)))
    split_k = cdiv(steps, cdiv(steps, split_k))  # drop splits that would get no step
    y = torch.empty(x.shape[0], N, dtype=x.dtype, device=x.device)
    partial, count = split_k_workspace(x.device, ROWS_MAX_M * N, cdiv(N, 8))
    return max(min_block_m, next_power_of_2(x.shape[0])), (n_blocks, split_k), y, partial, count


def gguf_rows_reference(x: torch.Tensor, qweight: torch.Tensor, type_id: int,
                        **config) -> torch.Tensor:
    """The torch reference of gguf_rows (same signature; tile settings are ignored): fp32
    products of the dequantized W, the result in x's dtype."""
    K = x.shape[1]
    w = gguf_dequantize_reference(to_file_layout(qweight, type_id, K), type_id, K)
    return (x.float() @ w.T).to(x.dtype)

