"""Which launcher Triton uses on CUDA, decided once per process, and the hook that installs it.

TINYPAGED_TRITON_LAUNCHER:
- "python": the ctypes launcher and utils of this package; no compiler is ever looked for.
- "native": Triton's own C modules, built with the system compiler (gcc, clang or $CC).
- "auto" (default): "python". Measured on an H200 beside the gcc-built launcher, the anchor
  workloads ran at the same speed (offline Llama-3-8B shape 8,484 vs 8,464 tok/s, decode batch
  1 / 8 226.1 / 203.2 vs 226.0 / 203.2), and a cold start skips one gcc run per kernel
  signature, so a compiler buys nothing; "native" stays one variable away for A/B runs.
  The launcher follows Triton 3.6's launcher interface; under another Triton, "auto" keeps
  Triton's own (TINYPAGED_TRITON_LAUNCHER=python still forces this one).

`install()` replaces Triton's active CUDA driver with a subclass whose `utils` and
`launcher_cls` follow that choice. Triton creates its driver on first use, and the stock one
compiles `cuda_utils` in its constructor, so this runs before any kernel is compiled (from
kernels/_triton.py, at import). Nothing here touches CUDA: a process that installs the driver
can still fork its tensor-parallel workers, which inherit the choice.
"""

from __future__ import annotations

import functools
import os
import shutil

from tinypaged import envs

TESTED_TRITON = (3, 6)  # the Triton whose driver.py this package mirrors


def compiler_on_path() -> str | None:
    """The C compiler Triton's build would use: $CC, else gcc, else clang (runtime/build.py)."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")


def chosen_launcher() -> str:
    """"python" or "native" for this process, from TINYPAGED_TRITON_LAUNCHER and the machine."""
    import triton

    choice = envs.TINYPAGED_TRITON_LAUNCHER
    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4: a build hook may stand in for CC
    build_impl = getattr(getattr(knobs, "build", None), "impl", None)
    can_build = compiler_on_path() is not None or build_impl is not None
    if choice == "native" and not can_build:
        raise RuntimeError(
            "TINYPAGED_TRITON_LAUNCHER=native needs a C compiler for Triton's launcher, and "
            "there is none ($CC is unset; no gcc or clang on PATH). Unset the variable (or set "
            "it to 'python') to launch kernels without one, or install gcc."
        )
    if choice == "auto":
        version = tuple(int(v) for v in triton.__version__.split(".")[:2] if v.isdigit())
        return "python" if version == TESTED_TRITON else "native"
    return choice


def python_launcher(src, metadata):
    """Triton's `launcher_cls(src, metadata)`: the kernel's generated Python launch function."""
    import torch
    from triton.runtime import _allocation

    from tinypaged.kernels.launcher.launch import PackedLaunch
    from tinypaged.kernels.launcher.libcuda import libcuda

    def alloc_scratch(which: str):
        allocator = _allocation._allocator if which == "global" else _allocation._profile_allocator
        return allocator.get()

    packed = PackedLaunch(
        src.signature.values(),
        num_warps=metadata.num_warps,
        num_ctas=getattr(metadata, "num_ctas", 1),
        shared=metadata.shared,
        cooperative=getattr(metadata, "launch_cooperative_grid", False),
        pdl=getattr(metadata, "launch_pdl", False),
        tensordesc_meta=getattr(metadata, "tensordesc_meta", None),
        global_scratch=(getattr(metadata, "global_scratch_size", 0),
                        getattr(metadata, "global_scratch_align", 1)),
        profile_scratch=(getattr(metadata, "profile_scratch_size", 0),
                         getattr(metadata, "profile_scratch_align", 1)),
        lib=libcuda(),
        current_device=torch.cuda.current_device,
        alloc_scratch=alloc_scratch,
    )
    return packed.launch


def _driver_class():
    from triton.backends.driver import GPUDriver
    from triton.backends.nvidia.driver import CudaDriver, CudaLauncher, CudaUtils

    class TinypagedCudaDriver(CudaDriver):
        """Triton's CUDA driver with `utils` and `launcher_cls` chosen on first use."""

        def __init__(self) -> None:
            GPUDriver.__init__(self)  # CudaDriver.__init__ would compile cuda_utils right here

        @functools.cached_property
        def _chosen(self) -> tuple[str, object]:
            """(launcher, utils): Triton's compiled cuda_utils goes with its C launcher (the
            launcher checks that TMA descriptors are of that module's type)."""
            launcher = chosen_launcher()
            if launcher == "native":
                return launcher, CudaUtils()
            from tinypaged.kernels.launcher.utils import PythonCudaUtils

            return launcher, PythonCudaUtils()

        @property
        def launcher(self) -> str:
            return self._chosen[0]

        @property
        def utils(self):
            return self._chosen[1]

        @property
        def launcher_cls(self):
            return CudaLauncher if self.launcher == "native" else python_launcher

    return TinypagedCudaDriver


def install() -> None:
    """Make Triton launch CUDA kernels through the chosen launcher (idempotent)."""
    import torch
    from triton.runtime import driver

    if torch.version.hip is not None:  # ROCm: Triton's HIP driver, untouched
        return
    active = getattr(driver, "_active", None)
    # Replace only Triton's own CUDA driver (or none yet): a driver someone else set (a
    # compile-only driver in the tests, a profiler's) is theirs to keep.
    if active is None or type(active).__name__ == "CudaDriver":
        driver.set_active(_driver_class()())
