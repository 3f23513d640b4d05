"""One K step of the GGUF decode GEMV (gguf_gemv.py), per block type: what a thread loads, and
how it turns those bytes into its share of y.

A step is 128 bytes of quants of each of BLOCK_N rows (a k-quant super-block of 256 weights, four
Q8_0 blocks or eight Q4_0 / Q4_1 blocks) held as [H, BLOCK_N, 4] int32: chunk h (16 bytes, one
vector load a thread), row, word w. `_load_step` issues the step's loads (the GEMV calls it one
step ahead, so that they fly while the step before is computed); `_step_dot` decodes and
multiplies. Per weight that is a handful of instructions:

- A field of n bits is shifted to bit 15 or 16 (and up) and OR-ed into the bits of 1.0:
  f = 1 + q * u with u = 2**-8, 2**-7 or 2**-4, exactly, in one LOP3 (AWQ's trick,
  awq_gemv.py); one FFMA adds f * x. Per chunk and sub-block, sum q x = (sum f x - sum x) / u:
  the thread's sums need no cross-thread traffic, and the sub-block's scale and min are applied
  per 16 or 32 weights:

      y[m, n] += sum_sub  scale[n, sub] * sum_j q[n, j] x[m, j] + min[n, sub] * sum_j x[m, j]

- Byte b of the four words of a chunk holds four consecutive weights (the layout's transpose),
  so the activations of byte b are one contiguous [H, 1, 4] load, shared by every row a thread
  holds.
- Q6_K's 6-bit q is 4 bits of ql and 2 of qh: a bit select per byte (_merge) puts them side by
  side in all four bytes of a word at once, so each weight is one field, one LOP3 and one FFMA.
"""

from __future__ import annotations

from tinypaged.kernels._triton import jit, tl


@jit
def _frac(v, mask: tl.constexpr, one):
    # the bits of v under mask (at bit 15 and up) as 1 + q * 2**(pos - 23), in fp32
    return ((v & mask) | one).to(tl.float32, bitcast=True)


@jit
def _byte_fracs(words, mask: tl.constexpr, one, AT: tl.constexpr = 15):
    # [H, BN, 4] words -> the field under `mask` of bytes 0..3 of each word: byte b shifted by
    # AT - 8b, so a field at bit p of its byte lands at AT + p (AT = 16 leaves byte 2 in place)
    return (_frac(words << AT, mask, one), _frac(words << (AT - 8), mask, one),
            _frac(words >> (16 - AT) if AT != 16 else words, mask, one),
            _frac(words >> (24 - AT), mask, one))


@jit
def _prmt_float(c, one, b: tl.constexpr):
    # bits 16-23 of 1.0's bits replaced by byte b of c, by one byte permute (selector nibbles:
    # result bytes 0, 1, 3 from `one`, sources 4, 5, 7; byte 2 from c's byte b)
    sel = tl.full(c.shape, 0x7054 + (b << 8), tl.int32)
    bits = tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r",
                                     [c, one + tl.zeros_like(c), sel], dtype=tl.int32,
                                     is_pure=True, pack=1)
    return bits.to(tl.float32, bitcast=True)


@jit
def _asm_byte_floats(c, one):
    # GPU only (PTX): bytes 0..3 of each word of c, of the form 0b10qqqqqq, as the floats
    # 1 + q * 2**-7 (bits 16-23 of 1.0's bits are 0b10000000): one prmt each, where
    # _byte_fracs(c, 0x3F << 16, one, 16) needs a shift and a LOP3 (byte 2: no shift)
    return (_prmt_float(c, one, 0), _prmt_float(c, one, 1), _prmt_float(c, one, 2),
            _prmt_float(c, one, 3))


@jit
def _merge(low, high):
    # bits 0-3 of each byte from `low`, bits 4-7 from `high`
    return (low & 0x0F0F0F0F) | (high & -0x0F0F0F10)


@jit
def _high_bits(v):
    # bits 4-5 of each byte of v, with bit 7 set (bits 4-7 of 0b10qqqqqq)
    return (v & 0x30303030) | -0x7F7F7F80


@jit
def _x4(x_ptrs, x_mask):
    # the activations of bytes 0..3 of the thread's words, in fp32: byte b's four start at
    # x_ptrs + 4b
    return (tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32),
            tl.load(x_ptrs + 4, mask=x_mask, other=0.0).to(tl.float32),
            tl.load(x_ptrs + 8, mask=x_mask, other=0.0).to(tl.float32),
            tl.load(x_ptrs + 12, mask=x_mask, other=0.0).to(tl.float32))


@jit
def _dot(f0, f1, f2, f3, x_ptrs, x_mask):
    # (sum f x over the thread's 16 weights [H, BN, 1], sum x [H, 1, 1]); x_ptrs [H, 1, 4] (_x4)
    x0, x1, x2, x3 = _x4(x_ptrs, x_mask)
    fx = tl.sum(f0 * x0 + f1 * x1 + f2 * x2 + f3 * x3, axis=2, keep_dims=True)
    xs = tl.sum(x0 + x1 + x2 + x3, axis=2, keep_dims=True)
    return fx, xs


@jit
def _x_rows(x_ptr, stride_xm, M, k, BLOCK_M: tl.constexpr):
    # every row of x at the K indices k [H, 1, 4]: pointers [H, 1, 4, BLOCK_M], row m of x along
    # the last dim, and the mask of the rows that exist [1, 1, 1, BLOCK_M]
    m = tl.arange(0, BLOCK_M)[None, None, None, :]
    return x_ptr + m * stride_xm + k[:, :, :, None], m < M


@jit
def _dot_rows(f0, f1, f2, f3, x_ptrs, x_mask):
    # _dot for all rows of x at once: x_ptrs [H, 1, 4, BLOCK_M] (_x_rows) -> (sum f x
    # [H, BN, BLOCK_M], sum x [H, 1, BLOCK_M]), a column per row
    x0, x1, x2, x3 = _x4(x_ptrs, x_mask)
    fx = tl.sum(f0[:, :, :, None] * x0 + f1[:, :, :, None] * x1 + f2[:, :, :, None] * x2
                + f3[:, :, :, None] * x3, axis=2)
    return fx, tl.sum(x0 + x1 + x2 + x3, axis=2)


@jit
def _k_scale_min(w1, w2, w3, s):
    # Q4_K / Q5_K: 6-bit scale and min of sub-block s [H, 1, 1] from the scale words [H, BN, 1]
    # (bytes 0-3, 4-7, 8-11 of the 12; layout in gguf_format.k_scale_min)
    shift = s % 4 * 8
    a = (w1 >> shift) & 0xFF
    b = (w2 >> shift) & 0xFF
    c = (w3 >> shift) & 0xFF
    low = s < 4
    sc = tl.where(low, a & 63, (c & 0xF) | ((a >> 6) << 4))
    mn = tl.where(low, b & 63, (c >> 4) | ((b >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@jit
def _select(v, w, i):
    # element i (a constant or [H, BN, 1]) of each thread's 4-vector v [H, BN, 4] -> [H, BN, 1].
    # Scales load as such vectors in the quants' own layout (every thread of a row loads them;
    # L1 serves the repeats): loaded as [1, BN, 1], they got a layout of their own, and moving
    # values between the two cost shared-memory round trips and shuffles in every step.
    return tl.sum(tl.where(w == i, v, tl.zeros_like(v)), axis=2, keep_dims=True)


@jit
def _f16_group(f16_ptr, plane, idx, count, w, mask, WHOLE: tl.constexpr):
    # the aligned group of 4 fp16 numbers [H, BN, 4] (as fp32) that holds number idx [H, 1, 1]
    # of the plane of `count` starting at fp16 offset plane [1, BN, 1]; `_select(v, w, idx % 4)`
    # picks it. Unless count is WHOLE groups, the last group is masked at the plane's end (a
    # mask that differs within a group costs the vector load)
    group = idx // 4 * 4 + w
    if not WHOLE:
        mask = mask & (group < count)
    return tl.load(f16_ptr + plane + group, mask=mask, other=0.0).to(tl.float32)


@jit
def _f16_of(word, half):
    # the fp16 in bits 16 half .. 16 half + 15 of an int32 word, as fp32
    return ((word >> (16 * half)) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(
        tl.float32)


@jit
def _add_row(acc, part, mi, BLOCK_M: tl.constexpr):
    # acc [H, BN, BLOCK_M] += part [H, BN, 1] in column mi
    if BLOCK_M == 1:
        return acc + part
    m_idx = tl.arange(0, BLOCK_M)[None, None, :]
    return acc + tl.where(m_idx == mi, part, 0.0)


@jit
def _load_step(w32_ptr, f16_ptr, row_w, nb, step, blk, h, w, ok, QTYPE: tl.constexpr,
               WHOLE: tl.constexpr):
    # the bytes of `step` thread h needs, as up to five tensors (0 where a type needs fewer).
    # row_w [1, BN, 1]: the rows' first words; blk [H, 1, 1]: chunk h's block (legacy types);
    # ok [H, BN, 1]: the loads that exist. Plane offsets: gguf_layout.PLANES.
    v3 = 0
    v4 = 0
    if QTYPE == 12 or QTYPE == 13:  # Q4_K / Q5_K: chunks 2h and 2h + 1 (l = 0..15, 16..31 of
        # sub-blocks 2h (low nibbles) and 2h + 1), 64 bytes apart; the 16-byte header
        qs = w32_ptr + row_w + step * 32 + h * 4 + w
        v0 = tl.load(qs, mask=ok, other=0)
        v1 = tl.load(qs + 16, mask=ok, other=0)
        v2 = tl.load(w32_ptr + row_w + nb * (32 if QTYPE == 12 else 40) + step * 4 + w + 0 * h,
                     mask=ok, other=0)
        if QTYPE == 13:  # qh[l], l = 0..15 and 16..31
            qh = w32_ptr + row_w + nb * 32 + step * 8 + w
            v3 = tl.load(qh, mask=ok, other=0)
            v4 = tl.load(qh + 4, mask=ok, other=0)
    elif QTYPE == 14:  # Q6_K: ql chunks h and 4 + h, qh chunk h, the 16 scales, the d group
        qs = w32_ptr + row_w + step * 32 + h * 4 + w
        v0 = tl.load(qs, mask=ok, other=0)
        v1 = tl.load(qs + 16, mask=ok, other=0)
        v2 = tl.load(w32_ptr + row_w + nb * 32 + step * 16 + h * 4 + w, mask=ok, other=0)
        v3 = tl.load(w32_ptr + row_w + nb * 48 + step * 4 + w + 0 * h, mask=ok, other=0)
        v4 = _f16_group(f16_ptr, row_w * 2 + nb * 104, step + 0 * h, nb, w, ok, WHOLE)
    else:  # Q8_0 (d plane at byte nb * 32) / Q4_0, Q4_1 (d, m planes at nb * 16, nb * 18)
        v0 = tl.load(w32_ptr + row_w + step * 32 + h * 4 + w, mask=ok, other=0)
        v1 = _f16_group(f16_ptr, row_w * 2 + nb * (16 if QTYPE == 8 else 8), blk, nb, w, ok,
                        WHOLE)
        v2 = 0
        if QTYPE == 3:
            v2 = _f16_group(f16_ptr, row_w * 2 + nb * 9, blk, nb, w, ok, WHOLE)
    return v0, v1, v2, v3, v4


@jit
def _step_dot(acc, v0, v1, v2, v3, v4, x_ptr, stride_xm, M, K, step, blk, h, w, one,
              ROWS_X, QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, ASM: tl.constexpr):
    # acc [H, BN, BLOCK_M] + this step's partial sums of y for rows 0..ROWS_X-1 of x, from the
    # loads of _load_step; each x row reuses the step's decoded weights
    if QTYPE == 12 or QTYPE == 13:  # Q4_K / Q5_K: weights l of sub-blocks 2h and 2h + 1
        w0 = _select(v2, w, 0)  # header: d, dmin | scale bytes 0-3, 4-7, 8-11
        w1, w2, w3 = _select(v2, w, 1), _select(v2, w, 2), _select(v2, w, 3)
        d, dmin = _f16_of(w0, 0), _f16_of(w0, 1)
        sc_lo, mn_lo = _k_scale_min(w1, w2, w3, 2 * h)
        sc_hi, mn_hi = _k_scale_min(w1, w2, w3, 2 * h + 1)
        a_lo, a_hi = d * sc_lo * 256.0, d * sc_hi * 16.0  # u of the low / high nibble
        b_lo, b_hi = dmin * mn_lo, dmin * mn_hi
        qa0, qa1, qa2, qa3 = _byte_fracs(v0, 0xF << 15, one)  # low nibbles
        pa0, pa1, pa2, pa3 = _byte_fracs(v0, 0xF << 19, one)  # high nibbles
        qb0, qb1, qb2, qb3 = _byte_fracs(v1, 0xF << 15, one)
        pb0, pb1, pb2, pb3 = _byte_fracs(v1, 0xF << 19, one)
        if QTYPE == 13:  # bit 2h (low) / 2h + 1 (high) of qh[l]: the fifth bit, worth 16
            ea0, ea1, ea2, ea3 = _byte_fracs(v3 >> (2 * h), 1 << 15, one)
            oa0, oa1, oa2, oa3 = _byte_fracs(v3 >> (2 * h), 1 << 16, one)
            eb0, eb1, eb2, eb3 = _byte_fracs(v4 >> (2 * h), 1 << 15, one)
            ob0, ob1, ob2, ob3 = _byte_fracs(v4 >> (2 * h), 1 << 16, one)
        k_lo = step * 256 + h * 64 + tl.arange(0, 4)[None, None, :]  # [H, 1, 4]: + 4b
        for mi in range(ROWS_X):
            x_lo = x_ptr + mi * stride_xm + k_lo
            x_ok = mi < M
            s_a, xs_a = _dot(qa0, qa1, qa2, qa3, x_lo, x_ok)
            s_b, xs_b = _dot(qb0, qb1, qb2, qb3, x_lo + 16, x_ok)
            t_a, ys_a = _dot(pa0, pa1, pa2, pa3, x_lo + 32, x_ok)
            t_b, ys_b = _dot(pb0, pb1, pb2, pb3, x_lo + 48, x_ok)
            xs_lo, xs_hi = xs_a + xs_b, ys_a + ys_b
            qx_lo, qx_hi = s_a + s_b - xs_lo, t_a + t_b - xs_hi
            if QTYPE == 13:
                # in the nibble's units (sum q x * u): the bit is worth 16, its u is 2**-8
                # (bit 15) and 2**-7 (bit 16)
                e_a, _ = _dot(ea0, ea1, ea2, ea3, x_lo, x_ok)
                e_b, _ = _dot(eb0, eb1, eb2, eb3, x_lo + 16, x_ok)
                o_a, _ = _dot(oa0, oa1, oa2, oa3, x_lo + 32, x_ok)
                o_b, _ = _dot(ob0, ob1, ob2, ob3, x_lo + 48, x_ok)
                qx_lo += (e_a + e_b - xs_lo) * 16.0
                qx_hi += (o_a + o_b - xs_hi) * 128.0
            part = a_lo * qx_lo + a_hi * qx_hi - b_lo * xs_lo - b_hi * xs_hi
            acc = _add_row(acc, part, mi, BLOCK_M)
    elif QTYPE == 14:  # Q6_K: thread h = 2n + lh takes weights l = 16 lh .. 16 lh + 15 of half
        # n in all four quarters i (sub-blocks 8n + 2i + lh): v0 = ql chunk h (quarters 0 and 2
        # in the low / high nibbles), v1 = chunk 4 + h (1 and 3), v2 = qh chunk h (i at bit 2i)
        sc4 = _select(v3, w, h)  # the thread's four int8 scales, quarter i in byte i
        d = _select(v4, w, step % 4) * 128.0  # u = 2**-7 of the 6-bit fields at bit 16
        a0 = d * ((sc4 << 24) >> 24).to(tl.float32)  # sign-extended bytes
        a1 = d * ((sc4 << 16) >> 24).to(tl.float32)
        a2 = d * ((sc4 << 8) >> 24).to(tl.float32)
        a3 = d * (sc4 >> 24).to(tl.float32)
        # each byte of c<i> is 0b10qqqqqq, quarter i's 6-bit q at bits 0-5 (the 10: see
        # _asm_byte_floats)
        c0, c1 = _merge(v0, _high_bits(v2 << 4)), _merge(v1, _high_bits(v2 << 2))
        c2, c3 = _merge(v0 >> 4, _high_bits(v2)), _merge(v1 >> 4, _high_bits(v2 >> 2))
        if ASM:
            q0, q1, q2, q3 = _asm_byte_floats(c0, one)
            r0, r1, r2, r3 = _asm_byte_floats(c1, one)
            s0, s1, s2, s3 = _asm_byte_floats(c2, one)
            t0, t1, t2, t3 = _asm_byte_floats(c3, one)
        else:
            q0, q1, q2, q3 = _byte_fracs(c0, 0x3F << 16, one, 16)
            r0, r1, r2, r3 = _byte_fracs(c1, 0x3F << 16, one, 16)
            s0, s1, s2, s3 = _byte_fracs(c2, 0x3F << 16, one, 16)
            t0, t1, t2, t3 = _byte_fracs(c3, 0x3F << 16, one, 16)
        k_lo = step * 256 + h // 2 * 128 + h % 2 * 16 + tl.arange(0, 4)[None, None, :]
        for mi in range(ROWS_X):
            x_lo = x_ptr + mi * stride_xm + k_lo  # [H, 1, 4]; quarter i at + 32 i
            x_ok = mi < M
            f0, x0 = _dot(q0, q1, q2, q3, x_lo, x_ok)
            f1, x1 = _dot(r0, r1, r2, r3, x_lo + 32, x_ok)
            f2, x2 = _dot(s0, s1, s2, s3, x_lo + 64, x_ok)
            f3, x3 = _dot(t0, t1, t2, t3, x_lo + 96, x_ok)
            # sum (q - 32) x = 128 (sum f x - sum x) - 32 sum x = 128 (f - 1.25 x)
            part = (a0 * (f0 - 1.25 * x0) + a1 * (f1 - 1.25 * x1)
                    + a2 * (f2 - 1.25 * x2) + a3 * (f3 - 1.25 * x3))
            acc = _add_row(acc, part, mi, BLOCK_M)
    elif QTYPE == 8:  # Q8_0: chunk h = weights 16 (h % 2).. of block blk
        d = _select(v1, w, blk % 4)
        # signed bytes: XOR-ing the sign bits (0x80808080) gives q + 128 in 0..255
        q0, q1, q2, q3 = _byte_fracs(v0 ^ -0x7F7F7F80, 0xFF << 15, one)
        k_lo = step * 128 + h * 16
        if BLOCK_M > 1:  # every row at once
            x_lo, x_ok = _x_rows(x_ptr, stride_xm, M, k_lo + tl.arange(0, 4)[None, None, :],
                                 BLOCK_M)
            s, xs = _dot_rows(q0, q1, q2, q3, x_lo, x_ok & (k_lo < K)[:, :, :, None])
            acc += d * ((s - xs) * 256.0 - 128.0 * xs)
        else:
            for mi in range(ROWS_X):
                x_lo = x_ptr + mi * stride_xm + k_lo + tl.arange(0, 4)[None, None, :]
                s, xs = _dot(q0, q1, q2, q3, x_lo, (mi < M) & (k_lo < K))
                acc = _add_row(acc, d * ((s - xs) * 256.0 - 128.0 * xs), mi, BLOCK_M)
    else:  # Q4_0 / Q4_1: chunk h = block blk, low nibbles weights 0..15, high nibbles 16..31
        d = _select(v1, w, blk % 4)
        if QTYPE == 3:
            mn = _select(v2, w, blk % 4)
        else:
            mn = -8.0 * d
        q0, q1, q2, q3 = _byte_fracs(v0, 0xF << 15, one)
        p0, p1, p2, p3 = _byte_fracs(v0, 0xF << 19, one)
        k_lo = blk * 32
        if BLOCK_M > 1:  # every row at once
            x_lo, x_ok = _x_rows(x_ptr, stride_xm, M, k_lo + tl.arange(0, 4)[None, None, :],
                                 BLOCK_M)
            x_ok = x_ok & (k_lo < K)[:, :, :, None]
            s_lo, xs_lo = _dot_rows(q0, q1, q2, q3, x_lo, x_ok)
            s_hi, xs_hi = _dot_rows(p0, p1, p2, p3, x_lo + 16, x_ok)
            acc += d * ((s_lo - xs_lo) * 256.0 + (s_hi - xs_hi) * 16.0) + mn * (xs_lo + xs_hi)
        else:
            for mi in range(ROWS_X):
                x_lo = x_ptr + mi * stride_xm + k_lo + tl.arange(0, 4)[None, None, :]
                x_ok = (mi < M) & (k_lo < K)
                s_lo, xs_lo = _dot(q0, q1, q2, q3, x_lo, x_ok)
                s_hi, xs_hi = _dot(p0, p1, p2, p3, x_lo + 16, x_ok)
                part = d * ((s_lo - xs_lo) * 256.0 + (s_hi - xs_hi) * 16.0) \
                    + mn * (xs_lo + xs_hi)
                acc = _add_row(acc, part, mi, BLOCK_M)
    return acc
