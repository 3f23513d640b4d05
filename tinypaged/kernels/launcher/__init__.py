"""Triton's CUDA launcher and `cuda_utils` in Python, so GPU kernels run with no C compiler.

Triton builds two small C extensions with the system compiler at first use: `cuda_utils` (load a
cubin, device properties, TMA descriptors) and one launcher per kernel signature (pack the
arguments, `cuLaunchKernelEx`). Here the same calls go through ctypes into the driver's
libcuda.so.1: `libcuda.py` declares the driver functions and the structs they take, `utils.py`
is `cuda_utils`, `launch.py` turns a kernel signature into a packing plan and a launcher, and
`install.py` puts them behind Triton's driver (TINYPAGED_TRITON_LAUNCHER picks the path).
"""
