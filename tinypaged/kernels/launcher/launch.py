"""One launcher per compiled kernel, in Python: the job of the C module Triton would compile.

A kernel's parameters reach the driver as `void **params`, one pointer per parameter to its bytes
(cuLaunchKernelEx copies them at the call, so a CUDA graph captures the values of that call).
From the kernel's signature this module builds, once, a *packing plan*: where each parameter's
bytes sit in one buffer (its C type's size and alignment: int32 at 4-byte boundaries, pointers
at 8, a 128-byte CUtensorMap at 64), and a `struct` format that writes the launch config and all
parameters in one `pack_into`. The params array that points into the buffer never changes, so a
launch is: read the tensors' data pointers, one `pack_into`, one call into the driver.

Signature types (Triton's): "*fp16" (pointers: tensors, ints or None), "i1".."i64", "u1".."u64",
"fp16", "bf16", "fp32", "fp64" (scalars; floats are converted to the kernel's width as Triton's
launcher does: fp16 rounds, bf16 truncates the fp32 bits), "constexpr" (compiled in, not passed),
"nvTmaDesc" (a CUtensorMap by value), "tensordesc<...>" (host TensorDescriptors, expanded as
Triton's driver expands them), and tuples of these (the argument is a tuple, flattened).
"""

from __future__ import annotations

import ctypes
import re
import struct
import threading
from dataclasses import dataclass

from tinypaged.kernels.launcher import libcuda as cu

# signature type -> (struct code, size = alignment)
SCALARS: dict[str, tuple[str, int]] = {
    "i1": ("b", 1), "i8": ("b", 1), "i16": ("h", 2), "i32": ("i", 4), "i64": ("q", 8),
    "u1": ("B", 1), "u8": ("B", 1), "u16": ("H", 2), "u32": ("I", 4), "u64": ("Q", 8),
    "fp16": ("e", 2), "bf16": ("H", 2), "fp32": ("f", 4), "f32": ("f", 4), "fp64": ("d", 8),
}  # fmt: skip
POINTER = ("Q", 8)
TENSOR_MAP = (f"{cu.TENSOR_MAP_BYTES}s", 64)
# CUlaunchConfig: grid xyz, block xyz, sharedMemBytes, (pad), hStream, attrs, numAttrs, (pad)
CONFIG_FORMAT = "IIIIIII4xQQI4x"
CONFIG_BYTES = struct.calcsize("=" + CONFIG_FORMAT)  # 56, as sizeof(CUlaunchConfig)
_F32 = struct.Struct("=f")
_U32 = struct.Struct("=I")


def bf16_bits(x: float) -> int:
    """The bf16 bits Triton's launcher passes: the top half of x's fp32 bits (truncation)."""
    return _U32.unpack(_F32.pack(x))[0] >> 16


def expand_signature(signature, tensordesc_meta=None) -> list:
    """Triton's launcher-level signature: each host tensor descriptor becomes what the compiled
    kernel takes for it (a CUtensorMap when the kernel was lowered to TMA, else base pointer,
    shape, strides and padding), followed by its shape (i32) and strides (i64)."""
    out, n_desc = [], 0
    for ty in signature:
        if isinstance(ty, str) and ty.startswith("tensordesc"):
            meta = tensordesc_meta[n_desc] if tensordesc_meta else None
            n_desc += 1
            match = re.match(r"tensordesc<([^[>]*)\[([^]]*)\]", ty)
            ndim = match.group(2).count(",") + 1
            if meta is None:
                out += ["*" + match.group(1), *["i64"] * (2 * ndim), "i1"]
            else:
                out.append("nvTmaDesc")
            out += ["i32"] * ndim + ["i64"] * ndim
        else:
            out.append(ty)
    return out


@dataclass(frozen=True)
class Slot:
    """One kernel parameter in the launch buffer."""

    type: str  # signature type
    code: str  # struct code
    offset: int  # bytes from the start of the parameters


def plan_slots(types: list[str]) -> tuple[list[Slot], str, int]:
    """Place the kernel's parameters (constexprs dropped) in order, each at its alignment.
    -> (slots, struct format without byte-order prefix, total bytes)."""
    slots, fmt, offset = [], "", 0
    for ty in types:
        if ty == "constexpr":
            continue
        if ty.startswith("*"):
            code, align = POINTER
        elif ty == "nvTmaDesc":
            code, align = TENSOR_MAP
        elif ty in SCALARS:
            code, align = SCALARS[ty]
        else:
            raise ValueError(f"unknown Triton signature type {ty!r}")
        pad = -offset % align
        fmt += f"{pad}x" * bool(pad) + code
        offset += pad
        slots.append(Slot(ty, code, offset))
        offset += struct.calcsize("=" + code)
    return slots, fmt, offset


def _flatten(ty, name: str, lines: list[str], flat: list[tuple[str, str]]) -> None:
    """Unpack tuple arguments into one name per leaf type (code lines go to `lines`)."""
    if isinstance(ty, tuple):
        names = [f"{name}_{i}" for i in range(len(ty))]
        lines.append(f"    ({', '.join(names)}{',' * (len(names) == 1)}) = {name}")
        for sub, sub_name in zip(ty, names):
            _flatten(sub, sub_name, lines, flat)
    else:
        flat.append((ty, name))


def _value(ty: str, name: str) -> str:
    if ty.startswith("*"):  # a tensor, a raw address, or None for nullptr
        n = name
        return f"({n} if {n}.__class__ is int else 0 if {n} is None else {n}.data_ptr())"
    if ty == "bf16":
        return f"bf16_bits({name})"
    return name


def launch_source(signature, tensordesc_meta=None, *, global_scratch: bool = False,
                  profile_scratch: bool = False, non_portable_cluster: bool = False):
    """Python source of `launch(grid_x, grid_y, grid_z, stream, function, kernel_metadata,
    launch_metadata, enter_hook, exit_hook, *args)`, the call Triton makes on a kernel's
    launcher, and the flat parameter types it packs (the two scratch pointers last)."""
    args = [f"a{i}" for i in range(len(signature))]
    lines, flat = [], []
    desc_i = 0
    for i, ty in enumerate(signature):
        if isinstance(ty, str) and ty.startswith("tensordesc"):
            sub = expand_signature([ty], [tensordesc_meta[desc_i]] if tensordesc_meta else None)
            names = [f"a{i}_{j}" for j in range(len(sub))]
            meta = f"META[{desc_i}]" if tensordesc_meta else "None"
            lines.append(f"    ({', '.join(names)},) = make_tensordesc_arg(a{i}, {meta})")
            flat += list(zip(sub, names))
            desc_i += 1
        else:
            _flatten(ty, f"a{i}", lines, flat)
    # scratch buffers: grid-sized, from Triton's allocators, as Triton's CudaLauncher does
    values = [_value(ty, name) for ty, name in flat if ty != "constexpr"]
    for name, wanted in (("global_scratch", global_scratch), ("profile_scratch", profile_scratch)):
        if wanted:
            lines.append(f"    {name} = ALLOC_{name.upper()}(grid_x * grid_y * grid_z, stream)")
        values.append(_value("*", name) if wanted else "0")
    head = ("def launch(grid_x, grid_y, grid_z, stream, function, kernel_metadata, "
            "launch_metadata, enter_hook, exit_hook")  # fmt: skip
    src = "\n".join([
        head + "".join(f", {a}" for a in args) + "):",
        "    if enter_hook is not None:",
        "        enter_hook(launch_metadata)",
        *lines,
        "    if grid_x * grid_y * grid_z > 0:",
        *(["        NON_PORTABLE(function)"] if non_portable_cluster else []),
        "        with LOCK:",
        "            PACK(BUF, BASE, grid_x * NUM_CTAS, grid_y, grid_z, BLOCK_X, 1, 1, SHARED,",
        "                 stream, ATTRS, NUM_ATTRS" + "".join(f", {v}" for v in values) + ")",
        "            err = LAUNCH(CONFIG, function, PARAMS, None)",
        "            if err:",
        "                err = RETRY(err, function)",
        "        if err:",
        "            FAIL(err)",
        "    if exit_hook is not None:",
        "        exit_hook(launch_metadata)",
    ])  # fmt: skip
    return src, [ty for ty, _ in flat] + ["*", "*"]


class PackedLaunch:
    """The buffer, the params array and the generated `launch` for one compiled kernel.

    Buffer: [slack to a 64-byte boundary][CUlaunchConfig, padded to 64][parameters][void* params
    [n]]. The launch config and parameters are rewritten by each launch, under a lock (the driver
    call releases the GIL); the params array is written once. `lib` gives `cuLaunchKernelEx`
    (a stand-in in CPU tests), `ensure_context` and `error_string`; `alloc_scratch(which)` gives
    Triton's allocator for "global" or "profile" scratch.
    """

    def __init__(self, signature, *, num_warps: int, num_ctas: int = 1, shared: int = 0,
                 cooperative: bool = False, pdl: bool = False, tensordesc_meta=None,
                 global_scratch: tuple[int, int] = (0, 1),
                 profile_scratch: tuple[int, int] = (0, 1),
                 lib, current_device=lambda: 0, alloc_scratch=None) -> None:  # fmt: skip
        signature = list(signature)
        src, types = launch_source(
            signature, tensordesc_meta, global_scratch=global_scratch[0] > 0,
            profile_scratch=profile_scratch[0] > 0, non_portable_cluster=num_ctas == 16,
        )  # fmt: skip
        self.slots, fmt, size = plan_slots(types)
        params_at = CONFIG_BYTES + (-CONFIG_BYTES % 64)
        self.format = "=" + CONFIG_FORMAT + f"{params_at - CONFIG_BYTES}x" + fmt
        self.buffer = ctypes.create_string_buffer(64 + params_at + size + 8 + 8 * len(self.slots))
        self.base = -ctypes.addressof(self.buffer) % 64
        self.config_address = ctypes.addressof(self.buffer) + self.base
        self.params_address = self.config_address + params_at + size
        self.params_address += -self.params_address % 8
        params = (ctypes.c_void_p * max(len(self.slots), 1)).from_address(self.params_address)
        for i, slot in enumerate(self.slots):
            params[i] = self.config_address + params_at + slot.offset
        self.attrs = self._attributes(num_ctas, cooperative, pdl)

        def retry(err: int, function: int) -> int:
            """A thread with no CUDA context yet: make the device's current, launch again."""
            if err != cu.CUDA_ERROR_INVALID_CONTEXT:
                return err
            lib.ensure_context(current_device())
            return lib.cuLaunchKernelEx(self.config_address, function, self.params_address, None)

        def fail(err: int) -> None:
            raise RuntimeError(f"Triton Error [CUDA]: {lib.error_string(err)}")

        def non_portable(function: int) -> None:  # 16-CTA clusters: H100 / B200 allow them
            attribute = cu.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
            lib.check(lib.cuFuncSetAttribute(function, attribute, 1), "cuFuncSetAttribute")

        def scratch(which: str, size_align: tuple[int, int]):
            size, align = size_align
            return lambda grid, stream: alloc_scratch(which)(grid * num_ctas * size, align, stream)

        scope = {
            "LOCK": threading.Lock(), "PACK": struct.Struct(self.format).pack_into,
            "BUF": self.buffer, "BASE": self.base, "NUM_CTAS": num_ctas,
            "BLOCK_X": 32 * num_warps, "SHARED": shared,
            "ATTRS": ctypes.addressof(self.attrs) if len(self.attrs) else 0,
            "NUM_ATTRS": len(self.attrs), "LAUNCH": lib.cuLaunchKernelEx,
            "CONFIG": self.config_address, "PARAMS": self.params_address,
            "RETRY": retry, "FAIL": fail, "NON_PORTABLE": non_portable,
            "ALLOC_GLOBAL_SCRATCH": scratch("global", global_scratch),
            "ALLOC_PROFILE_SCRATCH": scratch("profile", profile_scratch),
            "META": tensordesc_meta, "bf16_bits": bf16_bits,
            "KEEP_ALIVE": self.attrs,  # the driver reads the attributes through ATTRS
        }  # fmt: skip
        if any(isinstance(t, str) and t.startswith("tensordesc") for t in signature):
            from triton.backends.nvidia.driver import make_tensordesc_arg

            scope["make_tensordesc_arg"] = make_tensordesc_arg
        exec(compile(src, "<tinypaged launcher>", "exec"), scope)
        self.launch = scope["launch"]
        self.source = src

    @staticmethod
    def _attributes(num_ctas: int, cooperative: bool, pdl: bool):
        """The launch attributes, fixed per kernel, in the order Triton's launcher sets them."""
        chosen = []
        if pdl:
            chosen.append((cu.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, (1,)))
        if cooperative:
            chosen.append((cu.CU_LAUNCH_ATTRIBUTE_COOPERATIVE, (1,)))
        if num_ctas != 1:
            chosen.append((cu.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, (num_ctas, 1, 1)))
            chosen.append((cu.CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE,
                           (cu.CU_CLUSTER_SCHEDULING_POLICY_SPREAD,)))  # fmt: skip
        attrs = (cu.CUlaunchAttribute * len(chosen))()
        for attr, (attr_id, value) in zip(attrs, chosen):
            attr.id = attr_id
            for i, v in enumerate(value):
                attr.value[i] = v
        return attrs
