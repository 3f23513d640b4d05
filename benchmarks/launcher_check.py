"""Triton's CUDA launcher, Python (no C compiler) against native (gcc), on one GPU, one sitting.

Each step runs in a fresh process with a fresh TRITON_CACHE_DIR per launcher, so the first
step of each pays the whole compile:
- "nocc" processes see no compiler: PATH holds only a folder with a `python` link, CC is unset,
  TINYPAGED_TRITON_LAUNCHER is left at auto (the child checks that gcc, cc and clang are gone);
- "gcc" processes keep PATH and set TINYPAGED_TRITON_LAUNCHER=native.
Steps: per-launch host cost of a 10-argument kernel (eager and inside a CUDA graph); first-call
time of an engine (LLM() + one generate, cold cache) and the anchor kit's offline workload on
the Qwen3-0.6B shape; the Llama-3-8B shape's offline workload and decode batch 1 / 8; optionally
the CUDA test files and the CLI benchmarks without a compiler. Prints one JSON line per result.

    python benchmarks/launcher_check.py --anchor ../shared/vllm-anchor [--n 256] [--tests] [--cli]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MICRO = r"""
import time, torch, triton, triton.language as tl
import tinypaged.kernels._triton  # installs the launcher choice
from triton.runtime import driver

@triton.jit
def axpy(x, y, out, a, n, s1, s2, s3, f, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out + offs, a * tl.load(x + offs, mask=m) + tl.load(y + offs, mask=m) + f, mask=m)

x, y = torch.randn(4096, device="cuda"), torch.randn(4096, device="cuda")
out = torch.empty_like(x)
t0 = time.perf_counter(); axpy[(4,)](x, y, out, 2.0, 4096, 1, 2, 3, 0.5, BLOCK=1024)
torch.cuda.synchronize(); first = time.perf_counter() - t0
assert torch.allclose(out, 2 * x + y + 0.5)
for _ in range(200): axpy[(4,)](x, y, out, 2.0, 4096, 1, 2, 3, 0.5, BLOCK=1024)
torch.cuda.synchronize(); n = 20000
t0 = time.perf_counter()
for _ in range(n): axpy[(4,)](x, y, out, 2.0, 4096, 1, 2, 3, 0.5, BLOCK=1024)
host_us = (time.perf_counter() - t0) / n * 1e6; torch.cuda.synchronize()
g = torch.cuda.CUDAGraph(); s = torch.cuda.Stream()
with torch.cuda.stream(s):
    axpy[(4,)](x, y, out, 3.0, 4096, 1, 2, 3, 0.0, BLOCK=1024)
    with torch.cuda.graph(g):
        axpy[(4,)](x, y, out, 3.0, 4096, 1, 2, 3, 0.0, BLOCK=1024)
out.zero_(); g.replay(); torch.cuda.synchronize()
assert torch.allclose(out, 3 * x + y), "graph replay"

from triton.tools.tensor_descriptor import TensorDescriptor

@triton.jit
def copy_tiles(src, dst, N: tl.constexpr, M: tl.constexpr):
    row = tl.program_id(0) * N
    tile = src.load([row, 0])
    offs = (row + tl.arange(0, N))[:, None] * M + tl.arange(0, M)[None, :]
    tl.store(dst + offs, tile)

a = torch.randn(128, 64, device="cuda", dtype=torch.float16)
b = torch.empty_like(a)
k = copy_tiles[(4,)](TensorDescriptor(a, list(a.shape), list(a.stride()), [32, 64]), b, N=32, M=64)
torch.cuda.synchronize()
assert torch.equal(a, b), "tensor descriptor copy"
print("RESULT", {"launcher": driver.active.launcher, "first_call_s": round(first, 3),
                 "host_us_per_launch": round(host_us, 2), "graph_replay_ok": True,
                 "tma_copy_ok": True, "tma": bool(getattr(k.metadata, "tensordesc_meta", None))})
"""

ENGINE = r"""
import sys, time, json
sys.path.insert(0, sys.argv[1])
import tinypaged_bench as tb
from tinypaged import SamplingParams
name, n = sys.argv[2], int(sys.argv[3])
t0 = time.perf_counter()
llm, cfg = tb.engine(name)
t_init = time.perf_counter() - t0
sp = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
gen = lambda ps: llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
t1 = time.perf_counter()
gen(tb.prompts(8, cfg["vocab_size"], seed=1))
t_first = time.perf_counter() - t1
ps = tb.prompts(n, cfg["vocab_size"], seed=0)
t1 = time.perf_counter(); outs = gen(ps); dt = time.perf_counter() - t1
tok = sum(len(o.outputs[0].token_ids) for o in outs)
from triton.runtime import driver
print("RESULT", {"launcher": driver.active.launcher, "model": name, "init_s": round(t_init, 1),
                 "warmup_generate_s": round(t_first, 1), "offline_out_tok_s": round(tok / dt, 1)})
if len(sys.argv) > 4:
    tb.latency(llm, cfg, SamplingParams, driver.active.launcher, name)
"""

NOCC_CHECK = (
    "import shutil, os; gone = [c for c in ('gcc', 'cc', 'clang') if shutil.which(c)];"
    "assert not gone and 'CC' not in os.environ, gone"
)


def env_for(kind: str, cache: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", TRITON_CACHE_DIR=cache)
    if kind == "nocc":
        bin_dir = tempfile.mkdtemp(prefix="nocc_bin_")
        os.symlink(sys.executable, os.path.join(bin_dir, "python"))
        os.symlink(sys.executable, os.path.join(bin_dir, "python3"))
        env["PATH"] = bin_dir
        env.pop("CC", None)
        env.pop("TINYPAGED_TRITON_LAUNCHER", None)
    else:
        env["TINYPAGED_TRITON_LAUNCHER"] = "native"
    return env


def run(kind: str, cache: str, argv: list[str], timeout: float) -> float:
    env = env_for(kind, cache)
    if kind == "nocc":
        subprocess.run([sys.executable, "-c", NOCC_CHECK], env=env, check=True)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, cwd=ROOT, timeout=timeout, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    lines = proc.stdout.splitlines()
    for line in [ln for ln in lines if ln.startswith(("RESULT ", "{"))] or lines[-3:]:
        print(json.dumps({"kind": kind, "wall_s": round(wall, 1), "out": line}), flush=True)
    if proc.returncode:
        print(proc.stdout[-4000:], flush=True)
        print(json.dumps({"kind": kind, "argv": argv[-3:], "rc": proc.returncode}), flush=True)
    return wall


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--anchor", default=os.path.join(ROOT, "..", "shared", "vllm-anchor"))
    parser.add_argument("--n", type=int, default=256, help="offline requests (the kit's BENCH_N)")
    parser.add_argument("--tests", action="store_true", help="CUDA test files, no compiler")
    parser.add_argument("--cli", action="store_true", help="bench throughput / latency CLI, no cc")
    parser.add_argument("--kinds", nargs="+", default=["nocc", "gcc"])
    parser.add_argument("--deadline", type=float, default=1e9, help="skip steps after N seconds")
    parser.add_argument("--tests-k", default="", help="pytest -k for the CUDA test files")
    parser.add_argument("--steps", nargs="+", default=["micro", "qwen3", "llama"])
    args = parser.parse_args()
    anchor = os.path.abspath(args.anchor)
    caches = {k: tempfile.mkdtemp(prefix=f"triton_{k}_") for k in args.kinds}
    py = sys.executable
    micro = os.path.join(tempfile.mkdtemp(), "micro.py")  # @triton.jit needs a source file
    with open(micro, "w") as f:
        f.write(MICRO)
    argvs = {"micro": [py, micro], "qwen3": [py, "-c", ENGINE, anchor, "qwen3-0.6b", str(args.n)],
             "llama": [py, "-c", ENGINE, anchor, "llama-3-8b", str(args.n), "lat"]}
    steps = [(k, argvs[s]) for s in args.steps for k in args.kinds]
    if args.tests:
        steps.append(("nocc", [py, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                               "tests/models/test_models_cuda.py", "tests/worker/test_piecewise.py",
                               *(["-k", args.tests_k] if args.tests_k else [])]))
    if args.cli:
        steps += [("nocc", [py, "-m", "tinypaged", "bench", *sub, "--model-shape", "llama3-8b"])
                  for sub in (["throughput", "--num-prompts", "32", "--output-len", "32"],
                              ["latency", "--batch-sizes", "1", "8", "--output-len", "32"])]
    start = time.perf_counter()
    for kind, argv in steps:
        left = args.deadline - (time.perf_counter() - start)
        if left < 20:
            print(json.dumps({"kind": kind, "skipped": argv[-3:]}), flush=True)
            continue
        try:
            run(kind, caches.setdefault(kind, tempfile.mkdtemp()), argv, min(left, 400))
        except subprocess.TimeoutExpired:
            print(json.dumps({"kind": kind, "timeout": argv[-3:]}), flush=True)
    for cache in caches.values():
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
