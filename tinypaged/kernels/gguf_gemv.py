"""The GGUF decode GEMV: y [M, N] = x [M, K] @ W^T for 1 <= M <= 8, W in the device layout.

W is `qweight` uint8 [N, row_bytes] regrouped into planes (gguf_layout.py): each row starts with
its quant plane, 16-byte chunks transposed, then the scale planes. Decode reads each weight once
per step, so the kernel is a stream over the quant plane, and its arithmetic per weight must stay
a handful of instructions:

- A step takes 128 bytes of quants of each of BLOCK_N rows as an [8, BLOCK_N, 4] tile of int32:
  chunk h (16 bytes, one vector load a thread), row, word w; h comes first so that lanes go along
  a row's chunks, then along rows (wrapping: a thread holds BLOCK_N / (rows a program's lanes
  cover) rows). For a k-quant a step is one super-block of 256 weights; for Q8_0 four blocks of
  32, for Q4_0 / Q4_1 eight. Q4_K / Q5_K threads take two chunks ([4, BLOCK_N, 4] twice: the
  halves of sub-blocks 2h and 2h + 1, whose scales they decode once).
- Byte b of the four words of a chunk holds four consecutive weights (the layout's transpose), so
  the activations of byte b are one contiguous [H, 1, 4] load, shared by every row a thread holds.
- A field of n bits is shifted to bit 15 or 19 and OR-ed into the bits of 1.0: f = 1 + q * u
  with u = 2**-8 or 2**-4, exactly, one LOP3 (AWQ's trick, awq_gemv.py); one FFMA adds f * x.
  Per chunk and sub-block, sum q x = (sum f x - sum x) / u: the thread's sums need no
  cross-thread traffic, and the sub-block's scale and min are applied per 16 or 32 weights:

      y[m, n] += sum_sub  scale[n, sub] * sum_j q[n, j] x[m, j] + min[n, sub] * sum_j x[m, j]

- K is split so that ~4 programs per SM stream weights; split-K sums go by atomics to the fp32
  workspace AWQ's GEMVs share, and the last program of a row block writes y (one launch).
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import cdiv, jit, next_power_of_2, num_sms, tl
from tinypaged.kernels.awq_gemv import _split_k_range, _split_k_workspace
from tinypaged.kernels.gguf_format import ggml_type, row_bytes

GEMV_MAX_M = 8
BLOCKS_PER_STEP = {12: 1, 13: 1, 14: 1, 8: 4, 2: 8, 3: 8}  # blocks in 128 bytes of quants
_ONE = 0x3F800000  # the bits of 1.0, passed at run time so ptxas fuses mask and OR into one LOP3


@jit
def _frac(v, mask: tl.constexpr, one):
    # the bits of v under mask (at bit 15 or 19 and up) as 1 + q * 2**(pos - 23), in fp32
    return ((v & mask) | one).to(tl.float32, bitcast=True)


@jit
def _byte_fracs(words, mask: tl.constexpr, one):
    # [H, BN, 4] words -> the field under `mask` of bytes 0..3 of each word: byte b shifted by
    # 15 - 8b, so a field at bit p of its byte lands at 15 + p
    return (_frac(words << 15, mask, one), _frac(words << 7, mask, one),
            _frac(words >> 1, mask, one), _frac(words >> 9, mask, one))


@jit
def _dot(f0, f1, f2, f3, x_ptrs, x_mask):
    # (sum f x over the thread's 16 weights [H, BN, 1], sum x [H, 1, 1]); byte b's four
    # activations start at x_ptrs + 4b
    x0 = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptrs + 4, mask=x_mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptrs + 8, mask=x_mask, other=0.0).to(tl.float32)
    x3 = tl.load(x_ptrs + 12, mask=x_mask, other=0.0).to(tl.float32)
    fx = tl.sum(f0 * x0 + f1 * x1 + f2 * x2 + f3 * x3, axis=2, keep_dims=True)
    xs = tl.sum(x0 + x1 + x2 + x3, axis=2, keep_dims=True)
    return fx, xs


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
def _f16_at(f16_ptr, plane, idx, count, w, mask, WHOLE: tl.constexpr):
    # fp16 number idx [H, 1, 1] of the plane of `count` starting at fp16 offset plane
    # [1, BN, 1], as fp32 [H, BN, 1]: loaded within the aligned group of 4 that holds it (see
    # _select). Unless count is WHOLE groups, the last group is masked at the plane's end (a
    # mask that differs within a group costs the vector load)
    group = idx // 4 * 4 + w
    if not WHOLE:
        mask = mask & (group < count)
    v = tl.load(f16_ptr + plane + group, mask=mask, other=0.0).to(tl.float32)
    return _select(v, w, idx % 4)


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


@jit(do_not_specialize=("M", "split_k"))
def _gguf_gemv_kernel(
    x_ptr, w32_ptr, f16_ptr, y_ptr,  # x [M, K]; qweight as int32 and fp16; y [M, N]
    partial_ptr, count_ptr,  # fp32 [M, N] and int32 [cdiv(N, BLOCK_N)], zero before and after
    M, N, K, stride_xm, stride_w, one, split_k,
    QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT: tl.constexpr,
    STAGES: tl.constexpr, ROW_ALIGN: tl.constexpr, WHOLE: tl.constexpr,
):
    # grid: (cdiv(N, BLOCK_N), split_k); a row is stride_w * ROW_ALIGN words: ROW_ALIGN = 4 tells
    # the compiler that rows start 16-byte aligned, so that 16-byte loads can be used; WHOLE:
    # the row's blocks are a multiple of 4 (see _f16_at)
    pid_n = tl.program_id(0)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = (rows < N)[None, :, None]
    row_w = (rows.to(tl.int64) * stride_w * ROW_ALIGN)[None, :, None]  # [1, BN, 1] first word
    # a thread reads 16-byte chunk h of the step's 128 quant bytes (Q4_K / Q5_K: chunks 2h and
    # 2h + 1, the 32 bytes of sub-blocks 2h and 2h + 1, so their scales decode once)
    H: tl.constexpr = 4 if QTYPE == 12 or QTYPE == 13 else 8
    h = tl.arange(0, H)[:, None, None]  # first dim: lanes go along chunks, then rows
    w = tl.arange(0, 4)[None, None, :]  # word of the chunk
    BPS: tl.constexpr = 1 if QTYPE >= 12 else (4 if QTYPE == 8 else 8)
    ELEMS: tl.constexpr = 256 if QTYPE >= 12 else 32  # weights of a block
    nb = K // ELEMS
    steps = tl.cdiv(nb, BPS)
    first, last = _split_k_range(steps, split_k)
    acc = tl.zeros((H, BLOCK_N, BLOCK_M), tl.float32)
    # the rows of x, one at a time in a loop that is not unrolled (unrolled 8 times, the body made
    # the compile take minutes); each row reuses the step's decoded weights
    ROWS_X = 1 if BLOCK_M == 1 else M
    for step in tl.range(first, last, num_stages=STAGES):
        # the step's block of chunk h (legacy blocks of 16 or 32 quant bytes) and its mask
        blk = step * BPS + h // (8 // BPS)  # [H, 1, 1]
        ok = row_ok & (blk < nb)  # [H, BN, 1]
        if QTYPE == 12 or QTYPE == 13:  # Q4_K / Q5_K: weights l of sub-blocks 2h and 2h + 1
            qs = w32_ptr + row_w + step * 32 + h * 4 + w  # chunks 2h, then (+16) 2h + 1
            wa = tl.load(qs, mask=ok, other=0)  # l = 0..15 (low nibble: sub-block 2h)
            wb = tl.load(qs + 16, mask=ok, other=0)  # l = 16..31
            # the 16-byte header: d, dmin | scale bytes 0-3, 4-7, 8-11
            hdr = tl.load(w32_ptr + row_w + nb * (32 if QTYPE == 12 else 40) + step * 4 + w
                          + 0 * h, mask=ok, other=0)
            w0 = _select(hdr, w, 0)
            w1, w2, w3 = _select(hdr, w, 1), _select(hdr, w, 2), _select(hdr, w, 3)
            d, dmin = _f16_of(w0, 0), _f16_of(w0, 1)
            sc_lo, mn_lo = _k_scale_min(w1, w2, w3, 2 * h)
            sc_hi, mn_hi = _k_scale_min(w1, w2, w3, 2 * h + 1)
            a_lo, a_hi = d * sc_lo * 256.0, d * sc_hi * 16.0  # u of the low / high nibble
            b_lo, b_hi = dmin * mn_lo, dmin * mn_hi
            qa0, qa1, qa2, qa3 = _byte_fracs(wa, 0xF << 15, one)  # low nibbles
            pa0, pa1, pa2, pa3 = _byte_fracs(wa, 0xF << 19, one)  # high nibbles
            qb0, qb1, qb2, qb3 = _byte_fracs(wb, 0xF << 15, one)
            pb0, pb1, pb2, pb3 = _byte_fracs(wb, 0xF << 19, one)
            if QTYPE == 13:  # bit 2h (low) / 2h + 1 (high) of qh[l]: the fifth bit, worth 16
                qh = w32_ptr + row_w + nb * 32 + step * 8 + w
                ha = tl.load(qh, mask=ok, other=0) >> (2 * h)
                hb = tl.load(qh + 4, mask=ok, other=0) >> (2 * h)
                ea0, ea1, ea2, ea3 = _byte_fracs(ha, 1 << 15, one)
                oa0, oa1, oa2, oa3 = _byte_fracs(ha, 1 << 16, one)
                eb0, eb1, eb2, eb3 = _byte_fracs(hb, 1 << 15, one)
                ob0, ob1, ob2, ob3 = _byte_fracs(hb, 1 << 16, one)
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
                    # in the nibble's units (sum q x * u): the bit is worth 16, its u is
                    # 2**-8 (bit 15) and 2**-7 (bit 16)
                    e_a, _ = _dot(ea0, ea1, ea2, ea3, x_lo, x_ok)
                    e_b, _ = _dot(eb0, eb1, eb2, eb3, x_lo + 16, x_ok)
                    o_a, _ = _dot(oa0, oa1, oa2, oa3, x_lo + 32, x_ok)
                    o_b, _ = _dot(ob0, ob1, ob2, ob3, x_lo + 48, x_ok)
                    qx_lo += (e_a + e_b - xs_lo) * 16.0
                    qx_hi += (o_a + o_b - xs_hi) * 128.0
                part = a_lo * qx_lo + a_hi * qx_hi - b_lo * xs_lo - b_hi * xs_hi
                acc = _add_row(acc, part, mi, BLOCK_M)
        else:
            words = tl.load(w32_ptr + row_w + step * 32 + h * 4 + w, mask=ok, other=0)
        if QTYPE == 14:  # Q6_K: chunk h = ql of half n, quarters i0 and i0 + 2, l 16 (h % 2)..
            n = h // 4
            i0 = h // 2 % 2
            lh = h % 2
            qh = tl.load(w32_ptr + row_w + nb * 32 + step * 16 + (2 * n + lh) * 4 + w, mask=ok,
                         other=0) >> (2 * i0)  # quarter i0's 2 bits at 8b, i0 + 2's at 8b + 4
            # int8 scale sub of quarter i0 (sub + 4 of quarter i0 + 2) of the 16 at nb * 192
            sub = 8 * n + 2 * i0 + lh
            scales = tl.load(w32_ptr + row_w + nb * 48 + step * 4 + w + 0 * h, mask=ok, other=0)
            sc_lo = (_select(scales, w, sub // 4) << (24 - sub % 4 * 8)) >> 24  # sign-extended
            sc_hi = (_select(scales, w, sub // 4 + 1) << (24 - sub % 4 * 8)) >> 24
            # d: the fp16 plane at byte nb * 208
            d = _f16_at(f16_ptr, row_w * 2 + nb * 104, step + 0 * h, nb, w, ok, WHOLE)
            sc_lo, sc_hi = sc_lo.to(tl.float32), sc_hi.to(tl.float32)
            a_lo, a_hi = d * sc_lo * 256.0, d * sc_hi * 16.0
            q0, q1, q2, q3 = _byte_fracs(words, 0xF << 15, one)
            p0, p1, p2, p3 = _byte_fracs(words, 0xF << 19, one)
            e0, e1, e2, e3 = _byte_fracs(qh, 3 << 15, one)
            o0, o1, o2, o3 = _byte_fracs(qh, 3 << 19, one)
            k_lo = step * 256 + n * 128 + i0 * 32 + lh * 16
            for mi in range(ROWS_X):
                x_lo = x_ptr + mi * stride_xm + k_lo + tl.arange(0, 4)[None, None, :]
                x_ok = mi < M
                s_lo, xs_lo = _dot(q0, q1, q2, q3, x_lo, x_ok)
                s_hi, xs_hi = _dot(p0, p1, p2, p3, x_lo + 64, x_ok)
                e_lo, _ = _dot(e0, e1, e2, e3, x_lo, x_ok)
                e_hi, _ = _dot(o0, o1, o2, o3, x_lo + 64, x_ok)
                # q = low 4 bits + 16 * high 2 bits - 32; the 2 bits share the nibble's u
                part = (a_lo * (s_lo - xs_lo + 16.0 * (e_lo - xs_lo) - xs_lo * (32.0 / 256.0))
                        + a_hi * (s_hi - xs_hi + 16.0 * (e_hi - xs_hi) - xs_hi * (32.0 / 16.0)))
                acc = _add_row(acc, part, mi, BLOCK_M)
        elif QTYPE == 8:  # Q8_0: chunk h = weights 16 (h % 2).. of block blk
            d = _f16_at(f16_ptr, row_w * 2 + nb * 16, blk, nb, w, ok, WHOLE)
            # signed bytes: XOR-ing the sign bits (0x80808080) gives q + 128 in 0..255
            q0, q1, q2, q3 = _byte_fracs(words ^ -0x7F7F7F80, 0xFF << 15, one)
            k_lo = step * 128 + h * 16
            for mi in range(ROWS_X):
                x_lo = x_ptr + mi * stride_xm + k_lo + tl.arange(0, 4)[None, None, :]
                s, xs = _dot(q0, q1, q2, q3, x_lo, (mi < M) & (k_lo < K))
                acc = _add_row(acc, d * ((s - xs) * 256.0 - 128.0 * xs), mi, BLOCK_M)
        elif QTYPE == 2 or QTYPE == 3:  # Q4_0 / Q4_1: chunk h = block blk, low nibbles weights
            # 0..15, high nibbles 16..31
            d = _f16_at(f16_ptr, row_w * 2 + nb * 8, blk, nb, w, ok, WHOLE)
            if QTYPE == 3:
                mn = _f16_at(f16_ptr, row_w * 2 + nb * 9, blk, nb, w, ok, WHOLE)
            else:
                mn = -8.0 * d
            q0, q1, q2, q3 = _byte_fracs(words, 0xF << 15, one)
            p0, p1, p2, p3 = _byte_fracs(words, 0xF << 19, one)
            k_lo = blk * 32
            for mi in range(ROWS_X):
                x_lo = x_ptr + mi * stride_xm + k_lo + tl.arange(0, 4)[None, None, :]
                x_ok = (mi < M) & (k_lo < K)
                s_lo, xs_lo = _dot(q0, q1, q2, q3, x_lo, x_ok)
                s_hi, xs_hi = _dot(p0, p1, p2, p3, x_lo + 16, x_ok)
                part = (d * ((s_lo - xs_lo) * 256.0 + (s_hi - xs_hi) * 16.0)
                        + mn * (xs_lo + xs_hi))
                acc = _add_row(acc, part, mi, BLOCK_M)
    total = tl.sum(acc, axis=0)  # [BN, BLOCK_M]
    m_idx = tl.arange(0, BLOCK_M)[None, :]
    at = m_idx * N + rows[:, None]
    y_mask = (rows < N)[:, None] & (m_idx < M)
    if not SPLIT:
        tl.store(y_ptr + at, total.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        tl.atomic_add(partial_ptr + at, total, mask=y_mask, sem="relaxed")
        # the last split of this row block turns the fp32 sums into y and re-zeroes them
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if done == split_k - 1:
            out = tl.load(partial_ptr + at, mask=y_mask, volatile=True)
            tl.store(y_ptr + at, out.to(y_ptr.dtype.element_ty), mask=y_mask)
            tl.store(partial_ptr + at, tl.zeros_like(out), mask=y_mask)
            tl.store(count_ptr + pid_n, 0)


def gemv_supported(type_id: int, K: int) -> bool:
    """Whether gguf_gemv takes this type and row length (its rows must be whole 32-bit words)."""
    return type_id in BLOCKS_PER_STEP and row_bytes(type_id, K) % 4 == 0


def gguf_gemv(x: torch.Tensor, qweight: torch.Tensor, type_id: int, block_n: int | None = None,
              num_warps: int = 2, num_stages: int = 1, split_k: int | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T, 1 <= M <= GEMV_MAX_M, qweight in the device layout.

    block_n rows per program (default: 4 rows a thread with num_warps warps); num_stages 1
    loads with plain vector loads (more stages pipeline them through shared memory)."""
    M, K = x.shape
    N = qweight.shape[0]
    if M > GEMV_MAX_M or not gemv_supported(type_id, K):
        raise ValueError(f"gguf_gemv takes 1..{GEMV_MAX_M} rows of x and whole-word rows of "
                         f"{sorted(BLOCKS_PER_STEP)}; got M={M}, type {type_id}, K={K}")
    if qweight.dtype != torch.uint8 or tuple(qweight.shape) != (N, row_bytes(type_id, K)):
        raise ValueError(f"gguf_gemv: a {ggml_type(type_id).name} weight with K={K} is uint8 "
                         f"[N, {row_bytes(type_id, K)}]; got {qweight.dtype} "
                         f"{list(qweight.shape)}")
    x, qweight = x.contiguous(), qweight.contiguous()
    if block_n is None:  # lanes cover 32 / (4 or 8 chunks) rows a warp; 4 rows a thread (2
        # for M > 1, whose x rows and sums need the registers)
        block_n = (4 if M == 1 else 2) * num_warps * (8 if type_id in (12, 13) else 4)
    n_blocks = cdiv(N, block_n)
    steps = cdiv(K // ggml_type(type_id).block_elems, BLOCKS_PER_STEP[type_id])
    if split_k is None:  # ~4 programs per SM (under the interpreter: few programs, fast tests)
        target = 4 * num_sms(x.device.index or 0) if x.is_cuda else 2
        split_k = max(1, min(steps, target // n_blocks))
    split_k = cdiv(steps, cdiv(steps, split_k))  # drop splits that would get no step
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    partial, count = _split_k_workspace(x.device, M * N, n_blocks)
    align = 4 if qweight.shape[1] % 16 == 0 else 1
    _gguf_gemv_kernel[(n_blocks, split_k)](
        x, qweight.view(torch.int32), qweight.view(torch.float16), y,
        partial, count, M, N, K, x.stride(0), qweight.shape[1] // 4 // align, _ONE, split_k,
        QTYPE=type_id, BLOCK_N=block_n, BLOCK_M=next_power_of_2(M), SPLIT=split_k > 1,
        STAGES=num_stages, ROW_ALIGN=align, WHOLE=K // ggml_type(type_id).block_elems % 4 == 0,
        num_warps=num_warps,
    )
    return y
