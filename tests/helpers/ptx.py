"""A tiny emulator of the PTX that the kernels' tl.inline_asm_elementwise blocks use, so that a
CPU test can check what the interpreter never runs (it takes the portable code instead).

Covers the instructions of gguf_subdot's QUANT_ASM: mov.b32, prmt.b32 (default mode),
shr.u32, lop3.b32 and fma.rn.bf16x2 / fma.rn.f16x2 (each half computed exactly in
float64, then rounded once, as the hardware's fused multiply-add rounds).
"""

import torch


def half_to_float(bits: int, dtype: torch.dtype) -> float:
    return torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(dtype).item()


def float_to_half(value: float, dtype: torch.dtype) -> int:
    return torch.tensor([value], dtype=torch.float64).to(dtype).view(torch.int16).item() & 0xFFFF


def run_ptx(asm: str, registers: dict[str, int]) -> dict[str, int]:
    """Run the `{ ... }` block `asm` on 32-bit `registers` ("$0", "t", ...); returns them all."""
    env = dict(registers)

    def value(operand: str) -> int:
        return env[operand] if operand in env else int(operand, 0)

    for instruction in (i.strip() for i in asm.strip().strip("{}").split(";")):
        if not instruction or instruction.startswith(".reg"):
            continue
        op, operands = instruction.split(None, 1)
        d, *a = (o.strip() for o in operands.split(","))
        if op == "mov.b32":
            env[d] = value(a[0])
        elif op == "prmt.b32":  # byte k of d: byte (selector nibble k) of {a, b}
            pool = value(a[0]) | value(a[1]) << 32
            env[d] = sum((pool >> 8 * ((value(a[2]) >> 4 * k) & 7) & 0xFF) << 8 * k
                         for k in range(4))
        elif op == "shr.u32":
            env[d] = value(a[0]) >> value(a[1])
        elif op == "lop3.b32" and a[3] == "0xEA":  # (a & b) | c
            env[d] = value(a[0]) & value(a[1]) | value(a[2])
        elif op in ("fma.rn.bf16x2", "fma.rn.f16x2"):
            dtype = torch.bfloat16 if "bf16" in op else torch.float16
            halves = [[half_to_float(value(o) >> 16 * k & 0xFFFF, dtype) for o in a]
                      for k in range(2)]
            env[d] = sum(float_to_half(x * y + z, dtype) << 16 * k
                         for k, (x, y, z) in enumerate(halves))
        else:
            raise NotImplementedError(f"run_ptx does not know {instruction!r}")
    return env
