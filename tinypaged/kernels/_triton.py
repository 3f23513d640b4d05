"""Triton, when it is there, and the rule that decides who runs an op.

Every kernel module does `from tinypaged.kernels._triton import jit, tl, use_triton`:

- `HAS_TRITON` is False when triton cannot be imported (macOS, Windows, a bare CPU install); then
  `jit` leaves the function undecorated and `tl` only offers `constexpr`, so the kernel modules
  still import and their torch references run.
- On a machine without a CUDA device, triton is imported and `jit` builds kernels for the Triton
  interpreter (CPU tensors) whatever TRITON_INTERPRET said at import time: there is nothing else
  they could run on, and tests need not care which module imported triton first.
- `use_triton(x)` is the dispatch rule of every public op: Triton when `x` is on CUDA, or when
  TRITON_INTERPRET=1 (read at call time); otherwise the torch reference.
- `kernel_choice(kernels)` overrides that rule while an engine runs its model (EngineConfig's
  `kernels`, the CLI's `--kernels`, $TINYPAGED_KERNELS): "auto" keeps it, "triton" runs the Triton
  kernels on every device (on the CPU through the interpreter: slow, but a learner's edit to a
  kernel shows in the generated text), "torch" runs the references on every device.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys

import torch


def _has_gpu() -> bool:
    """device_count() asks NVML, not the CUDA driver: importing the kernels must not initialize
    CUDA, or the engine could no longer fork its tensor-parallel workers (worker/tp_worker.py)."""
    return torch.cuda.device_count() > 0


def _import_triton():
    """Import triton; without a CUDA device, import it the way TRITON_INTERPRET=1 would.

    triton.language's own helpers (tl.sum, tl.sigmoid, tl.cdiv, ...) are built for the interpreter
    only when TRITON_INTERPRET=1 at triton's import, and the interpreter is the one place kernels
    can run without a GPU. The variable is restored afterwards: it still means "dispatch to
    Triton on CPU" (see `use_triton`), which only the caller decides.
    """
    if "triton" in sys.modules or _has_gpu():
        import triton
    else:
        previous = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            import triton
            import triton.runtime.interpreter

            # imported lazily by the interpreter, and it checks the flag at import
            with contextlib.suppress(ImportError):
                import triton.experimental.gluon
        finally:
            if previous is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = previous
    import triton.language as tl

    return triton, tl


try:
    triton, tl = _import_triton()
    HAS_TRITON = True
    if _has_gpu():  # before any kernel compiles: CUDA launches need no C compiler (launcher/)
        from tinypaged.kernels.launcher.install import install

        install()
except ImportError:  # no triton wheel for this platform: references only
    triton = None
    HAS_TRITON = False

    class _NoTritonLanguage:
        """Just enough of `triton.language` for kernel signatures to be evaluated."""

        constexpr = object

    tl = _NoTritonLanguage()


def jit(fn=None, *, do_not_specialize: tuple[str, ...] = (),
        do_not_specialize_on_alignment: tuple[str, ...] = ()):
    """`triton.jit`, building interpreter kernels on CPU-only machines (see module docstring).

    do_not_specialize: integer arguments that change from step to step (sequence counts, split
    counts, M). Triton otherwise compiles a separate variant when such a value is 1 or a multiple
    of 16, a 1-2 s stall in the middle of serving the first time it happens.
    do_not_specialize_on_alignment: pointer arguments that may or may not be 16-byte aligned
    (views at offsets into a larger buffer), which would otherwise give a variant each."""
    if fn is None:
        return lambda f: jit(f, do_not_specialize=do_not_specialize,
                             do_not_specialize_on_alignment=do_not_specialize_on_alignment)
    if not HAS_TRITON:
        return fn
    if not _has_gpu():
        from triton.runtime.interpreter import InterpretedFunction

        # the interpreter ignores do_not_specialize; kept for tools that compute the GPU
        # compiler's specialization key of a launch (tinypaged/bench/compile_keys.py)
        return InterpretedFunction(fn, do_not_specialize=list(do_not_specialize),
                                   do_not_specialize_on_alignment=list(
                                       do_not_specialize_on_alignment))
    return triton.jit(fn, do_not_specialize=list(do_not_specialize),
                      do_not_specialize_on_alignment=list(do_not_specialize_on_alignment))


def interpreting() -> bool:
    """True when TRITON_INTERPRET=1 asks for Triton kernels on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1"


KERNEL_CHOICES = ("auto", "triton", "torch")
_choice = "auto"  # set by kernel_choice() for the duration of a forward pass


class kernel_choice:
    """`with kernel_choice("triton"): model(...)` runs every op of the forward through Triton
    ("torch": through the references; "auto": the default rule of `use_triton`)."""

    def __init__(self, kernels: str) -> None:
        if kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}; got {kernels!r}")
        if kernels == "triton" and not HAS_TRITON:
            raise ValueError(
                "kernels='triton' needs the triton package, which could not be imported (it has "
                "wheels for Linux only); use kernels='auto' to run the torch references"
            )
        self.kernels = kernels

    def __enter__(self) -> None:
        global _choice
        self.previous, _choice = _choice, self.kernels

    def __exit__(self, *exc: object) -> None:
        global _choice
        _choice = self.previous


def use_triton(x: torch.Tensor) -> bool:
    """The dispatch rule: Triton for CUDA tensors (or under the interpreter), else the reference;
    inside `kernel_choice("triton" | "torch")`, that choice."""
    if _choice != "auto":
        return _choice == "triton"
    return HAS_TRITON and (x.is_cuda or interpreting())


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision for operands of `dtype`: fp32 operands (CPU tests, fp32 models)
    get full fp32 products, "ieee", instead of the TF32 that Triton would round them to."""
    return "ieee" if dtype == torch.float32 else "tf32"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (132 on an H200); cached, no host sync."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count
