"""The Python launcher for Triton's CUDA kernels (tinypaged/kernels/launcher/), on the CPU.

The driver is replaced by a stand-in `cuLaunchKernelEx` that reads the launch config and every
parameter back out of memory through the `void **params` array, exactly as the driver would, so
the packing is checked byte for byte without a GPU: offsets against a C struct of the same types
(ctypes lays it out as the C compiler does), and values against Triton's own conversions.
"""

from __future__ import annotations

import ctypes
import re
import struct

import numpy as np
import pytest
import torch

from tinypaged.kernels.launcher import install, libcuda
from tinypaged.kernels.launcher.launch import PackedLaunch, expand_signature, plan_slots

C_TYPES = {
    "i1": ctypes.c_int8, "i8": ctypes.c_int8, "i16": ctypes.c_int16, "i32": ctypes.c_int32,
    "i64": ctypes.c_int64, "u1": ctypes.c_uint8, "u8": ctypes.c_uint8, "u16": ctypes.c_uint16,
    "u32": ctypes.c_uint32, "u64": ctypes.c_uint64, "fp16": ctypes.c_uint16,
    "bf16": ctypes.c_uint16, "fp32": ctypes.c_float, "fp64": ctypes.c_double,
    "*fp16": ctypes.c_uint64,
}  # fmt: skip


class FakeDriver:
    """Records each launch as the driver would see it: config fields and the parameter bytes."""

    def __init__(self, codes=()):
        self.launches, self.codes, self.contexts = [], list(codes), []

    def cuLaunchKernelEx(self, config, function, params, extra):
        cfg = libcuda.CUlaunchConfig.from_address(config)
        attrs = [(cfg.attrs[i].id, list(cfg.attrs[i].value[:3])) for i in range(cfg.numAttrs)]
        table = (ctypes.c_void_p * 64).from_address(params)
        self.launches.append({
            "grid": (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ),
            "block": (cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ),
            "shared": cfg.sharedMemBytes, "stream": cfg.hStream, "attrs": attrs,
            "function": function, "params": table,
        })  # fmt: skip
        return self.codes.pop(0) if self.codes else 0

    def ensure_context(self, device):
        self.contexts.append(device)

    def error_string(self, code):
        return f"fake error {code}"


def read(address: int, ty: str):
    return C_TYPES[ty].from_address(address).value


def test_tensor_descriptors_expand_as_tritons_driver_expands_them():
    # no TMA metadata: pointer, shape and strides as i64, padding flag, then shape i32, strides i64
    sig = ["*fp32", "tensordesc<bf16[64, 32]>", "i32"]
    assert expand_signature(sig) == [
        "*fp32", "*bf16", "i64", "i64", "i64", "i64", "i1", "i32", "i32", "i64", "i64", "i32"]
    # lowered to TMA: one CUtensorMap by value, then shape and strides
    meta = [{"swizzle": 3}]
    expanded = expand_signature(["tensordesc<fp16[1, 16, 128]>"], meta)
    assert expanded == ["nvTmaDesc", "i32", "i32", "i32", "i64", "i64", "i64"]


def test_slots_sit_where_a_c_struct_of_the_same_types_puts_its_fields():
    types = ["i1", "*fp16", "i16", "fp64", "u8", "i32", "bf16", "i64", "fp16", "u32", "fp32",
             "u64", "u16", "constexpr", "i8", "*fp16"]  # fmt: skip
    slots, fmt, size = plan_slots(types)
    kept = [t for t in types if t != "constexpr"]
    fields = [(f"f{i}", C_TYPES[t]) for i, t in enumerate(kept)]
    layout = type("Params", (ctypes.Structure,), {"_fields_": fields})
    assert [s.type for s in slots] == kept
    assert [s.offset for s in slots] == [getattr(layout, f"f{i}").offset for i in range(len(kept))]
    assert struct.calcsize("=" + fmt) == size
    # a CUtensorMap is 128 bytes on a 64-byte boundary
    slots, _, size = plan_slots(["i32", "nvTmaDesc", "i8"])
    assert [s.offset for s in slots] == [0, 64, 192] and size == 193


def test_every_parameter_reaches_the_driver_with_its_bits():
    sig = ["*fp16", "*fp32", "*fp32", "i1", "i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64",
           "fp16", "bf16", "fp32", "fp64", "constexpr", ("i32", ("fp32", "*fp16"))]  # fmt: skip
    drv = FakeDriver()
    packed = PackedLaunch(sig, num_warps=8, shared=4096, lib=drv)
    t = torch.zeros(4, dtype=torch.float16)
    values = [t, 0xDEAD000, None, True, -7, -300, -(2**31), 2**40 + 3, 255, 65535, 2**32 - 1,
              2**64 - 1, 1.0009765625 + 1e-4, 3.14159, 1.1, 2.0**-1074, 99, (5, (0.25, t))]
    enter, exit_ = [], []
    packed.launch(3, 2, 1, 0xABC, 0x1234, (8, 1, 4096), "meta", enter.append, exit_.append,
                  *values)  # fmt: skip
    assert enter == ["meta"] and exit_ == ["meta"]
    (launch,) = drv.launches
    assert launch["grid"] == (3, 2, 1) and launch["block"] == (256, 1, 1)
    assert launch["shared"] == 4096 and launch["stream"] == 0xABC and launch["attrs"] == []
    assert launch["function"] == 0x1234
    p = launch["params"]
    flat = [t.data_ptr(), 0xDEAD000, 0, 1, -7, -300, -(2**31), 2**40 + 3, 255, 65535, 2**32 - 1,
            2**64 - 1]  # fmt: skip
    types = ["*fp16"] * 3 + ["i1", "i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64"]
    assert [read(p[i], ty) for i, ty in enumerate(types)] == flat
    # fp16 rounds (numpy's conversion), bf16 keeps the top 16 bits of fp32 (Triton's pack_bf16)
    assert read(p[12], "fp16") == int(np.float16(1.0009765625 + 1e-4).view(np.uint16))
    assert read(p[13], "bf16") == int(np.float32(3.14159).view(np.uint32)) >> 16
    assert read(p[14], "fp32") == np.float32(1.1)
    assert read(p[15], "fp64") == 2.0**-1074
    # the constexpr is not passed; the tuple is flattened in order; then both scratch pointers
    assert read(p[16], "i32") == 5 and read(p[17], "fp32") == 0.25
    assert read(p[18], "*fp16") == t.data_ptr()
    assert read(p[19], "*fp16") == 0 and read(p[20], "*fp16") == 0


def test_launch_attributes_and_cluster_grid_follow_the_kernel_metadata():
    drv = FakeDriver()
    packed = PackedLaunch(["i32"], num_warps=4, num_ctas=2, cooperative=True, pdl=True, lib=drv)
    packed.launch(5, 1, 1, 0, 1, None, None, None, None, 7)
    (launch,) = drv.launches
    assert launch["grid"] == (10, 1, 1)  # Triton's launcher multiplies x by num_ctas
    assert launch["attrs"] == [
        (libcuda.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, [1, 0, 0]),
        (libcuda.CU_LAUNCH_ATTRIBUTE_COOPERATIVE, [1, 0, 0]),
        (libcuda.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, [2, 1, 1]),
        (libcuda.CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE,
         [libcuda.CU_CLUSTER_SCHEDULING_POLICY_SPREAD, 0, 0]),
    ]  # fmt: skip


def test_scratch_is_allocated_per_grid_and_passed_last():
    drv, calls = FakeDriver(), []
    scratch = torch.zeros(8)

    def alloc_scratch(which):
        return lambda size, align, stream: calls.append((which, size, align, stream)) or scratch

    packed = PackedLaunch(["*fp32"], num_warps=4, num_ctas=2, global_scratch=(96, 16), lib=drv,
                          alloc_scratch=alloc_scratch)  # fmt: skip
    packed.launch(3, 2, 1, 77, 1, None, None, None, None, 0x1000)
    assert calls == [("global", 3 * 2 * 1 * 2 * 96, 16, 77)]
    p = drv.launches[0]["params"]
    assert read(p[1], "*fp16") == scratch.data_ptr() and read(p[2], "*fp16") == 0


def test_empty_grid_runs_the_hooks_but_launches_nothing():
    drv, seen = FakeDriver(), []
    PackedLaunch(["i32"], num_warps=4, lib=drv).launch(0, 1, 1, 0, 1, None, "m", seen.append,
                                                       seen.append, 3)  # fmt: skip
    assert drv.launches == [] and seen == ["m", "m"]


def test_a_thread_without_a_context_gets_one_and_other_errors_raise():
    drv = FakeDriver(codes=[libcuda.CUDA_ERROR_INVALID_CONTEXT, 0])
    packed = PackedLaunch(["i32"], num_warps=4, lib=drv, current_device=lambda: 3)
    packed.launch(1, 1, 1, 0, 1, None, None, None, None, 3)
    assert drv.contexts == [3] and len(drv.launches) == 2
    drv.codes = [700]
    with pytest.raises(RuntimeError, match="fake error 700"):
        packed.launch(1, 1, 1, 0, 1, None, None, None, None, 3)


def test_parameter_list_matches_the_c_launcher_triton_would_compile():
    """Triton's own generator, for the same signature: the kernel parameters of its `_launch`
    (their C types, in order) are the slots of the Python launcher."""
    from triton.backends.nvidia.driver import make_launcher

    sig = {0: "*fp16", 1: "i32", 2: "constexpr", 3: "fp32", 4: ("i64", "bf16"), 5: "u8",
           6: "tensordesc<fp16[16, 64]>"}  # fmt: skip
    src = make_launcher({}, sig, None)
    decl = re.search(r"static void _launch\((.*?)\)", src).group(1)
    c_params = [p.rsplit(" ", 1)[0] for p in decl.split(", ")][12:]  # after the launch config
    sizes = {"CUdeviceptr": 8, "int8_t": 1, "uint8_t": 1, "int16_t": 2, "uint16_t": 2,
             "int32_t": 4, "uint32_t": 4, "int64_t": 8, "uint64_t": 8}  # fmt: skip
    packed = PackedLaunch(list(sig.values()), num_warps=4, lib=FakeDriver())
    ours = [struct.calcsize("=" + s.code) for s in packed.slots][:-2]  # less the two scratch
    assert ours == [sizes[c] for c in c_params]


def test_launcher_choice_follows_the_variable_and_the_machine(monkeypatch, tmp_path):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler anywhere
    monkeypatch.delenv("TINYPAGED_TRITON_LAUNCHER", raising=False)
    assert install.compiler_on_path() is None and install.chosen_launcher() == "python"
    monkeypatch.setenv("TINYPAGED_TRITON_LAUNCHER", "native")
    with pytest.raises(RuntimeError, match="needs a C compiler.*set it to 'python'"):
        install.chosen_launcher()
    monkeypatch.setenv("TINYPAGED_TRITON_LAUNCHER", "gcc")
    with pytest.raises(ValueError, match="TINYPAGED_TRITON_LAUNCHER must be one of"):
        install.chosen_launcher()
    monkeypatch.setenv("CC", "/opt/cc")  # a compiler: auto still launches from Python
    monkeypatch.setenv("TINYPAGED_TRITON_LAUNCHER", "auto")
    assert install.compiler_on_path() == "/opt/cc" and install.chosen_launcher() == "python"
    import triton

    monkeypatch.setattr(triton, "__version__", "3.7.0")  # another launcher interface: Triton's
    assert install.chosen_launcher() == "native"
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setenv("TINYPAGED_TRITON_LAUNCHER", "native")
    assert install.chosen_launcher() == "native"
    monkeypatch.setenv("TINYPAGED_TRITON_LAUNCHER", "python")
    driver = install._driver_class()()  # built, not installed: the CPU tests keep the interpreter
    assert driver.launcher == "python" and driver.launcher_cls is install.python_launcher
    assert type(driver.utils).__name__ == "PythonCudaUtils"


def test_no_driver_library_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_LIBCUDA_PATH", str(tmp_path))
    with pytest.raises(libcuda.DriverError, match="Install the NVIDIA driver.*TRITON_LIBCUDA_PATH"):
        libcuda.LibCuda()


def test_a_driver_too_old_for_cuLaunchKernelEx_names_the_fix(monkeypatch):
    class Function:  # a ctypes function: callable, with argtypes to set
        def __init__(self, body):
            self.body = body

        def __call__(self, *args):
            return self.body(*args)

    def version(ref):
        ref._obj.value = 11040
        return 0

    class OldDriver:  # CUDA 11.4's driver: no cuLaunchKernelEx, no cuTensorMapEncodeTiled
        def __init__(self, path):
            self.cuDriverGetVersion = Function(version)
            for name in libcuda.SIGNATURES:
                if name not in ("cuLaunchKernelEx", "cuTensorMapEncodeTiled", "cuDriverGetVersion"):
                    setattr(self, name, Function(lambda *a: 0))

    monkeypatch.setattr(libcuda.ctypes, "CDLL", OldDriver)
    with pytest.raises(libcuda.DriverError, match=r"CUDA 11\.4.*missing cuLaunchKernelEx.*525"):
        libcuda.LibCuda("libcuda.so.1")


def test_tma_descriptor_gets_sizes_innermost_first_and_comes_back_as_128_bytes(monkeypatch):
    from tinypaged.kernels.launcher.utils import PythonCudaUtils

    seen = {}

    class Encoder:
        def cuTensorMapEncodeTiled(self, out, dtype, rank, address, dims, strides, box, elem,
                                   interleave, swizzle, l2, fill):  # fmt: skip
            assert out % 64 == 0
            ctypes.memmove(out, bytes(range(128)), 128)
            seen.update(dtype=dtype, rank=rank, address=address, dims=list(dims[:rank]),
                        strides=list(strides[:rank - 1]), box=list(box[:rank]), swizzle=swizzle,
                        fill=fill)  # fmt: skip
            return 0

    monkeypatch.setattr(libcuda, "_lib", Encoder())
    # a [num_blocks=10, block_size=64, 8 * 128] bf16 cache, tiles of [1, 64, 128]
    desc = PythonCudaUtils().fill_tma_descriptor(0x7000, 3, 2, 10, [1, 64, 128], [10, 64, 1024],
                                                 [65536, 1024, 1], 0)  # fmt: skip
    assert desc == bytes(range(128))
    assert seen == {"dtype": 10, "rank": 3, "address": 0x7000, "dims": [1024, 64, 10],
                    "strides": [2 * 1024, 2 * 65536], "box": [128, 64, 1], "swizzle": 3,
                    "fill": libcuda.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE}  # fmt: skip


def test_a_tma_descriptor_is_passed_by_value_on_a_64_byte_boundary():
    drv = FakeDriver()
    PackedLaunch(["i32", "nvTmaDesc", "i8"], num_warps=4, lib=drv).launch(
        1, 1, 1, 0, 1, None, None, None, None, 9, bytes(range(128)), -1)
    p = drv.launches[0]["params"]
    assert p[1] % 64 == 0 and ctypes.string_at(p[1], 128) == bytes(range(128))
    assert read(p[0], "i32") == 9 and read(p[2], "i8") == -1
