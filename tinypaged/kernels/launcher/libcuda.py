"""The CUDA driver API functions the launcher needs, through ctypes into libcuda.so.1.

The driver library is the one piece of NVIDIA software every GPU machine has (it comes with the
kernel driver, not with a toolkit); nothing here needs a header or a compiler. The library is
opened on first use, not at import, so a CPU-only machine never looks for it, and `cuInit` is
left to torch: calling it before the engine forks its tensor-parallel workers would break CUDA
in the children.
"""

from __future__ import annotations

import ctypes
import os
import threading

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_INVALID_CONTEXT = 201

# CUlaunchAttributeID (cuda.h)
CU_LAUNCH_ATTRIBUTE_COOPERATIVE = 2
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE = 5
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
CU_CLUSTER_SCHEDULING_POLICY_SPREAD = 1
# CUfunction_attribute
CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0
CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3
CU_FUNC_ATTRIBUTE_NUM_REGS = 4
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
CU_FUNC_CACHE_PREFER_SHARED = 1
CU_LIMIT_PRINTF_FIFO_SIZE = 1
# CUdevice_attribute
CU_DEVICE_ATTRIBUTE_WARP_SIZE = 10
CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK = 12
CU_DEVICE_ATTRIBUTE_CLOCK_RATE = 13
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE = 36
CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH = 37
CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 81
CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
# cuTensorMapEncodeTiled
CU_TENSOR_MAP_INTERLEAVE_NONE = 0
CU_TENSOR_MAP_L2_PROMOTION_L2_128B = 2
CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE = 0
CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA = 1
TENSOR_MAP_BYTES = 128  # CUtensorMap: 16 x uint64, aligned to 64 bytes

# cuLaunchKernelEx appeared in CUDA 12.0's driver API; Triton 3 needs a CUDA 12 driver anyway.
MIN_DRIVER_VERSION = 12000


class CUlaunchAttribute(ctypes.Structure):
    """id, 4 bytes of padding, then a 64-byte union; only the first three uints are used here
    (clusterDim x/y/z, or the single int value of the other attributes)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class CUlaunchConfig(ctypes.Structure):
    _fields_ = [
        ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(CUlaunchAttribute)), ("numAttrs", ctypes.c_uint),
    ]  # fmt: skip


_p, _i, _u, _sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_size_t
_pp = ctypes.POINTER(ctypes.c_void_p)
_pi = ctypes.POINTER(ctypes.c_int)
# name -> argument types; every function returns a CUresult (int)
SIGNATURES: dict[str, tuple] = {
    "cuInit": (_u,),
    "cuDriverGetVersion": (_pi,),
    "cuGetErrorString": (_i, ctypes.POINTER(ctypes.c_char_p)),
    "cuDeviceGet": (_pi, _i),
    "cuDeviceGetAttribute": (_pi, _i, _i),
    "cuCtxGetCurrent": (_pp,),
    "cuCtxSetCurrent": (_p,),
    "cuDevicePrimaryCtxRetain": (_pp, _i),
    "cuCtxGetLimit": (ctypes.POINTER(_sz), _i),
    "cuCtxSetLimit": (_i, _sz),
    "cuModuleLoadData": (_pp, ctypes.c_char_p),
    "cuModuleGetFunction": (_pp, _p, ctypes.c_char_p),
    "cuFuncGetAttribute": (_pi, _i, _p),
    "cuFuncSetAttribute": (_p, _i, _i),
    "cuFuncSetCacheConfig": (_p, _i),
    "cuLaunchKernelEx": (_p, _p, _p, _p),  # config*, function, void** params, void** extra
    "cuOccupancyMaxActiveClusters": (_pi, _p, ctypes.POINTER(CUlaunchConfig)),
    "cuTensorMapEncodeTiled": (_p, _i, _u, _p, _p, _p, _p, _p, _i, _i, _i, _i),
}


class DriverError(RuntimeError):
    """A launch cannot be made on this machine: no driver library, or one too old."""


def library_path() -> str:
    """libcuda.so.1, or the copy in TRITON_LIBCUDA_PATH (a folder; Triton's own knob)."""
    folder = os.environ.get("TRITON_LIBCUDA_PATH")
    return os.path.join(folder, "libcuda.so.1") if folder else "libcuda.so.1"


class LibCuda:
    """The driver's functions as attributes (`lib.cuLaunchKernelEx(...)`), each returning the
    raw CUresult; `check(code, what)` turns a failure into RuntimeError with the driver's text."""

    def __init__(self, path: str | None = None) -> None:
        path = path or library_path()
        try:
            dll = ctypes.CDLL(path)
        except OSError as e:
            raise DriverError(
                f"cannot run Triton kernels on CUDA: the NVIDIA driver library {path} could not "
                f"be loaded ({e}). Install the NVIDIA driver (it provides libcuda.so.1), or set "
                "TRITON_LIBCUDA_PATH to the folder that holds it; kernels='torch' runs without it."
            ) from None
        version = ctypes.c_int(0)
        dll.cuDriverGetVersion.argtypes = [_pi]
        dll.cuDriverGetVersion(ctypes.byref(version))
        self.driver_version = version.value
        missing = [name for name in SIGNATURES if not hasattr(dll, name)]
        if missing or version.value < MIN_DRIVER_VERSION:
            major, minor = divmod(version.value, 1000)
            raise DriverError(
                f"the NVIDIA driver at {path} is too old for Triton kernels: it supports CUDA "
                f"{major}.{minor // 10}, they need CUDA {MIN_DRIVER_VERSION // 1000} or newer"
                + (f" (missing {', '.join(missing)})" if missing else "")
                + ". Update the NVIDIA driver (525 or newer), or run with kernels='torch'."
            )
        for name, argtypes in SIGNATURES.items():
            fn = getattr(dll, name)
            fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
            setattr(self, name, fn)

    def error_string(self, code: int) -> str:
        text = ctypes.c_char_p()
        self.cuGetErrorString(code, ctypes.byref(text))
        return text.value.decode() if text.value else f"CUDA error {code}"

    def check(self, code: int, what: str) -> None:
        if code != CUDA_SUCCESS:
            raise RuntimeError(f"Triton Error [CUDA]: {what} failed: {self.error_string(code)}")

    def ensure_context(self, device: int) -> None:
        """Make `device`'s primary context current in this thread, as torch and Triton's own
        launcher do, when no context is (a thread that has not touched CUDA yet)."""
        ctx = ctypes.c_void_p()
        code = self.cuCtxGetCurrent(ctypes.byref(ctx))
        if code == CUDA_ERROR_NOT_INITIALIZED:
            self.check(self.cuInit(0), "cuInit")
            code = self.cuCtxGetCurrent(ctypes.byref(ctx))
        self.check(code, "cuCtxGetCurrent")
        if not ctx.value:
            self.check(self.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device), "cuCtxRetain")
            self.check(self.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


_lib: LibCuda | None = None
_lock = threading.Lock()


def libcuda() -> LibCuda:
    """The process's LibCuda, opened on first call."""
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                _lib = LibCuda()
    return _lib
