"""Tensor-parallel correctness on GPUs: greedy tokens at TP=N against TP=1, run before timings.

1. Tiny random models of every architecture (tinypaged/bench/tiny_models.py), fp32 and bf16,
   CUDA graphs on (or --eager): per TP size, prompts whose greedy tokens equal TP=1's.
2. The Llama-3-8B shape in bf16 with random weights from a fixed seed (N(0, 0.02), norms 1),
   written once as a sharded safetensors checkpoint so that every TP size loads the same
   weights through the sharded loader: the first 32 greedy tokens of 4 prompts at TP=N vs TP=1.
   bf16 sums in a different order across ranks, so random weights can put two tokens within
   rounding of each other; at the first disagreement the TP=1 logprob margin between the two
   tokens is printed beside the largest logprob difference seen before it: a margin about that
   size is a near-tie, a margin far above it is a bug.
3. --one-rank-group: TP=1 through the tensor-parallel executor (a one-rank NCCL group, so every
   row-parallel all-reduce runs through NCCL, inside the captured CUDA graphs too) against the
   plain engine, on the tiny models. Runs on a one-GPU machine.
4. --kill-check: SIGKILL worker rank 1 while requests decode at the largest TP size; prints how
   long until LLM.generate raised the error naming it (the NCCL watchdog abort path) and how
   long shutdown() took after it.
5. --signal-check: a script that builds the LLM at module level, with no main guard (workers
   forked), run in a subprocess at the largest TP size, ended once by SIGINT and once by
   SIGTERM: how long until it exited, and whether its worker is gone. Then the same two signals
   to `tinypaged serve -tp N` after it answered a request: exit time, exit status, and whether
   every process it started (engine core, workers) is gone. And an LLM dropped without
   shutdown() (`del llm; gc.collect()`): how long until its workers are gone.
In one process only the first TP engine gets the custom all-reduce; the later ones all-reduce
through NCCL (distributed/custom_all_reduce.py says why). So every TP engine of checks 1, 2 and 4
runs in a fresh child process (this script again, one per model, dtype and TP size), where the
custom all-reduce serves it as it serves `tinypaged serve` and the bench; a child that fails or
hangs gives a row saying so and leaves its output in $OUT. Every shutdown() is timed, the children's
too (the largest is printed). The script exits with status 3 at once if an error never comes within
120 s or a shutdown takes over 60 s (a hang).

    PYTHONPATH=. python benchmarks/tp_check.py --tp 2 4 --kill-check   # 4 GPUs; --tp 2 on two
    PYTHONPATH=. python benchmarks/tp_check.py --one-rank-group        # one GPU
    PYTHONPATH=. python benchmarks/tp_check.py --tp 1 2 --pp 2 --eager  # PP=2, TP=2 x PP=2: 4 GPUs
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import gc
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

# NVLink multicast stays off (device README: it can take a shared host's GPUs down for a day).
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

from tinypaged import LLM, SamplingParams  # noqa: E402
from tinypaged.bench.offline import SHAPES  # noqa: E402
from tinypaged.bench.tiny_models import save_tiny  # noqa: E402

KINDS = ["llama", "qwen2", "qwen3", "glm", "glm4", "chatglm"]  # all; the default is 3 of them


SHUTDOWN_S: list[float] = []  # every timed shutdown()


def hang_guard(seconds: float, what: str) -> threading.Timer:
    """Exit with status 3 unless cancelled within `seconds`: a hang fails fast and loudly."""
    def hang() -> None:
        print(f"| {what} | HANG: not done after {seconds:.0f} s |", flush=True)
        faulthandler.dump_traceback(all_threads=True)  # where rank 0 waits
        os._exit(3)

    guard = threading.Timer(seconds, hang)
    guard.daemon = True
    guard.start()
    return guard


def timed_shutdown(llm: LLM) -> float:
    guard = hang_guard(60.0, "shutdown")
    start = time.monotonic()
    llm.shutdown()
    guard.cancel()
    SHUTDOWN_S.append(time.monotonic() - start)
    return SHUTDOWN_S[-1]


START = time.monotonic()


PP = 1  # --pp: pipeline stages of the TP engines compared with TP=1


def log(line: str) -> None:
    print(f"[{time.monotonic() - START:6.1f} s] {line}", flush=True)


def run(path: str, prompts: list[list[int]], steps: int, **engine) -> list:
    """(token ids, per-step logprobs) of each prompt; the engine (and its workers) is freed.
    Start-up (Triton compiles, graph capture) and generation must end within 240 s."""
    what = f"{Path(path).name} {engine.get('dtype')} TP={engine.get('tensor_parallel_size', 1)}"
    guard = hang_guard(240.0, f"engine {what}")
    llm = LLM(path, skip_tokenizer_init=True, **engine)
    log(f"{what}: engine up")
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    guard.cancel()
    log(f"{what}: generated")
    timed_shutdown(llm)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def compare(ref: list, ours: list) -> tuple[int, str]:
    """(prompts fully equal, note on the worst first disagreement)."""
    equal, notes = 0, []
    for (ref_ids, ref_lp), (ids, lp) in zip(ref, ours):
        if ids == ref_ids:
            equal += 1
            continue
        i = next(i for i, (a, b) in enumerate(zip(ids, ref_ids)) if a != b)
        noise = max((abs(lp[j][t] - ref_lp[j][t]) for j in range(i) for t in [ids[j]]),
                    default=0.0)
        margin = ref_lp[i][ref_ids[i]] - ref_lp[i].get(ids[i], float("-inf"))
        notes.append(f"token {i}: TP=1 margin {margin:.3f} vs max |dlogprob| {noise:.3f} before")
    return equal, "; ".join(notes[:2])


def tiny_checks(kinds: list[str], dtypes: list[str], tp_sizes: list[int], eager: bool,
                one_rank_group: bool) -> list[tuple]:
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 250) for _ in range(rng.randint(5, 60))] for _ in range(8)]
    rows = []
    for kind in kinds:
        path = Path(tempfile.mkdtemp(prefix=f"tp-check-{kind}-"))
        save_tiny(kind, path)
        for dtype in dtypes:
            engine = dict(dtype=dtype, num_kv_blocks=256, max_num_seqs=16, enforce_eager=eager)
            ref = run(str(path), prompts, 16, **engine)
            if one_rank_group:
                import tinypaged.engine.engine as engine_module
                from tinypaged.worker.executor import MultiprocExecutor, create_executor

                engine_module.create_executor = MultiprocExecutor
                try:
                    ours = run(str(path), prompts, 16, **engine)
                finally:
                    engine_module.create_executor = create_executor
                rows.append((kind, dtype, "1 (1-rank group)", *compare(ref, ours), len(prompts)))
            for tp in tp_sizes:
                ours = run(str(path), prompts, 16, tensor_parallel_size=tp,
                           pipeline_parallel_size=PP, **engine)
                rows.append((kind, dtype, tp, *compare(ref, ours), len(prompts)))
        shutil.rmtree(path)
    return rows


def write_random_llama(path: Path, cfg: dict, seed: int = 0, device: str = "cuda") -> None:
    """A llama checkpoint of config `cfg` with N(0, 0.02) weights (norms 1) drawn on `device`
    from `seed`, one safetensors file per layer plus the shard index."""
    from safetensors.torch import save_file

    (path / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    vocab = cfg["vocab_size"]
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape):
        t = torch.empty(shape, device=device, dtype=torch.bfloat16)
        return t.normal_(0.0, 0.02, generator=gen).cpu()

    files: dict[str, dict[str, torch.Tensor]] = {
        "embed.safetensors": {"model.embed_tokens.weight": rand(vocab, h)},
        "head.safetensors": {"lm_head.weight": rand(vocab, h),
                             "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)},
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        files[f"layer{i:02d}.safetensors"] = {
            p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
            p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        }
    weight_map = {}
    for name, tensors in files.items():
        save_file(tensors, path / name)
        weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def llama8b_checks(tp_sizes: list[int], eager: bool, steps: int = 32) -> list[tuple]:
    path = Path(tempfile.mkdtemp(prefix="tp-check-llama8b-"))
    try:
        write_random_llama(path, SHAPES["llama3-8b"])
        log("Llama-3-8B-shape checkpoint written")
        rng = random.Random(1)
        prompts = [[rng.randrange(1000, 127000) for _ in range(n)] for n in (7, 60, 200, 513)]
        engine = dict(dtype="bfloat16", num_kv_blocks=1024, max_num_seqs=16,
                      max_model_len=2048, enforce_eager=eager)
        ref = run(str(path), prompts, steps, **engine)
        return [("llama3-8b shape", "bfloat16", tp, *compare(ref, run(
            str(path), prompts, steps, tensor_parallel_size=tp, pipeline_parallel_size=PP,
            **engine)), len(prompts))
            for tp in tp_sizes]
    finally:
        shutil.rmtree(path, ignore_errors=True)


def rows_from_child(flags: list[str], what: str, tp: int, timeout: float) -> list[tuple]:
    """Run this script again with `flags` in a fresh process and return its rows. There the
    first TP engine is the process's first, so it all-reduces through the custom all-reduce; a
    later TP engine in this process would all-reduce through NCCL. A child that fails or hangs
    gives one row saying so, and its whole output goes to $OUT (or the temp folder)."""
    cmd = [sys.executable, __file__, "--rows-json", *flags]
    env = {**os.environ, "PYTHONPATH": "."}
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        lines = out.stdout.splitlines()
        rows = [tuple(json.loads(line[4:])) for line in lines if line.startswith("ROW ")]
        SHUTDOWN_S.extend(float(line[9:]) for line in lines if line.startswith("SHUTDOWN "))
        if out.returncode == 0 and rows:
            return rows
        failure, text = f"child exited {out.returncode}", out.stdout + out.stderr
    except subprocess.TimeoutExpired as exc:
        text = "".join(t.decode() if isinstance(t, bytes) else t or ""
                       for t in (exc.stdout, exc.stderr))
        failure = f"HANG: the child did not end within {timeout:.0f} s"
    name = f"tp-check-{what.replace(' ', '-')}-tp{tp}.log"
    log_file = Path(os.environ.get("OUT", tempfile.gettempdir())) / name
    log_file.write_text(" ".join(cmd) + "\n" + text)
    tail = text[-300:].replace("\n", " ")
    return [(what, "", tp, 0, f"{failure} (output in {log_file}): ...{tail}", 0)]


def kill_check(tp: int, eager: bool) -> tuple:
    """Kill worker rank 1 mid-decode; the error must name it within seconds, not hang."""
    path = Path(tempfile.mkdtemp())
    save_tiny("llama", path)
    llm = LLM(str(path), skip_tokenizer_init=True, tensor_parallel_size=tp, num_kv_blocks=256,
              enforce_eager=eager)
    pid = llm.engine.executor.workers[0].process.pid
    guard = hang_guard(120.0, f"kill check TP={tp}: error after killing rank 1")
    threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
    start = time.monotonic()
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    try:
        for _ in range(1000):
            llm.generate([{"prompt_token_ids": [5, 6, 7 + i]} for i in range(8)], params,
                         use_tqdm=False)
        note = "no error at all"
    except RuntimeError as exc:
        after = time.monotonic() - start - 1.0
        note = f"RuntimeError {after:.2f} s after the kill: {str(exc).splitlines()[0]}"
    guard.cancel()
    note += f"; shutdown() then took {timed_shutdown(llm):.2f} s"
    shutil.rmtree(path)
    return ("kill check", "float32", tp, 0, note, 0)


SCRIPT = """\
import sys
from tinypaged import LLM, SamplingParams
llm = LLM(sys.argv[1], skip_tokenizer_init=True, tensor_parallel_size=int(sys.argv[2]),
          num_kv_blocks=256)
worker = llm.engine.executor.workers[0].process
print("METHOD", type(worker).__name__, flush=True)  # ForkProcess or SpawnProcess
print("WORKER", worker.pid, flush=True)
params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
while True:
    print("TOKENS", llm.generate([5, 6, 7], params, use_tqdm=False)[0].outputs[0].token_ids[:4],
          flush=True)
"""


def signal_check(tp: int) -> list[tuple]:
    """A module-level script (no main guard) at TP=`tp`, ended by SIGINT, then by SIGTERM."""
    path = Path(tempfile.mkdtemp())
    save_tiny("llama", path)
    script = path / "module_level.py"
    script.write_text(SCRIPT)
    rows = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        proc = subprocess.Popen([sys.executable, str(script), str(path), str(tp)], text=True,
                                stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": "."})
        guard = hang_guard(300.0, f"signal check TP={tp} {sig.name}")
        lines = {}
        while "TOKENS" not in lines and (line := proc.stdout.readline()):
            lines.update([line.rstrip().split(" ", 1)])
        if "TOKENS" not in lines:
            note = f"the script failed before generating (exit status {proc.wait()})"
        else:
            note = f"worker a {lines['METHOD']}; " + end_by_signal(proc, sig)
        rows.append(("module-level script", "float32", tp, 0, note, 0))
        guard.cancel()
    shutil.rmtree(path)
    return rows


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children, ...), read from /proc."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    """The pids still alive after up to `timeout` s (zombies count as gone)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                alive.append(pid)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def end_by_signal(proc: subprocess.Popen, sig: signal.Signals) -> str:
    """Send `sig` to `proc`; how long until it exited (60 s at most, then it is killed) and
    whether every process it had started (workers, an engine process) is gone."""
    procs = descendants(proc.pid)
    proc.send_signal(sig)
    start = time.monotonic()
    try:
        proc.wait(timeout=60)
        took = (f"exited {time.monotonic() - start:.2f} s after {sig.name} "
                f"(status {proc.returncode})")
    except subprocess.TimeoutExpired:
        took = f"STILL RUNNING 60 s after {sig.name}"
        proc.kill()
    left = wait_gone(procs)
    return (f"{took}; {len(procs)} processes below it, "
            f"{'still running: ' + str(left) if left else 'all gone'}")


def gc_check(tp: int) -> tuple:
    """An LLM at TP=`tp` dropped without shutdown(): its finalizer must stop the workers."""
    path = Path(tempfile.mkdtemp())
    save_tiny("llama", path)
    llm = LLM(str(path), skip_tokenizer_init=True, tensor_parallel_size=tp, num_kv_blocks=256)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=8), use_tqdm=False)
    workers = [w.process.pid for w in llm.engine.executor.workers]
    start = time.monotonic()
    del llm
    gc.collect()
    left = wait_gone(workers, 20.0)
    took = time.monotonic() - start
    shutil.rmtree(path)
    note = f"del llm + gc.collect(): {len(workers) - len(left)}/{len(workers)} workers gone "
    return ("garbage-collected LLM", "float32", tp, 0, note + f"after {took:.2f} s", 0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_check(tp: int) -> list[tuple]:
    """`tinypaged serve -tp N`, one completion answered, then SIGINT (Ctrl-C) and SIGTERM."""
    import httpx
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = Path(tempfile.mkdtemp())
    save_tiny("llama", path)
    # A word-level tokenizer over the tiny vocabulary (the GPU machine cannot fetch one).
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    rows = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "tinypaged", "serve", str(path), "-tp", str(tp), "--port",
             str(port), "--num-kv-blocks", "256", "--max-model-len", "256"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": "."})
        guard = hang_guard(300.0, f"serve check TP={tp} {sig.name}")
        url = f"http://127.0.0.1:{port}"
        while proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        if proc.poll() is not None:
            note = f"serve exited {proc.returncode} before it was healthy: " + \
                proc.stderr.read()[-300:].replace("\n", " ")
        else:
            body = {"model": str(path), "prompt": [5, 6, 7], "max_tokens": 8,
                    "temperature": 0.0, "ignore_eos": True}
            reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
            note = f"request answered {reply.status_code}; " + end_by_signal(proc, sig)
        rows.append(("tinypaged serve", "bfloat16", tp, 0, note, 0))
        guard.cancel()
        if proc.poll() is None:
            proc.kill()
    shutil.rmtree(path)
    return rows


def row_text(row: tuple) -> str:
    model, dtype, tp, equal, note, n = row
    return f"| {model} | {dtype} | {tp} | {equal}/{n} | {note} |"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, nargs="*", default=[2], help="TP sizes against TP=1")
    parser.add_argument("--kinds", nargs="*", default=["llama", "qwen3", "glm"], choices=KINDS)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--one-rank-group", action="store_true",
                        help="also TP=1 through a one-rank NCCL group (one GPU is enough)")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--skip-8b", action="store_true")
    parser.add_argument("--kill-check", action="store_true", help="kill a worker mid-decode")
    parser.add_argument("--signal-check", action="store_true",
                        help="SIGINT / SIGTERM a module-level script and `tinypaged serve` "
                        "running TP; an LLM dropped without shutdown()")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages of every TP "
                        "engine of checks 1 and 2 (TP x PP GPUs; --tp 1 --pp 2 on two)")
    parser.add_argument("--rows-json", action="store_true",
                        help="also print each row as 'ROW <json>' (a child of rows_from_child)")
    args = parser.parse_args()
    global PP
    PP = args.pp
    print(f"{torch.cuda.device_count()} GPU(s); NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']}")
    tp, eager = max(args.tp, default=1), ["--eager"] if args.eager else []
    checks = []
    if args.rows_json or not args.tp:  # a child of rows_from_child, or no TP engine at all
        checks.append(lambda: tiny_checks(args.kinds, args.dtypes, args.tp, args.eager,
                                          args.one_rank_group))
        if args.tp and not args.skip_8b:
            checks.append(lambda: llama8b_checks(args.tp, args.eager))
        if args.tp and args.kill_check:
            checks.append(lambda: [kill_check(tp, args.eager)])
    else:  # every TP engine in a fresh process, so that the custom all-reduce serves it
        for kind in args.kinds:
            for dtype in args.dtypes:
                for size in args.tp:
                    one_rank = ["--one-rank-group"] if args.one_rank_group and size == tp else []
                    flags = ["--kinds", kind, "--dtypes", dtype, "--tp", str(size), "--skip-8b",
                             "--pp", str(args.pp)]
                    checks.append(functools.partial(rows_from_child, flags + eager + one_rank,
                                                    kind, size, 300))
        if not args.skip_8b:
            for size in args.tp:
                checks.append(functools.partial(rows_from_child, ["--kinds", "--tp", str(size),
                                                "--pp", str(args.pp)] + eager,
                                                "llama3-8b shape", size, 400))
        if args.kill_check:
            checks.append(functools.partial(rows_from_child, [
                "--kinds", "--tp", str(tp), "--skip-8b", "--kill-check"] + eager,
                "kill check", tp, 200))
    if args.tp and args.signal_check and not args.rows_json:
        checks += [lambda: signal_check(tp), lambda: serve_check(tp), lambda: [gc_check(tp)]]
    rows = []
    for check in checks:
        for row in check():
            rows.append(row)
            log(row_text(row))
            if args.rows_json:
                print("ROW " + json.dumps(row), flush=True)
    print("| model | dtype | TP | prompts equal to TP=1 | first disagreements |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(row_text(row))
    if args.rows_json:  # for the parent's count
        print("\n".join(f"SHUTDOWN {t}" for t in SHUTDOWN_S))
    print(f"{len(SHUTDOWN_S)} shutdown() calls, the slowest {max(SHUTDOWN_S, default=0):.2f} s")


if __name__ == "__main__":
    main()
