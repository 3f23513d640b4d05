"""Count the Triton kernels compiled while a benchmark's timed section runs.

A kernel compiles the first time it meets a new set of constexprs or argument specializations
(~0.5-2 s each on a GPU host). One compile inside a timed section is a stall a user would also
see in the middle of serving, and it makes the figure wrong by seconds; benchmarks report the
count beside their figures so that such a run is recognised (and the kernel named).

    with CompileWatch() as watch:
        ...timed work...
    watch.summary()  # {"compiles": 3, "compile_s": 2.41, "kernels": {"_lora_shrink_kernel": 3}}

Or around a whole script, each compile printed to stderr as it happens (its time from the start,
its seconds, the kernel), between the script's own lines:

    python -m tinypaged.bench.compile_watch SCRIPT.py [ARGS...]
"""

from __future__ import annotations

import runpy
import sys
import time
from collections import Counter


def triton_knobs():
    """triton.knobs, or None where Triton is missing. Imported through tinypaged's kernels
    module, which must import triton first (kernels/_triton.py: the interpreter's helpers are
    built only when triton is imported with TRITON_INTERPRET set)."""
    from tinypaged.kernels import _triton

    return _triton.triton.knobs if _triton.HAS_TRITON else None


class CompileWatch:
    """Installs Triton's JIT hooks for the `with` block (a no-op where Triton is missing)."""

    def __init__(self, verbose: bool = False) -> None:
        self.verbose, self.created = verbose, time.perf_counter()
        self.kernels: Counter[str] = Counter()
        self.seconds = 0.0
        self._started: float | None = None
        self._saved = None

    def _before(self, **hook_args):
        self._started = time.perf_counter()
        return None  # go on and compile

    def _after(self, **hook_args):
        name, took = hook_args["fn"].name, 0.0
        if self._started is not None:
            took = time.perf_counter() - self._started
            self.seconds += took
            self._started = None
        self.kernels[name] += 1
        if self.verbose:
            print(f"[compile] t={time.perf_counter() - self.created:.1f}s {took:.2f}s {name}",
                  file=sys.stderr, flush=True)

    def __enter__(self) -> CompileWatch:
        knobs = triton_knobs()
        if knobs is None:
            return self
        runtime = knobs.runtime
        self._saved = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = self._before, self._after
        return self

    def __exit__(self, *exc) -> None:
        if self._saved is not None:
            runtime = triton_knobs().runtime
            runtime.jit_cache_hook, runtime.jit_post_compile_hook = self._saved

    def summary(self) -> dict:
        return {"compiles": sum(self.kernels.values()), "compile_s": round(self.seconds, 2),
                "kernels": dict(self.kernels)}


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m tinypaged.bench.compile_watch SCRIPT.py [ARGS...]")
    sys.argv = sys.argv[1:]
    with CompileWatch(verbose=True) as watch:
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
        finally:
            print(f"[compile] {watch.summary()}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
