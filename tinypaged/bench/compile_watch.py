"""Count the Triton kernels compiled while a benchmark's timed section runs.

A kernel compiles the first time it meets a new set of constexprs or argument specializations
(~0.5-2 s each on a GPU host). One compile inside a timed section is a stall a user would also
see in the middle of serving, and it makes the figure wrong by seconds; benchmarks report the
count beside their figures so that such a run is recognised (and the kernel named).

    with CompileWatch() as watch:
        ...timed work...
    watch.summary()  # {"compiles": 3, "compile_s": 2.41, "kernels": {"_lora_shrink_kernel": 3}}
"""

from __future__ import annotations

import time
from collections import Counter


class CompileWatch:
    """Installs Triton's JIT hooks for the `with` block (a no-op where Triton is missing)."""

    def __init__(self) -> None:
        self.kernels: Counter[str] = Counter()
        self.seconds = 0.0
        self._started: float | None = None
        self._saved = None

    def _before(self, **hook_args):
        self._started = time.perf_counter()
        return None  # go on and compile

    def _after(self, **hook_args):
        if self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self._started = None
        self.kernels[hook_args["fn"].name] += 1

    def __enter__(self) -> CompileWatch:
        try:
            from triton import knobs
        except ImportError:
            return self
        runtime = knobs.runtime
        self._saved = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = self._before, self._after
        return self

    def __exit__(self, *exc) -> None:
        if self._saved is not None:
            from triton import knobs

            knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._saved

    def summary(self) -> dict:
        return {"compiles": sum(self.kernels.values()), "compile_s": round(self.seconds, 2),
                "kernels": dict(self.kernels)}
