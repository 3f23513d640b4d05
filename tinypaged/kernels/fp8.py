"""FP8 (e4m3) W8A8 linear kernels: activation quantization and the scaled FP8 GEMM.

    quantize_fp8(x, group=None, scale=None) -> (q, s)
        x [M, K] -> q float8_e4m3fn [M, K] and fp32 scales with x ~= q * s:
        - dynamic per token (group=None): s [M, 1], s[m] = max|x[m]| / 448;
        - dynamic per token group (group=G, DeepSeek / Qwen3-FP8 block-wise): s [M, K/G];
        - static per tensor (scale given, a checkpoint's input_scale): s [1, 1] = scale.
    fp8_gemm(a, a_scale, w, w_scale, out_dtype, block=None) -> y [M, N]
        y = (a * a_scale) @ (w * w_scale)^T with a [M, K], w [N, K] (the checkpoint's layout, K
        contiguous: the K-major B operand Hopper's FP8 wgmma reads) both float8_e4m3fn:
        - block=None: a_scale [M, 1] or [1, 1], w_scale [N, 1] or [1, 1]; the scales are applied
          once, in the epilogue (per-tensor, per-channel x per-token);
        - block=(BN, BK): a_scale [M, K/BK] (per token group), w_scale [N/BN, K/BK]; each K step
          of BK is scaled by its block's pair of scales as it is accumulated.

Both run one Triton kernel on CUDA (or under TRITON_INTERPRET=1), else the torch reference of
the same signature (`*_reference`). The GEMM is the prefill path (tiles of 128 x 128 x 128, fp32
accumulators from tl.dot on fp8 operands: wgmma on Hopper) and, with 16-row tiles and narrow
N tiles, the W8A8 decode path where kernels/fp8_rows.py does not take it (one row, or
$TINYPAGED_FP8_ROWS=0; fp8_rows.py says why those tiles leave FP8 wgmma unused).

The fp32 -> e4m3 conversion rounds to nearest even on the GPU (Triton emits sm_90's
cvt.rn.satfinite, bit for bit torch's cast); the Triton interpreter's own conversion truncates
where rounding carries into the exponent (126.1 -> 64, not 128). So under the interpreter the
kernels first round in fp32 with `_round_e4m3` (ROUND_IN_FP32, set for CPU tensors), which gives
the same values (a negative value that rounds to zero gives +0, not -0). Not on the GPU: its
ten-odd integer ops a value made the activation quantizers ALU-bound (the SiLU-and-mul + quantize
of a 16,384-row prefill step took 1.3x as long with them).
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import cdiv, jit, next_power_of_2, tl, use_triton
from tinypaged.kernels.pdl import launch_kwargs, pdl_enabled, pdl_trigger, pdl_wait
from tinypaged.kernels.tma import w_operand, w_tma_fits

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # an all-zero row still gets a finite scale
MAX_ONE_PASS = 16384  # the widest row quantized from registers in one pass


# ---------------------------------------------------------------- references (CPU path, tests)

def quantize_fp8_reference(x: torch.Tensor, group: int | None = None,
                           scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring; the definition the Triton kernel is tested against."""
    M, K = x.shape
    xf = x.float()
    if scale is not None:
        s = scale.float().reshape(1, 1).to(x.device)
        return (xf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), s
    G = K if group is None else group
    if K % G:
        raise ValueError(f"quantize_fp8: {K} inputs are not a whole number of groups of {G}")
    xg = xf.reshape(M, K // G, G)
    s = (xg.abs().amax(-1) / FP8_MAX).clamp_min(MIN_SCALE)  # [M, K/G]
    q = (xg / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).reshape(M, K)
    return q, s


def dequantize_fp8(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int] | None = None):
    """q [R, C] fp8 -> fp32 q * s, with s [R, 1] / [1, 1] (broadcast) or, for `block` (BR, BC),
    one scale per block: s [ceil(R / BR), ceil(C / BC)]."""
    if block is None:
        return q.float() * s.float()
    R, C = q.shape
    s = s.float().repeat_interleave(block[0], 0)[:R].repeat_interleave(block[1], 1)[:, :C]
    return q.float() * s


def fp8_gemm_reference(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor,
                       w_scale: torch.Tensor, out_dtype: torch.dtype,
                       block: tuple[int, int] | None = None) -> torch.Tensor:
    """See the module docstring: the product of the dequantized operands in fp32."""
    a_block = None if block is None else (1, block[1])
    y = dequantize_fp8(a, a_scale, a_block) @ dequantize_fp8(w, w_scale, block).t()
    return y.to(out_dtype)


# ---------------------------------------------------------------- activation quantization

@jit
def _round_e4m3(x):
    """x (fp32, |x| <= 448) rounded to the nearest e4m3 value, ties to even (module docstring)."""
    b = x.to(tl.int32, bitcast=True)
    b = (b + 0x7FFFF + ((b >> 20) & 1)) & -1048576  # 3 mantissa bits, the carry into the exponent
    y = b.to(tl.float32, bitcast=True)
    sub = (x * 512.0 + 12582912.0) - 12582912.0  # subnormals: multiples of 2^-9 (1.5 * 2^23 trick)
    return tl.where(tl.abs(x) < 0.015625, sub * 0.001953125, y)


@jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, static_ptr, K, stride_xm, stride_qm, stride_sm,
                     GROUP: tl.constexpr, BLOCK: tl.constexpr, STATIC: tl.constexpr,
                     ONE_PASS: tl.constexpr,
                     FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                     ROUND_IN_FP32: tl.constexpr,  # the interpreter's rounding (docstring)
                     USE_PDL: tl.constexpr = False):  # chained to its neighbours (pdl.py)
    # one program: row m, inputs [g * GROUP, (g + 1) * GROUP), in chunks of BLOCK
    pdl_trigger(USE_PDL)
    pdl_wait(USE_PDL)
    m = tl.program_id(0)
    g = tl.program_id(1)
    x_row = x_ptr + m * stride_xm + g * GROUP
    q_row = q_ptr + m * stride_qm + g * GROUP
    cols = tl.arange(0, BLOCK)
    if ONE_PASS:  # the group fits one block: read it once, keep it in registers
        mask = (cols < GROUP) & (g * GROUP + cols < K)
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if STATIC:
            scale = tl.load(static_ptr).to(tl.float32)
        else:
            scale = tl.maximum(tl.max(tl.abs(x), 0) / FP8_MAX, MIN_SCALE)
            tl.store(s_ptr + m * stride_sm + g, scale)
        y = tl.minimum(tl.maximum(x * (1.0 / scale), -FP8_MAX), FP8_MAX)
        if ROUND_IN_FP32:
            y = _round_e4m3(y)
        tl.store(q_row + cols, y.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        if STATIC:
            scale = tl.load(static_ptr).to(tl.float32)
        else:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for k0 in range(0, GROUP, BLOCK):
                mask = (k0 + cols < GROUP) & (g * GROUP + k0 + cols < K)
                x = tl.load(x_row + k0 + cols, mask=mask, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            scale = tl.maximum(tl.max(amax, 0) / FP8_MAX, MIN_SCALE)
            tl.store(s_ptr + m * stride_sm + g, scale)
        inv = 1.0 / scale
        for k0 in range(0, GROUP, BLOCK):
            mask = (k0 + cols < GROUP) & (g * GROUP + k0 + cols < K)
            x = tl.load(x_row + k0 + cols, mask=mask, other=0.0).to(tl.float32)
            y = tl.minimum(tl.maximum(x * inv, -FP8_MAX), FP8_MAX)
            if ROUND_IN_FP32:
                y = _round_e4m3(y)
            tl.store(q_row + k0 + cols, y.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_fp8(x: torch.Tensor, group: int | None = None,
                 scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring."""
    if not use_triton(x):
        return quantize_fp8_reference(x, group, scale)
    M, K = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    q = torch.empty(M, K, dtype=FP8_DTYPE, device=x.device)
    if scale is not None:
        s = scale.float().reshape(1, 1)
        G = K
        grid = (M, 1)
    else:
        G = K if group is None else group
        if K % G:
            raise ValueError(f"quantize_fp8: {K} inputs are not a whole number of groups of {G}")
        s = torch.empty(M, K // G, dtype=torch.float32, device=x.device)
        grid = (M, K // G)
    if M:
        # up to 16K inputs a row (group) is one block, read once; wider ones in two passes
        block = min(next_power_of_2(G), MAX_ONE_PASS)
        pdl = pdl_enabled(x)
        _quantize_kernel[grid](x, q, s, s, K, x.stride(0), q.stride(0), s.stride(0), GROUP=G,
                               BLOCK=block, STATIC=scale is not None, ONE_PASS=block >= G,
                               FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE,
                               ROUND_IN_FP32=not x.is_cuda, USE_PDL=pdl,
                               num_warps=max(1, min(16, block // 1024)), **launch_kwargs(pdl))
    return q, s


# ---------------------------------------------------------------- the scaled FP8 GEMM

@jit(do_not_specialize=("M",))
def _fp8_gemm_kernel(a_ptr, w_ptr, c_ptr, as_ptr, ws_ptr, M, N, K,
                     stride_am, stride_wn, stride_cm, stride_asm, stride_ask, stride_wsn,
                     stride_wsk, BLOCKWISE: tl.constexpr, SCALE_BN: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, TMA: tl.constexpr = False):
    # TMA: a_ptr and w_ptr are descriptors over a [M, K] and w [N, K] with [BLOCK_M, BLOCK_K]
    # and [BLOCK_N, BLOCK_K] boxes (kernels/tma.py): each step's tiles by two bulk copies, rows
    # past M or N and columns past K zero-filled by the copy engine
    # grouped ordering of the output tiles (GROUP_M row tiles share a column tile in L2)
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask, n_mask = rm < M, rn < N
    if not TMA:
        a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :]
        w_ptrs = w_ptr + rn[None, :] * stride_wn + rk[:, None]  # [BK, BN], K contiguous
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if TMA:
            a = a_ptr.load([pid_m * BLOCK_M, k0])
            w = tl.trans(w_ptr.load([pid_n * BLOCK_N, k0]))  # [BK, BN]
        else:
            k_mask = k0 + rk < K
            a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if BLOCKWISE:  # BLOCK_K is the scales' K block: one pair of scales per step
            kb = k0 // BLOCK_K
            sa = tl.load(as_ptr + rm * stride_asm + kb * stride_ask, mask=m_mask, other=0.0)
            sw = tl.load(ws_ptr + (rn // SCALE_BN) * stride_wsn + kb * stride_wsk, mask=n_mask,
                         other=0.0)
            acc += tl.dot(a, w, out_dtype=tl.float32) * sa[:, None] * sw[None, :]
        else:
            acc = tl.dot(a, w, acc, out_dtype=tl.float32)
    if not BLOCKWISE:  # per-tensor / per-token x per-channel: the scales once, here
        sa = tl.load(as_ptr + rm * stride_asm, mask=m_mask, other=0.0)
        sw = tl.load(ws_ptr + rn * stride_wsn, mask=n_mask, other=0.0)
        acc = acc * sa[:, None] * sw[None, :]
    c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def gemm_config(M: int, N: int) -> dict:
    """Tile shapes. For 1-16 rows (decode) 16-row tiles and 16 or 64 columns, so that the
    N / BLOCK_N programs cover the SMs while they stream the weights (a block-wise weight keeps
    BLOCK_K at its scale block, 128). Above 64 rows both operands come by TMA (TMA: bulk copies
    into shared memory that the wgmma reads, no address math or masks per thread), and the
    tile by the count of 128 x 128 output tiles: where they would leave half the H200's 132 SMs
    idle, 64 x 64 tiles (four times as many); where they are fewer than the SMs, 64 x 128 (a
    decode batch of 128-512 rows on o, down and qkv); up to 2,048 rows 128 x 128; past that
    128 x 256, which halves the reads of the activations' tiles (benchmarks/fp8_gpu.py
    --mid-rows times each against the others)."""
    if M <= 16:  # the fastest of five configs on an H200 (benchmarks/fp8_gpu.py)
        if N > 8192:
            return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4,
                        num_stages=4)
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=256, GROUP_M=1, num_warps=2, num_stages=4)
    if M <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)
    tiles = cdiv(M, 128) * cdiv(N, 128)
    if tiles <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=5,
                    TMA=True)
    if tiles <= 128:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4,
                    TMA=True)
    return dict(BLOCK_M=128, BLOCK_N=128 if M <= 2048 else 256, BLOCK_K=128, GROUP_M=8,
                num_warps=8, num_stages=3, TMA=True)


def _scale_strides(s: torch.Tensor, rows: int) -> tuple[int, int]:
    """(row stride, column stride) of a scale tensor broadcast to `rows` rows (0: shared)."""
    return (s.stride(0) if s.shape[0] == rows and rows > 1 else 0), \
        (s.stride(1) if s.dim() > 1 and s.shape[1] > 1 else 0)


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype, block: tuple[int, int] | None = None,
             config: dict | None = None) -> torch.Tensor:
    """See the module docstring; `config` overrides gemm_config's tiles (benchmarks)."""
    if not use_triton(a):
        return fp8_gemm_reference(a, a_scale, w, w_scale, out_dtype, block)
    M, K = a.shape
    N = w.shape[0]
    c = torch.empty(M, N, dtype=out_dtype, device=a.device)
    if M == 0:
        return c
    cfg = dict(config or gemm_config(M, N))
    if block is not None:
        if block[1] != cfg["BLOCK_K"]:
            cfg["BLOCK_K"] = block[1]
    a_scale = a_scale.reshape(a_scale.shape[0], -1)
    w_scale = w_scale.reshape(w_scale.shape[0], -1)
    asm, ask = _scale_strides(a_scale, M)
    wsn, wsk = _scale_strides(w_scale, N if block is None else cdiv(N, block[0]))
    grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]),)
    stride_am, stride_wn = a.stride(0), w.stride(0)
    tma = cfg.pop("TMA", False) and a.stride(1) == 1 and w_tma_fits(
        a, cfg["BLOCK_M"], cfg["BLOCK_K"]) and w_tma_fits(w, cfg["BLOCK_N"], cfg["BLOCK_K"])
    if tma:
        a, w = (w_operand(a, True, cfg["BLOCK_M"], cfg["BLOCK_K"]),
                w_operand(w, True, cfg["BLOCK_N"], cfg["BLOCK_K"]))
    _fp8_gemm_kernel[grid](a, w, c, a_scale, w_scale, M, N, K, stride_am, stride_wn,
                           c.stride(0), asm, ask, wsn, wsk, BLOCKWISE=block is not None,
                           SCALE_BN=1 if block is None else block[0], TMA=tma, **cfg)
    return c
