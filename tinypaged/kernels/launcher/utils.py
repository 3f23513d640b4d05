"""`cuda_utils` without a compiler: what Triton's driver.c offers, over ctypes.

Triton calls these through `driver.active.utils`: `load_binary` when a compiled kernel is first
run on a device, `get_device_properties` while compiling, `fill_tma_descriptor` for host-side
tensor descriptors (attention_hopper.py), the other two for cluster launches and printf.
"""

from __future__ import annotations

import ctypes

from tinypaged.kernels.launcher import libcuda as cu


def _attribute(get, attribute: int, handle) -> int:
    value = ctypes.c_int()
    cu.libcuda().check(get(ctypes.byref(value), attribute, handle), "attribute query")
    return value.value


class PythonCudaUtils:
    """Drop-in for Triton's compiled `cuda_utils` module (same names, same results)."""

    def load_binary(self, name: str, cubin: bytes, shared: int, device: int):
        """Load a cubin, find kernel `name` in it, and raise its dynamic shared memory limit when
        it needs more than the default 48 KiB. -> (module, function, n_regs, n_spills,
        max_threads)."""
        lib = cu.libcuda()
        lib.ensure_context(device)
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        lib.check(lib.cuModuleLoadData(ctypes.byref(module), cubin), f"loading kernel {name}")
        lib.check(lib.cuModuleGetFunction(ctypes.byref(function), module, name.encode()),
                  f"finding kernel {name}")  # fmt: skip
        fn_attr = lib.cuFuncGetAttribute
        n_regs = _attribute(fn_attr, cu.CU_FUNC_ATTRIBUTE_NUM_REGS, function)
        n_spills = _attribute(fn_attr, cu.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, function) // 4
        max_threads = _attribute(fn_attr, cu.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, function)
        optin_attribute = cu.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
        optin = _attribute(lib.cuDeviceGetAttribute, optin_attribute, device)
        if shared > 49152 and optin > 49152:
            lib.check(lib.cuFuncSetCacheConfig(function, cu.CU_FUNC_CACHE_PREFER_SHARED),
                      "cuFuncSetCacheConfig")  # fmt: skip
            static = _attribute(fn_attr, cu.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, function)
            lib.check(
                lib.cuFuncSetAttribute(
                    function, cu.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, optin - static
                ),
                "raising the kernel's shared memory limit",
            )
        return module.value, function.value, n_regs, n_spills, max_threads

    def get_device_properties(self, device_id: int) -> dict[str, int]:
        lib = cu.libcuda()
        lib.ensure_context(device_id)
        device = ctypes.c_int()
        lib.check(lib.cuDeviceGet(ctypes.byref(device), device_id), "cuDeviceGet")
        names = {
            "max_shared_mem": cu.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            "max_num_regs": cu.CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK,
            "multiprocessor_count": cu.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            "warpSize": cu.CU_DEVICE_ATTRIBUTE_WARP_SIZE,
            "sm_clock_rate": cu.CU_DEVICE_ATTRIBUTE_CLOCK_RATE,
            "mem_clock_rate": cu.CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE,
            "mem_bus_width": cu.CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH,
        }
        return {k: _attribute(lib.cuDeviceGetAttribute, a, device) for k, a in names.items()}

    def cuOccupancyMaxActiveClusters(self, function: int, shared: int, cluster_dim: int) -> int:
        lib = cu.libcuda()
        lib.check(
            lib.cuFuncSetAttribute(function, cu.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                   shared),
            "cuFuncSetAttribute",
        )  # fmt: skip
        attr = cu.CUlaunchAttribute(id=cu.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)
        attr.value[0], attr.value[1], attr.value[2] = cluster_dim, 1, 1
        config = cu.CUlaunchConfig(
            gridDimX=cluster_dim, gridDimY=1, gridDimZ=1, blockDimX=128, blockDimY=1, blockDimZ=1,
            sharedMemBytes=shared, hStream=None, attrs=ctypes.pointer(attr), numAttrs=1,
        )  # fmt: skip
        non_portable = cu.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
        lib.check(lib.cuFuncSetAttribute(function, non_portable, 1), "cuFuncSetAttribute")
        clusters = ctypes.c_int(-1)
        lib.check(lib.cuOccupancyMaxActiveClusters(ctypes.byref(clusters), function,
                                                   ctypes.byref(config)),
                  "cuOccupancyMaxActiveClusters")  # fmt: skip
        return clusters.value

    def set_printf_fifo_size(self, size: int) -> None:
        if size < 0:
            raise ValueError("fifo size must be non-negative")
        lib = cu.libcuda()
        lib.ensure_context(0)
        old = ctypes.c_size_t()
        limit = cu.CU_LIMIT_PRINTF_FIFO_SIZE
        lib.check(lib.cuCtxGetLimit(ctypes.byref(old), limit), "cuCtxGetLimit")
        if old.value != size:  # setting it after a printf kernel ran fails, even to the same size
            lib.check(lib.cuCtxSetLimit(cu.CU_LIMIT_PRINTF_FIFO_SIZE, size), "cuCtxSetLimit")

    def fill_tma_descriptor(self, global_address: int, swizzle: int, elem_size: int,
                            elem_type: int, block_size, shape, strides, padding: int) -> bytes:
        """A CUtensorMap (128 bytes) for a tiled TMA copy; the launcher passes it by value.
        Triton gives sizes outermost first, the driver wants them innermost first."""
        rank = len(block_size)
        if len(shape) != rank or len(strides) != rank:
            raise RuntimeError("Rank mismatch")
        box = (ctypes.c_uint32 * 5)(*reversed([int(b) for b in block_size]))
        dims = (ctypes.c_uint64 * 5)(*reversed([int(s) for s in shape]))
        # byte strides of every dimension but the innermost, innermost first
        byte_strides = (ctypes.c_uint64 * 5)(*[elem_size * int(s) for s in reversed(strides[:-1])])
        element_strides = (ctypes.c_uint32 * 5)(1, 1, 1, 1, 1)
        raw = ctypes.create_string_buffer(cu.TENSOR_MAP_BYTES + 64)
        offset = -ctypes.addressof(raw) % 64  # the driver wants the map 64-byte aligned
        fill = (cu.CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA if padding == 1
                else cu.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)  # fmt: skip
        lib = cu.libcuda()
        code = lib.cuTensorMapEncodeTiled(
            ctypes.addressof(raw) + offset, elem_type, rank, global_address, dims, byte_strides,
            box, element_strides, cu.CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
            cu.CU_TENSOR_MAP_L2_PROMOTION_L2_128B, fill,
        )  # fmt: skip
        if code != cu.CUDA_SUCCESS:
            raise RuntimeError(
                "Triton Error [CUDA]: Failed to create tensor map descriptor: "
                f"{lib.error_string(code)} (elem_type={elem_type} rank={rank} "
                f"address={global_address:#x} shape={list(shape)} strides={list(strides)} "
                f"block={list(block_size)} swizzle={swizzle} padding={padding})"
            )
        return raw.raw[offset : offset + cu.TENSOR_MAP_BYTES]
