"""Which Triton kernels a CPU run would compile on an H200, launch by launch.

A GPU compiles a kernel again whenever a launch brings a specialization key it has not seen: new
constexprs or launch options (num_warps, ...), or another specialization of a plain argument
(Triton 3.6: an integer equal to 1 or a multiple of 16, a pointer whose data_ptr is 16-byte
aligned; not for the arguments in do_not_specialize). On the CPU the kernels run in Triton's
interpreter, which has no such key; `KeyRecorder` computes it for every launch with the binder
the GPU's JITFunction would use (built for sm_90 without a GPU, nothing compiled) while the
interpreter still runs the launch. Comparing the keys of two runs of a workload names the kernel
and the argument behind a compile that stalls the second run (a prefix-cached prompt, a new batch
shape):

    with KeyRecorder() as first:
        llm.generate(prompts, params)
    with KeyRecorder() as second:
        llm.generate(prompts, params)
    print(second.new_since(first))  # {kernel: [{argument: (seen before, now)}]}

    python -m tinypaged.bench.compile_keys [--batch-sizes 1 8] [--speculative]

The second form runs benchmarks/spec_decode_ngram.py's workload (the same chat prompts three
times, the default model) with kernels="triton" and prints the keys new in runs 2 and 3.
Alignment is the CPU allocator's: a pointer argument can differ from the GPU's caching allocator.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

from tinypaged.kernels import _triton


def _sm90_backend():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    return make_backend(GPUTarget("cuda", 90, 32))


def _plain(value):
    """A printable, hashable form of one specialization entry."""
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


class KeyRecorder:
    """Records (kernel, specialization key) of every interpreted launch in the `with` block."""

    _binders: dict = {}  # kernel function -> (parameter names, binder)

    def __init__(self) -> None:
        self.keys: dict[str, set[tuple]] = defaultdict(set)
        self._saved = None

    @classmethod
    def _binder(cls, interpreted):
        from triton.runtime.jit import JITFunction, create_function_from_signature

        if interpreted.fn not in cls._binders:
            jitted = JITFunction(interpreted.fn, **interpreted.kwargs)
            binder = create_function_from_signature(jitted.signature, jitted.params,
                                                    _sm90_backend())
            cls._binders[interpreted.fn] = ([p.name for p in jitted.params], binder)
        return cls._binders[interpreted.fn]

    def key(self, interpreted, args, kwargs) -> tuple:
        """((argument, specialization), ...) + ((option, value), ...): JITFunction.run's key."""
        names, binder = self._binder(interpreted)
        _, specialization, options = binder(*args, **kwargs)
        return (tuple(zip(names, _plain(specialization)))
                + tuple(sorted((k, _plain(v)) for k, v in options.items())))

    def __enter__(self) -> KeyRecorder:
        from triton.runtime.interpreter import InterpretedFunction

        run, recorder = InterpretedFunction.run, self

        def recording_run(fn, *args, grid, warmup, **kwargs):
            recorder.keys[fn.__name__].add(recorder.key(fn, args, kwargs))
            return run(fn, *args, grid=grid, warmup=warmup, **kwargs)

        self._saved = run
        InterpretedFunction.run = recording_run
        return self

    def __exit__(self, *exc) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        InterpretedFunction.run = self._saved

    def new_since(self, *earlier: KeyRecorder) -> dict[str, list[dict]]:
        """For each key of this run that none of `earlier` had: what differs from the nearest
        earlier key of the same kernel, {argument: (before, now)} (every argument of a kernel
        no earlier run launched: {argument: (None, now)})."""
        seen: dict[str, set] = defaultdict(set)
        for run in earlier:
            for name, keys in run.keys.items():
                seen[name] |= keys
        new: dict[str, list[dict]] = {}
        for name, keys in sorted(self.keys.items()):
            for key in sorted(keys - seen[name], key=repr):
                new.setdefault(name, []).append(_difference(key, seen[name]))
        return new


def _difference(key: tuple, earlier: set[tuple]) -> dict:
    now = dict(key)
    if not earlier:
        return {k: (None, v) for k, v in now.items()}
    nearest = min(earlier, key=lambda e: sum(dict(e).get(k) != v for k, v in now.items()))
    before = dict(nearest)
    return {k: (before.get(k), v) for k, v in now.items() if before.get(k) != v}


def warm_up_keys(runner) -> KeyRecorder:
    """The keys of the runner's start-up warm-up (ModelRunner._warm_up, which a GPU runs
    before serving and a CPU skips): what a GPU has compiled before the first request."""
    import torch

    synchronize, torch.cuda.synchronize = torch.cuda.synchronize, lambda device=None: None
    try:
        with KeyRecorder() as recorder:
            runner._warm_up()
    finally:
        torch.cuda.synchronize = synchronize
    return recorder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--speculative", action="store_true",
                        help="n-gram speculation as spec_decode_ngram.py's default")
    args = parser.parse_args()
    import runpy
    from pathlib import Path

    from tinypaged import LLM, SamplingParams

    benchmark = Path(__file__).resolve().parents[2] / "benchmarks" / "spec_decode_ngram.py"
    prompts = runpy.run_path(str(benchmark))["prompts"]  # the benchmark's chat prompts

    engine = dict(model=args.model, max_model_len=2048, kernels="triton")
    if args.speculative:
        engine["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 4,
                                        "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    llm = LLM(**engine)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    runs = [warm_up_keys(llm.engine.runner)]
    print(json.dumps({"warm_up": sorted(runs[0].keys)}), flush=True)
    for batch in args.batch_sizes:
        for run in range(args.runs):
            with KeyRecorder() as recorder:
                llm.chat(prompts(batch), params, use_tqdm=False)
            print(json.dumps({"batch": batch, "run": run + 1, "speculative": args.speculative,
                              "new_keys": recorder.new_since(*runs)}, default=str), flush=True)
            runs.append(recorder)
    assert _triton.HAS_TRITON


if __name__ == "__main__":
    main()
