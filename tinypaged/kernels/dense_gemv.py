"""The dense decode GEMV: y [M, N] = x [M, K] @ W [N, K]^T (+ b) for 1 <= M <= 64.

W is an nn.Linear weight (bf16, fp16 or fp32, row n = output feature n, contiguous along K), or
an FP8 (e4m3) weight with its scales, W = q * s (W8A16: x stays in its dtype):
- per tensor: s [1, 1]; per channel: s [N, 1] (applied once to y's columns, after the sum);
- block-wise, weight_block (BN, BK) = (128, 128) (Qwen3-FP8, DeepSeek): s [N/BN, K/BK]. A
  program's BLOCK_N rows and a step's BLOCK_K inputs lie in one scale block (the tiles divide
  it), so each step's partial product is scaled by one number.
An e4m3 value converts exactly to bf16 / fp16 / fp32 (3 mantissa bits, exponents within
range), in registers after the load, so the products are those of the dequantized weight.
At decode batch sizes the product is bound by streaming W: 2 * N * K bytes (bf16; N * K for
FP8) against 2 * M * N * K FLOPs, i.e. M FLOPs per byte, far below the ~160 FLOPs per byte
where an H200 stops being memory-bound. So the kernel's only job is to read every weight exactly
once, at the copy bandwidth, from every SM at once:
- Programs own BLOCK_N output features (rows of W) and split K: a (column block, K range) grid
  of ~3 programs per SM. cuBLAS picks one tiling per shape and loses the tail of small layers
  (qkv, o) to launch and ramp time; splitting K lets a 4096x4096 layer fill 132 SMs.
- A step loads a [BLOCK_N, BLOCK_K] tile of W, rows contiguous (16-byte vector loads, a warp
  reads 512 bytes of one row), pipelined through shared memory (tl.range num_stages); or, with
  w_tma, by one TMA bulk copy a tile through a descriptor over W (kernels/tma.py).
- M = 1 (USE_DOT False): one FMA per weight on CUDA cores into a [BLOCK_N, BLOCK_K] fp32
  accumulator, reduced over K once at the end.
  An e4m3 weight converts on the way (two conversion instructions a weight on sm_90: e4m3x2 ->
  f16x2, f16 -> f32), which may bound the kernel before HBM does. W8_WORDS (w8_words) instead
  loads int32 words of 4 weights and builds each fp32 by a shift and a mask
  (_e4m3_byte_as_f32: exactly e4m3 * 2^-120, subnormals included); x, loaded as 4 vectors of
  every 4th input to match the bytes, is multiplied by 2^64 so that every product stays a
  normal fp32 number, and y by the exact 2^56 at the end: the same products as the conversion,
  summed in another order.
- 2 <= M <= DOT_MAX_M = 64 (USE_DOT True): y^T = W x^T on tensor cores, W in the MMA's M slot
  and x^T, padded to BLOCK_M (8 to 64) columns, in the N slot; M FMAs per weight would swamp
  the CUDA cores at 16 rows, while the weight's bytes bound a tensor-core product to well past
  64 (a speculative verification has k + 1 rows a sequence: 40 at batch 8, k = 4).
- quantize_x (FP8 weights, any M; $TINYPAGED_FP8_GEMV=w8a8dot): W8A8 with no conversion per
  weight. Each step quantizes its [BLOCK_K, BLOCK_M] slice of x^T to e4m3 in registers, one
  scale per row of x, s = max|x| / 448 (per token group of BLOCK_K, as quantize_fp8's groups),
  and tl.dot(w e4m3 [BLOCK_N, BLOCK_K], xq^T [BLOCK_K, BLOCK_M]) runs on FP8 tensor cores
  (wgmma m64n16k32 on sm_90: BLOCK_M 16, BLOCK_N >= 16 * num_warps; narrower tiles compile to
  an fp16 mma.sync on converted operands); the step's product is scaled by s per column (and
  the weight block's scale). The quantization costs O(BLOCK_K * BLOCK_M) per step against the
  BLOCK_N * BLOCK_K conversions of W8A16; at one row only the row's BLOCK_K values are
  quantized (X_COLS 1), zero columns then pad x^T to 16.
- fp32 accumulation. Split-K partial sums go by atomics into the persistent zeroed fp32
  workspace that every split-K GEMV shares (split_k.py); the last program of each column block
  (an arrival counter) adds the bias, writes y in x's dtype and re-zeroes it: one launch, no
  memset, no allocation inside a CUDA graph once the workspace exists.
Memory traffic: N * K * itemsize (W, once, and its scales) + split_k * M * K (x, from L2) +
M * N * (itemsize + 2 * 4 * [split]) bytes; for Llama-3-8B's layers W is > 99% of it.
With silu_and_mul the input is the MLP's gate_up [M, 2K] and x = silu(gate) * up is formed as
it is loaded (rounded to x's dtype, as activation.silu_and_mul stores it): the down projection
at decode without the activation's launch and its round trip through memory.
Which shapes take this kernel and which stay with cuBLAS: DENSE_GEMV_PATHS (chosen by
benchmarks/dense_gemv.py; figures in benchmarks/RESULTS.md); dense_linear applies it. FP8
weights take it for every decode shape (fp8_gemv_config; quantization/fp8.py's apply): the
alternative there is quantizing x and the W8A8 GEMM, one launch more for no fewer bytes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tinypaged import envs
from tinypaged.kernels._triton import cdiv, dot_precision, jit, tl, use_triton
from tinypaged.kernels.activation import silu_and_mul_ref
from tinypaged.kernels.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, _round_e4m3, dequantize_fp8
from tinypaged.kernels.pdl import launch_kwargs, pdl_enabled, pdl_trigger, pdl_wait, prefetch_rows
from tinypaged.kernels.split_k import (
    programs_target,
    split_k_finish,
    split_k_range,
    split_k_workspace,
)
from tinypaged.kernels.tma import w_operand, w_tma_fits

GEMV_MAX_M = 16  # rows of x up to which dense_linear may take the GEMV
DOT_MAX_M = 64  # rows of x the tensor-core path takes


@jit
def _silu_and_mul(gate, up):
    """silu(gate) * up in fp32, rounded to the inputs' dtype (activation.silu_and_mul's value)."""
    g = gate.to(tl.float32)
    return (g * tl.sigmoid(g) * up.to(tl.float32)).to(gate.dtype)


@jit
def _quantize_columns(xt, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                      ROUND_IN_FP32: tl.constexpr):
    """xt [BLOCK_K, BLOCK_M] fp32 -> (e4m3 values as fp32, the scales [BLOCK_M]): column m
    (row m of x) scaled by max|xt[:, m]| / FP8_MAX, as kernels/fp8.py's quantize_fp8."""
    sx = tl.maximum(tl.max(tl.abs(xt), axis=0) / FP8_MAX, MIN_SCALE)
    xq = tl.minimum(tl.maximum(xt * (1.0 / sx)[None, :], -FP8_MAX), FP8_MAX)
    if ROUND_IN_FP32:  # the interpreter's own fp32 -> e4m3 conversion truncates (fp8.py)
        xq = _round_e4m3(xq)
    return xq, sx


@jit
def _e4m3_byte_as_f32(words, J: tl.constexpr):
    """Byte J (0: the lowest) of each int32 word, an e4m3 value v, as the fp32 v * 2^-120, by
    integer ops alone: e4m3 is sign | 4 exponent bits (bias 7) | 3 mantissa bits, so its 7
    magnitude bits moved to fp32 bits 20-26 are the low 4 bits of an exponent of bias 127 and
    the top 3 mantissa bits: 2^(e - 127) (1 + m / 8) = v * 2^-120 for e >= 1, and for e = 0
    (e4m3's subnormals, 2^-6 m / 8) the fp32 subnormal 2^-126 m / 8, the same factor. Exact for
    every finite e4m3 value; the caller folds 2^120 into x and the scale."""
    t = words << (24 - 8 * J)  # byte J in bits 24-31 (its sign in fp32's sign bit)
    # an arithmetic shift: the sign lands in bits 27-31, the magnitude in 20-26; one mask keeps
    # bit 31 and the magnitude
    return ((t >> 4) & -0x78100000).to(tl.float32, bitcast=True)  # mask 0x87F00000


@jit
def _words_step(acc, w_ptrs, x_ptr, kq, K, x_scale, EVEN_K: tl.constexpr,
                SILU_AND_MUL: tl.constexpr):
    """One K step of the one-row W8_WORDS path: acc [BLOCK_N, BLOCK_K / 4] += the products of
    the int32 words at w_ptrs (e4m3 w[n, kq + j] in byte j) with x[kq + j] * x_scale."""
    if EVEN_K:
        words = tl.load(w_ptrs)
    else:  # K is a multiple of 4: a word lies wholly in or past K
        words = tl.load(w_ptrs, mask=(kq < K)[None, :], other=0)
    for j in tl.static_range(4):
        x = tl.load(x_ptr + kq + j, mask=kq < K, other=0.0)  # [BLOCK_K / 4]: every 4th input
        if SILU_AND_MUL:
            x = _silu_and_mul(x, tl.load(x_ptr + K + kq + j, mask=kq < K, other=0.0))
        acc += _e4m3_byte_as_f32(words, j) * (x.to(tl.float32) * x_scale)[None, :]
    return acc


@jit(do_not_specialize=("M", "split_k"))
def _dense_gemv_kernel(
    x_ptr, w_ptr, ws_ptr, b_ptr, y_ptr,  # x [M, K] (row stride stride_xm), W [N, K], b [N],
    # y [M, N]; ws: W's scales (W_SCALE 1: [N] at stride_wsn; 2: [N/BN, K/BK])
    partial_ptr, count_ptr,  # fp32 [M, N] and int32 [cdiv(N, BLOCK_N)], zero before and after
    M, N, K, stride_xm, stride_wn, stride_wsn, stride_wsk, split_k,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    W_SCALE: tl.constexpr,  # 0: W in x's dtype; FP8 W with 1: a scale per row n, 2: per block
    SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,  # the scale block (W_SCALE 2)
    SILU_AND_MUL: tl.constexpr,  # x_ptr is gate_up [M, 2K]: x = silu(gate) * up
    STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr,
    QUANTIZE_X: tl.constexpr,  # W8A8 on FP8 tensor cores: each step's x^T quantized to e4m3
    FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, ROUND_IN_FP32: tl.constexpr,
    X_COLS: tl.constexpr,  # BLOCK_M, or 1 for one row under QUANTIZE_X (no padded columns)
    W8_WORDS: tl.constexpr,  # one row, FP8 W: int32 words of 4 weights, converted by bit ops
    W_TMA: tl.constexpr,  # w_ptr: a TMA descriptor, [BLOCK_N, BLOCK_K] boxes (kernels/tma.py)
    USE_PDL: tl.constexpr,  # chained to the kernels around it (kernels/pdl.py)
):
    # grid: (cdiv(N, BLOCK_N), split_k); program (n, s) sums K-steps split_k_range(.., s) of
    # y[:, n * BLOCK_N : (n + 1) * BLOCK_N]
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_xm = tl.arange(0, X_COLS)  # the rows of x loaded (and quantized) for tl.dot
    m_mask = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    first, last = split_k_range(tl.cdiv(K, BLOCK_K), split_k)
    if not W_TMA:  # rows past N read row n % N (in bounds, unmasked loads), are not stored
        w_ptrs = w_ptr + (offs_n % N)[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
        # PDL: W's first two steps into L2 while the kernel before this one runs
        prefetch_rows(w_ptr, offs_n % N, stride_wn, first * BLOCK_K, K, 2 * BLOCK_K, USE_PDL)
    pdl_wait(USE_PDL)
    # block-wise: this program's rows lie in scale row pid_n * BLOCK_N // SCALE_BN
    ws_row = ws_ptr + (pid_n * BLOCK_N // SCALE_BN) * stride_wsn
    if USE_DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)  # y^T
    elif W8_WORDS:  # word q of a row holds w[n, 4q .. 4q + 3]; stride_wn and K are 4-aligned
        offs_q = tl.arange(0, BLOCK_K // 4)
        words_ptrs = w_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + \
            (offs_n % N)[:, None] * (stride_wn // 4) + offs_q[None, :]  # [BLOCK_N, BLOCK_K / 4]
        acc = tl.zeros((BLOCK_N, BLOCK_K // 4), tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)  # per-lane sums, reduced over K below
    for step in tl.range(first, last, num_stages=STAGES):
        k = step * BLOCK_K + offs_k
        if W8_WORDS:
            # x times 2^64: its products with w * 2^-120 stay normal fp32 numbers (products of
            # w's subnormals too), so the sums round as those of x * w would; y gets 2^56 below
            x_scale = 18446744073709551616.0
            if W_SCALE == 2:
                x_scale *= tl.load(ws_row + (step * BLOCK_K // SCALE_BK) * stride_wsk)
            acc = _words_step(acc, words_ptrs + step * (BLOCK_K // 4), x_ptr,
                              step * BLOCK_K + 4 * offs_q, K, x_scale, EVEN_K, SILU_AND_MUL)
        elif W_TMA:  # one bulk copy a tile; rows past N, columns past K come in as zeros
            w = w_ptr.load([pid_n * BLOCK_N, step * BLOCK_K])
        elif EVEN_K:
            w = tl.load(w_ptrs + step * BLOCK_K)
        else:
            w = tl.load(w_ptrs + step * BLOCK_K, mask=(k < K)[None, :], other=0.0)
        if W_SCALE != 0 and USE_DOT and not QUANTIZE_X:  # e4m3 -> x's dtype, exact
            w = w.to(x_ptr.dtype.element_ty)
        if USE_DOT:
            xt_ptrs = x_ptr + offs_xm[None, :] * stride_xm + k[:, None]  # [BLOCK_K, X_COLS]
            xt_mask = (offs_xm < M)[None, :] & (k < K)[:, None]
            xt = tl.load(xt_ptrs, mask=xt_mask, other=0.0)
            if SILU_AND_MUL:
                xt = _silu_and_mul(xt, tl.load(xt_ptrs + K, mask=xt_mask, other=0.0))
            if QUANTIZE_X:  # W8A8: e4m3 x^T, one scale per row of x and step -> [BLOCK_M]
                xq, sx = _quantize_columns(xt.to(tl.float32), FP8_MAX, MIN_SCALE, ROUND_IN_FP32)
                if X_COLS < BLOCK_M:  # one row, quantized alone; zero columns pad x^T
                    xq = tl.where(offs_m[None, :] == 0, xq, 0.0)
                part = tl.dot(w, xq.to(w.dtype), out_dtype=tl.float32) * sx[None, :]
                if W_SCALE == 2:
                    part *= tl.load(ws_row + (step * BLOCK_K // SCALE_BK) * stride_wsk)
                acc += part
            elif W_SCALE == 2:  # this step's product times its block's scale, in fp32
                s = tl.load(ws_row + (step * BLOCK_K // SCALE_BK) * stride_wsk)
                acc += tl.dot(w, xt, input_precision=DOT_PRECISION) * s
            else:
                acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
        elif not W8_WORDS:
            x = tl.load(x_ptr + k, mask=k < K, other=0.0)  # [BLOCK_K]
            if SILU_AND_MUL:
                x = _silu_and_mul(x, tl.load(x_ptr + K + k, mask=k < K, other=0.0))
            x = x.to(tl.float32)
            if W_SCALE == 2:  # the block's scale on x: BLOCK_K multiplies, not BLOCK_N * BLOCK_K
                x *= tl.load(ws_row + (step * BLOCK_K // SCALE_BK) * stride_wsk)
            acc += w.to(tl.float32) * x[None, :]  # an e4m3 w straight to fp32
    pdl_trigger(USE_PDL)  # the next kernel's programs may take the SMs this one leaves
    if USE_DOT:
        out = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    else:
        out = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]
    if W8_WORDS:  # 2^-120 (w) * 2^64 (x): exact, a power of two on normal numbers
        out *= 72057594037927936.0  # 2^56
    if W_SCALE == 1:  # per row (stride_wsn 0: one scale for the tensor)
        out *= tl.load(ws_ptr + (offs_n % N) * stride_wsn)[None, :]
    at = offs_m[:, None] * N + offs_n[None, :]  # y[m, n], [BLOCK_M, BLOCK_N]
    mask = m_mask[:, None] & n_mask[None, :]
    if not SPLIT:
        if HAS_BIAS:
            out += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + at, out.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(partial_ptr + at, out, mask=mask, sem="relaxed")
        # the last split of this column block writes y (split_k.py)
        split_k_finish(y_ptr, partial_ptr, count_ptr, pid_n, split_k, at, mask,
                       b_ptr + offs_n[None, :], n_mask[None, :], HAS_BIAS)


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               weight_scale: torch.Tensor | None = None,
               weight_block: tuple[int, int] | None = None, silu_and_mul: bool = False,
               block_n: int | None = None, block_k: int = 256, split_k: int | None = None,
               num_warps: int = 4, num_stages: int = 3, min_block_m: int = 16,
               programs_per_sm: int = 3, tensor_cores: bool | None = None,
               quantize_x: bool = False, w8_words: bool = False,
               w_tma: bool = False) -> torch.Tensor:
    """y [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]), 1 <= M <= 64, fp32 accumulation, in
    x's dtype (the Triton kernel; dense_linear and the FP8 linear decide when to call it).

    weight: in x's dtype, or float8_e4m3fn with weight_scale (fp32: [1, 1] per tensor, [N, 1]
    per channel, or [cdiv(N, BN), cdiv(K, BK)] per weight_block (BN, BK)).
    silu_and_mul: x is gate_up [M, 2K] and the product is silu_and_mul(x) @ weight^T.
    block_n: output features per program (default 16 at M = 1, 64 with tensor cores);
    block_k: K per step; split_k: programs sharing a column block's K (default ~programs_per_sm
    programs per SM); min_block_m: x^T padded to at least this many columns for tl.dot (8 or 16;
    the interpreter needs 16); tensor_cores: tl.dot instead of CUDA-core FMAs (default: from
    two rows on). A block-wise weight's scale block must be whole tiles: block_k is cut to BK,
    and BN must be a multiple of block_n.
    quantize_x (FP8 weights, W8A8 on FP8 tensor cores, any M): each K step's [M, block_k] slice
    of x is quantized to e4m3 in registers, one scale per row (dense_gemv_reference's too);
    x^T is padded to 16 columns whatever min_block_m says.
    w8_words (FP8 weights, one row on the CUDA cores): the weight read as int32 words and each
    e4m3 byte turned into fp32 by shifts and masks (_e4m3_byte_as_f32) instead of the
    conversion instructions; ignored where K or the weight's row stride is not a multiple of 4
    (or the tensor-core path runs). The same products, summed in another order.
    w_tma: the weight's tiles by TMA (kernels/tma.py) where a descriptor fits and w8_words does
    not apply, else by pointer loads."""
    M, K = x.shape[0], x.shape[1] // 2 if silu_and_mul else x.shape[1]
    N = weight.shape[0]
    if silu_and_mul and x.shape[1] != 2 * weight.shape[1]:
        raise ValueError(f"dense_gemv: silu_and_mul takes x [M, 2K] for weight [N, K]; got x "
                         f"{tuple(x.shape)}, weight {tuple(weight.shape)}")
    if not 1 <= M <= DOT_MAX_M:
        raise ValueError(f"dense_gemv: x has {M} rows; the GEMV takes 1 to {DOT_MAX_M} "
                         "(use F.linear for more)")
    fp8 = weight.dtype == torch.float8_e4m3fn
    if tuple(weight.shape) != (N, K) or weight.stride(1) != 1 or (
            weight.dtype != x.dtype and not fp8):
        raise ValueError(f"dense_gemv: weight must be [N, K={K}] contiguous along K in x's dtype "
                         f"{x.dtype} or float8_e4m3fn, got {weight.dtype} of shape "
                         f"{tuple(weight.shape)} and strides {weight.stride()}")
    if fp8 != (weight_scale is not None):
        raise ValueError("dense_gemv: an FP8 weight needs its weight_scale, and only an FP8 "
                         f"weight takes one (weight {weight.dtype}, weight_scale "
                         f"{None if weight_scale is None else tuple(weight_scale.shape)})")
    if quantize_x and not fp8:
        raise ValueError(f"dense_gemv: quantize_x needs an FP8 weight, got {weight.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    use_dot = (M > 1 or quantize_x) if tensor_cores is None else tensor_cores
    if (M > 1 or quantize_x) and not use_dot:
        raise ValueError(f"dense_gemv: the CUDA-core path takes one row of x and no quantize_x, "
                         f"got {M} rows, quantize_x={quantize_x}")
    block_n = block_n or (64 if use_dot else 16)
    if weight_block is not None:
        block_k = min(block_k, weight_block[1])
    w_scale, scale_block, scale_strides = _scale_layout(weight_scale, weight_block, N, K,
                                                        block_n, block_k)
    if not x.is_cuda or quantize_x:  # the interpreter's tl.dot takes 16 columns and up; on
        # sm_90 Triton 3.6 takes an e4m3 x^T of 8 columns, but to an fp16 mma.sync after
        # converting both operands: the wgmma on e4m3 (m64n16k32) wants 16
        min_block_m = max(min_block_m, 16)
    block_m = max(min_block_m, 1 << (M - 1).bit_length()) if use_dot else 1
    w8_words = w8_words and fp8 and not use_dot and K % 4 == 0 and weight.stride(0) % 4 == 0 \
        and weight.data_ptr() % 4 == 0 and block_k % 4 == 0
    use_tma = w_tma and not w8_words and w_tma_fits(weight, block_n, block_k)
    n_blocks = cdiv(N, block_n)
    steps = cdiv(K, block_k)
    if split_k is None:
        target = programs_target(x.device) * programs_per_sm // 4
        split_k = max(1, min(steps, cdiv(target, n_blocks)))
    split_k = cdiv(steps, cdiv(steps, split_k))  # drop splits that would get no step
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    # sized for GEMV_MAX_M rows and 8-row blocks whatever M and the tiles are, so that no decode
    # batch size reallocates it after another one's CUDA graph captured it (more rows than
    # dense_linear routes here: DOT_MAX_M)
    ws_rows = GEMV_MAX_M if M <= GEMV_MAX_M else DOT_MAX_M
    partial, count = (split_k_workspace(x.device, ws_rows * N, cdiv(N, 8)) if split_k > 1
                      else (y, y))
    pdl = pdl_enabled(x)
    _dense_gemv_kernel[(n_blocks, split_k)](
        x, w_operand(weight, use_tma, block_n, block_k),
        y if weight_scale is None else weight_scale, y if bias is None else bias, y,
        partial, count, M, N, K, x.stride(0), weight.stride(0), *scale_strides, split_k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=use_dot,
        EVEN_K=K % block_k == 0, HAS_BIAS=bias is not None, SPLIT=split_k > 1,
        W_SCALE=w_scale, SCALE_BN=scale_block[0], SCALE_BK=scale_block[1],
        SILU_AND_MUL=silu_and_mul, STAGES=num_stages, DOT_PRECISION=dot_precision(x.dtype),
        QUANTIZE_X=quantize_x, FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE,
        ROUND_IN_FP32=not x.is_cuda, X_COLS=1 if quantize_x and M == 1 else block_m,
        W8_WORDS=w8_words, W_TMA=use_tma, USE_PDL=pdl, num_warps=num_warps, **launch_kwargs(pdl),
    )
    return y


def _scale_layout(weight_scale: torch.Tensor | None, weight_block: tuple[int, int] | None,
                  N: int, K: int, block_n: int, block_k: int
                  ) -> tuple[int, tuple[int, int], tuple[int, int]]:
    """The kernel's W_SCALE, (SCALE_BN, SCALE_BK) and the scale's (row, column) strides."""
    if weight_scale is None:
        return 0, (1, 1), (0, 0)
    if weight_scale.dtype != torch.float32:
        raise ValueError(f"dense_gemv: weight_scale must be float32, got {weight_scale.dtype}")
    if weight_block is None:
        if weight_scale.numel() == 1:
            return 1, (1, 1), (0, 0)
        if weight_scale.numel() != N:
            raise ValueError(f"dense_gemv: weight_scale must be [1, 1] (per tensor) or [N={N}, 1] "
                             f"(per channel), got {tuple(weight_scale.shape)}")
        return 1, (1, 1), (weight_scale.stride(0), 0)
    bn, bk = weight_block
    if weight_scale.shape != (cdiv(N, bn), cdiv(K, bk)):
        raise ValueError(f"dense_gemv: a [{bn}, {bk}]-block weight_scale must be "
                         f"[{cdiv(N, bn)}, {cdiv(K, bk)}], got {tuple(weight_scale.shape)}")
    if bn % block_n or bk % block_k:
        raise ValueError(f"dense_gemv: the scale block [{bn}, {bk}] must be whole tiles of "
                         f"[block_n, block_k] = [{block_n}, {block_k}]")
    return 2, (bn, bk), (weight_scale.stride(0), weight_scale.stride(1))


def dense_gemv_reference(x: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None,
                         weight_scale: torch.Tensor | None = None,
                         weight_block: tuple[int, int] | None = None,
                         silu_and_mul: bool = False, **config) -> torch.Tensor:
    """The torch reference of dense_gemv (same signature; tile settings are ignored but for
    quantize_x's block_k): fp32 products and sums of the (dequantized) weight, the result in
    x's dtype."""
    if silu_and_mul:
        x = silu_and_mul_ref(x)
    if config.get("quantize_x"):
        y = _w8a8_steps(x, weight, weight_scale, weight_block, config.get("block_k", 256))
    else:
        w = weight.float() if weight_scale is None else \
            dequantize_fp8(weight, weight_scale, weight_block)
        y = x.float() @ w.t()
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


def _w8a8_steps(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                weight_block: tuple[int, int] | None, block_k: int) -> torch.Tensor:
    """quantize_x's product, fp32 [M, N]: x [M, K] in K steps of block_k, each step's slice
    quantized to e4m3 with one scale per row (as the kernel: times 1 / scale, then rounded to
    nearest), its product with the e4m3 weight times that scale (and the weight block's)."""
    M, K = x.shape
    N = weight.shape[0]
    if weight_block is not None:
        block_k = min(block_k, weight_block[1])
    steps = cdiv(K, block_k)
    xs = F.pad(x.float(), (0, steps * block_k - K)).reshape(M, steps, block_k)
    sx = (xs.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)  # [M, steps, 1]
    xq = (xs * (1.0 / sx)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()
    wq = F.pad(weight.float(), (0, steps * block_k - K)).reshape(N, steps, block_k)
    parts = torch.einsum("msk,nsk->smn", xq, wq) * sx.permute(1, 0, 2)  # [steps, M, N]
    if weight_block is not None:  # the scale of the weight block each (step, column) lies in
        ws = weight_scale.repeat_interleave(weight_block[0], 0)[:N]  # [N, K / BK]
        step_block = torch.arange(steps, device=ws.device) * block_k // weight_block[1]
        parts *= ws[:, step_block].t()[:, None, :]
        return parts.sum(0)
    return parts.sum(0) * weight_scale.reshape(1, -1)


_ANY = 1 << 30
_TENSOR_CORES = dict(block_k=128, num_stages=4, min_block_m=8)  # x^T padded to 8 columns
# (max M, min K, max K, min N, max N, tile configuration): the decode shapes that take
# dense_gemv on CUDA, first match wins; every other shape (and M > GEMV_MAX_M) runs F.linear
# (cuBLAS). At one row the GEMV matched or beat cuBLAS on every layer measured: cuBLAS already
# streams the large layers at about the copy bandwidth, and on small ones (Qwen3-0.6B's, o) it
# loses the tail to launch and ramp time that split K removes. At 2..8 rows the Llama-3-8B-sized
# layers (K >= 4096) take the GEMV with a tile per shape, from an H200 sweep at 5 rows (a batch-1
# verification at k = 4): within 3% of the one-row GEMV's time on every layer, where cuBLAS took
# 6% more summed, and it joins the step's PDL chain; split K to about one program per SM on the
# wide (gate-up) and long-K (down) weights, the weight by TMA but on the long K. Smaller layers
# keep cuBLAS at 2..16 rows except the LM heads and the o-sized ones. Figures:
# benchmarks/RESULTS.md (Decode; Speculative decoding).
DENSE_GEMV_PATHS: tuple[tuple[int, int, int, int, int, dict], ...] = (
    (1, 0, 1024, 0, _ANY, dict(split_k=1)),  # K <= 1024: too few K steps to split
    (1, 0, _ANY, 0, _ANY, dict(programs_per_sm=2)),
    (GEMV_MAX_M, 0, _ANY, 65536, _ANY, _TENSOR_CORES),  # LM heads
    # Llama-3-8B's down (14336x4096), gate-up (4096x28672), o (4096x4096), qkv (4096x6144)
    (8, 12288, _ANY, 4096, 65535, dict(_TENSOR_CORES, programs_per_sm=1)),
    (8, 4096, 8191, 16384, 65535, dict(_TENSOR_CORES, programs_per_sm=1, w_tma=True)),
    (8, 4096, 8191, 4096, 4096, dict(_TENSOR_CORES, block_n=128, programs_per_sm=2, w_tma=True)),
    (8, 4096, 8191, 4097, 16383, dict(_TENSOR_CORES, programs_per_sm=4, w_tma=True)),
    (8, 2048, 4096, 0, 4096, _TENSOR_CORES),  # o-sized: 2048x1024, 3072x1024
)


def gemv_config(M: int, N: int, K: int) -> dict | None:
    """The tile configuration of the first DENSE_GEMV_PATHS row that fits, None for cuBLAS."""
    for max_m, min_k, max_k, min_n, max_n, config in DENSE_GEMV_PATHS:
        if M <= max_m and min_k <= K <= max_k and min_n <= N <= max_n:
            return config
    return None


# FP8 weights at decode, two modes ($TINYPAGED_FP8_GEMV, fp8_gemv_mode):
# - "w8a16": x as it is, the e4m3 weight converted in registers. Each stage moves as many bytes
#   as the bf16 tables' tiles (twice the values: block_k doubled); block-wise weights keep
#   block_k at the scale block (128) and widen block_n instead. One row only: on an H200 the
#   one-row tiles beat W8A8 at batch 1, while the untuned "rows" tiles lost to it at batch 8
#   (benchmarks/RESULTS.md, Quantized decode).
# - "w8a8dot" (quantize_x): FP8 tensor cores, no conversion per weight, 1-16 rows; one entry
#   per power of two of rows (fp8_gemv_config rounds M up). Its tiles below are the H200
#   sweep's best (benchmarks/fp8_gemv.py --sweep-dot prints this table), and even so it
#   streamed the weights no faster than w8a16 at one row nor than quantizing x for the W8A8
#   GEMM at 2-16 rows (benchmarks/RESULTS.md, Quantized decode): each K step's quantization of
#   x and the scaling of its partial product cost what the conversion per weight saved. So
#   w8a16 stays the default.
FP8_GEMV_MODES = ("w8a16", "w8a8dot")
FP8_GEMV_MAX_M = {"w8a16": 1, "w8a8dot": GEMV_MAX_M}  # rows up to which FP8 takes the GEMV
# the sweep's best w8a8dot tile from 2 rows on (it prints one row per key; equal rows kept once)
_DOT_ROWS = dict(block_n=128, block_k=128, num_warps=8, num_stages=4, programs_per_sm=2,
                 quantize_x=True)
# W8A16 at one row, by the weight's shape (fp8_gemv_config). K is split only where the column
# blocks leave SMs without a program (programs_per_sm 1): on the H200, splitting the 4096-wide
# layers (o, down) in two lost more than their extra programs gained. The down
# projection's input formed as it loads (silu_and_mul: two loads and a sigmoid a column, shared
# by the tile's rows) takes long K steps; a wide weight (N >= WIDE_N, thousands of column blocks)
# short steps of more rows, so that more programs fit an SM. w8_words (e4m3 bytes to fp32 by
# integer ops) or the weight by TMA (w_tma) where the H200 sweep finds it faster
# (benchmarks/fp8_gemv.py --sweep-rows prints this table; --sweep, each shape's best tiles).
WIDE_N = 16384
FP8_ONE_ROW_CONFIGS = {
    "one_row": dict(block_n=16, block_k=512, num_stages=4, programs_per_sm=1),
    "one_row_wide": dict(block_n=32, block_k=256, num_stages=4, programs_per_sm=1),
    "one_row_silu": dict(block_n=16, block_k=1024, num_stages=4, programs_per_sm=1),
    "one_row_block": dict(block_n=64, block_k=128, num_warps=4, num_stages=3,
                          programs_per_sm=2, w_tma=True),
}
FP8_GEMV_CONFIGS = {
    **FP8_ONE_ROW_CONFIGS,
    "rows": dict(block_n=64, block_k=256, num_stages=4, min_block_m=8),
    "rows_block": dict(block_n=64, block_k=128, num_stages=4, min_block_m=8),
    "w8a8dot_m1": dict(block_n=128, block_k=256, num_warps=4, num_stages=3,
                       programs_per_sm=2, quantize_x=True),
    "w8a8dot_m1_block": dict(block_n=64, block_k=128, num_warps=4, num_stages=4,
                             programs_per_sm=3, quantize_x=True),
    **{f"w8a8dot_m{m}{block}": _DOT_ROWS for m in (2, 4, 8) for block in ("", "_block")},
    **{f"w8a8dot_m16{block}": dict(_DOT_ROWS, programs_per_sm=3) for block in ("", "_block")},
}


def fp8_gemv_mode() -> str:
    """$TINYPAGED_FP8_GEMV: "w8a16" (the default) or "w8a8dot"; read at call time, so set it
    before CUDA graphs are captured."""
    return envs.TINYPAGED_FP8_GEMV


def fp8_gemv_config(M: int, block: tuple[int, int] | None, mode: str = "w8a16", N: int = 0,
                    silu_and_mul: bool = False) -> dict:
    """dense_gemv's tiles for an FP8 weight [N, K] at M rows (block: the weight's scale block;
    silu_and_mul: the input is gate_up, formed as it loads)."""
    if mode == "w8a8dot":
        key = f"w8a8dot_m{1 << (M - 1).bit_length()}"
    elif M > 1:
        key = "rows"
    elif block:
        key = "one_row"
    else:
        key = "one_row_silu" if silu_and_mul else "one_row_wide" if N >= WIDE_N else "one_row"
    return FP8_GEMV_CONFIGS[key + ("_block" if block else "")]


def gemv_enabled() -> bool:
    """$TINYPAGED_DENSE_GEMV=0 turns the GEMV off (every dense linear runs F.linear): the A/B
    switch for benchmarks; read at call time, so set it before CUDA graphs are captured."""
    return envs.TINYPAGED_DENSE_GEMV


def dense_linear(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K], through dense_gemv where DENSE_GEMV_PATHS says it
    beats cuBLAS (CUDA, decode-sized M, Triton kernels in use); F.linear everywhere else,
    including on CPU."""
    M = x.shape[0]
    if (x.dim() == 2 and x.is_cuda and 1 <= M <= GEMV_MAX_M and weight.dtype == x.dtype
            and weight.stride(1) == 1 and use_triton(x) and gemv_enabled()):
        config = gemv_config(M, weight.shape[0], x.shape[1])
        if config is not None:
            return dense_gemv(x, weight, bias, **config)
    return F.linear(x, weight, bias)
