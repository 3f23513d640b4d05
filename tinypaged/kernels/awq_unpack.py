"""Int4 nibbles to 16-bit floats in registers, shared by the AWQ decode kernels on tensor cores.

Two ways, both exact:
- portable (_nibble; the Triton interpreter runs it): the nibble q ORed into
  the bits of 128.0 (bf16, 0x4300) or 1024.0 (fp16, 0x6400) is OFFSET + q, since the float's
  last mantissa bit is worth 1 there; fp32 takes 2**23 + q and subtracts 2**23.
- paired PTX (_asm_nibble_minus_zero, _asm_dequant; GPU only): two weights per 32-bit register
  (a byte permute puts the same 16-bit half of two words side by side), so each shift, mask and
  subtraction converts two. (Only the low 4 bits of a 16-bit lane can carry the nibble: in bf16,
  bit 7 is already the exponent's.)
"""

from __future__ import annotations

import torch

from tinypaged.kernels._triton import jit, tl

# x's dtype -> (bits of OFFSET as a 16-bit float, OFFSET); fp32 uses the 2**23 trick instead
MAGIC16 = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0),
           torch.float32: (0, 0.0)}


@jit
def _nibble(words, shift: tl.constexpr, MAGIC16: tl.constexpr, DTYPE: tl.constexpr):
    q = (words >> shift) & 0xF
    if MAGIC16:
        v = (q | MAGIC16).to(tl.int16).to(DTYPE, bitcast=True)
    else:
        v = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return v


@jit
def _asm_nibble_minus_zero(words, nz, shift: tl.constexpr, MAGIC16: tl.constexpr,
                           DTYPE: tl.constexpr):
    # q - z for the nibble at `shift` of each word, two elements per 3-4 instructions: the
    # pair's 16-bit halves side by side (prmt), the nibble shifted to bits 0-3 and ORed into the
    # bits of OFFSET (shr, lop3), minus OFFSET + z by a paired fma with 1.0 (exact).
    # nz: -(OFFSET + z) in DTYPE. The per-shift constants arrive as uniform tensors; ptxas
    # folds them into immediates.
    sel = tl.full(words.shape, 0x5410 if shift < 16 else 0x7632, tl.int32)
    shr = tl.full(words.shape, shift % 16, tl.int32)
    mask = tl.full(words.shape, 0x000F000F, tl.int32)
    if MAGIC16 == 0x4300:
        w = tl.inline_asm_elementwise(
            "{ .reg .b32 t, one; mov.b32 one, 0x3F803F80; prmt.b32 t, $1, $2, $4; "
            "shr.u32 t, t, $6; lop3.b32 t, t, $8, 0x43004300, 0xEA; "
            "fma.rn.bf16x2 $0, t, one, $3; }",
            "=r,r,r,r,r,r,r,r,r,r", [words, nz, sel, shr, mask], dtype=nz.dtype, is_pure=True,
            pack=2)
    else:
        w = tl.inline_asm_elementwise(
            "{ .reg .b32 t, one; mov.b32 one, 0x3C003C00; prmt.b32 t, $1, $2, $4; "
            "shr.u32 t, t, $6; lop3.b32 t, t, $8, 0x64006400, 0xEA; "
            "fma.rn.f16x2 $0, t, one, $3; }",
            "=r,r,r,r,r,r,r,r,r,r", [words, nz, sel, shr, mask], dtype=nz.dtype, is_pure=True,
            pack=2)
    return w


@jit
def _asm_dequant(words, nz, s, shift: tl.constexpr, MAGIC16: tl.constexpr):
    # _asm_nibble_minus_zero times s (x's dtype), two elements a paired fma
    sel = tl.full(words.shape, 0x5410 if shift < 16 else 0x7632, tl.int32)
    shr = tl.full(words.shape, shift % 16, tl.int32)
    mask = tl.full(words.shape, 0x000F000F, tl.int32)
    if MAGIC16 == 0x4300:
        w = tl.inline_asm_elementwise(
            "{ .reg .b32 t, one, mz; mov.b32 one, 0x3F803F80; mov.b32 mz, 0x80008000; "
            "prmt.b32 t, $1, $2, $4; shr.u32 t, t, $6; lop3.b32 t, t, $8, 0x43004300, 0xEA; "
            "fma.rn.bf16x2 t, t, one, $3; fma.rn.bf16x2 $0, t, $10, mz; }",
            "=r,r,r,r,r,r,r,r,r,r,r", [words, nz, sel, shr, mask, s], dtype=nz.dtype,
            is_pure=True, pack=2)
    else:
        w = tl.inline_asm_elementwise(
            "{ .reg .b32 t, one, mz; mov.b32 one, 0x3C003C00; mov.b32 mz, 0x80008000; "
            "prmt.b32 t, $1, $2, $4; shr.u32 t, t, $6; lop3.b32 t, t, $8, 0x64006400, 0xEA; "
            "fma.rn.f16x2 t, t, one, $3; fma.rn.f16x2 $0, t, $10, mz; }",
            "=r,r,r,r,r,r,r,r,r,r,r", [words, nz, sel, shr, mask, s], dtype=nz.dtype,
            is_pure=True, pack=2)
    return w
