"""Every way a tensor-parallel engine ends, on the CPU (2 ranks over gloo): each returns within
seconds and leaves no worker behind.

- shutdown() of a healthy engine: the workers answer "stopping", leave the group with rank 0 and
  exit 0 by themselves (not killed); the process group is gone in rank 0.
- shutdown() after a worker was SIGKILLed, and after a worker stopped answering (SIGSTOP):
  bounded, the survivor is killed, the group is left.
- Ctrl-C (KeyboardInterrupt) in rank 0 in the middle of a step; a Ctrl-C that reaches a worker
  while it starts stays pending there (worker_main discards it) instead of killing it.
- SIGTERM of `tinypaged serve -tp 2`: exits 0 within seconds, its worker gone.
- A script that builds the LLM at module level without `if __name__ == "__main__":` runs
  (workers are forked); with spawn forced, it fails at once with one sentence naming the line to
  move; the guarded script runs under spawn and ends within seconds of SIGINT.
(Garbage collection of an LLM: tests/distributed/test_tp.py.)
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from helpers.models import single_thread  # noqa: F401 - autouse fixture
from helpers.server import build_tiny_model, free_port

import tinypaged.worker.executor as executor_module
from tinypaged import LLM, SamplingParams
from tinypaged.distributed import sigint_watch
from tinypaged.worker.tp_worker import sigint_held_back

ROOT = Path(__file__).resolve().parents[2]
ENGINE = dict(skip_tokenizer_init=True, num_kv_blocks=32, block_size=8, max_model_len=64)
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llama"))  # with the default tokenizer


def timed_shutdown(llm: LLM) -> float:
    start = time.monotonic()
    llm.shutdown()
    return time.monotonic() - start


def gone(pid: int, timeout: float = 10.0) -> bool:
    """True once no process `pid` exists (a worker whose parent exited is reaped by init)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.timeout(120)
def test_healthy_workers_leave_the_group_with_rank0_and_exit_by_themselves(model_dir):
    llm = LLM(str(model_dir), tensor_parallel_size=2, **ENGINE)
    worker = llm.engine.executor.workers[0].process
    assert len(llm.generate(PROMPT, PARAMS, use_tqdm=False)[0].outputs[0].token_ids) == 6
    assert timed_shutdown(llm) < 10.0
    worker.join(10.0)
    assert worker.exitcode == 0  # answered the stop and left the group; not killed
    assert not torch.distributed.is_initialized()
    assert timed_shutdown(llm) < 1.0  # idempotent


@pytest.mark.timeout(120)
def test_shutdown_after_a_worker_was_killed_returns_at_once(model_dir):
    llm = LLM(str(model_dir), tensor_parallel_size=2, **ENGINE)
    worker = llm.engine.executor.workers[0].process
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10.0)
    assert timed_shutdown(llm) < 5.0
    assert not torch.distributed.is_initialized()


@pytest.mark.timeout(120)
def test_a_worker_that_does_not_answer_the_stop_is_killed(model_dir, monkeypatch):
    monkeypatch.setattr(executor_module, "STOP_TIMEOUT_S", 1.0)
    llm = LLM(str(model_dir), tensor_parallel_size=2, **ENGINE)
    worker = llm.engine.executor.workers[0].process
    os.kill(worker.pid, signal.SIGSTOP)
    assert timed_shutdown(llm) < 5.0
    worker.join(5.0)
    assert worker.exitcode == -signal.SIGKILL
    assert not torch.distributed.is_initialized()


@pytest.mark.timeout(120)
def test_ctrl_c_in_the_middle_of_a_step(model_dir, monkeypatch):
    llm = LLM(str(model_dir), tensor_parallel_size=2, **ENGINE)
    worker = llm.engine.executor.workers[0].process

    def interrupted(step):  # the worker got the step and waits in its first all-reduce
        raise KeyboardInterrupt

    monkeypatch.setattr(llm.engine.runner, "execute", interrupted)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPT, PARAMS, use_tqdm=False)
    assert time.monotonic() - start < 5.0
    worker.join(5.0)
    assert not worker.is_alive()
    assert not torch.distributed.is_initialized()
    assert timed_shutdown(llm) < 1.0


@pytest.mark.timeout(120)
def test_ctrl_c_while_rank0_waits_for_a_stuck_worker(model_dir, monkeypatch):
    # Python's KeyboardInterrupt, as in a terminal, even under a runner that ignores SIGINT
    monkeypatch.setattr(sigint_watch, "GRACE_S", 0.5)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        llm = LLM(str(model_dir), tensor_parallel_size=2, **ENGINE)
        worker = llm.engine.executor.workers[0].process
        os.kill(worker.pid, signal.SIGSTOP)  # alive, but never joins the step's all-reduce
        watch = llm.engine.executor._watch

        def ctrl_c_once_in_the_step() -> None:
            while watch.step is None:
                time.sleep(0.01)
            time.sleep(0.2)  # into the all-reduce the worker never joins
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=ctrl_c_once_in_the_step, daemon=True).start()
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):  # without the watch: the collective's timeout
            llm.generate(PROMPT, PARAMS, use_tqdm=False)
        assert time.monotonic() - start < 10.0
    finally:
        signal.signal(signal.SIGINT, previous)
    worker.join(5.0)
    assert worker.exitcode == -signal.SIGKILL
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="Ctrl-C|KeyboardInterrupt"):  # the engine stays dead
        llm.generate(PROMPT, PARAMS, use_tqdm=False)


def report_pending_sigint(conn) -> None:
    conn.recv()  # until the parent has sent the signal
    conn.send(signal.SIGINT in signal.sigpending())


@pytest.mark.timeout(60)
def test_a_ctrl_c_during_a_workers_start_waits_for_it_instead_of_killing_it():
    ctx = multiprocessing.get_context("fork")
    conn, child_conn = ctx.Pipe()
    with sigint_held_back():  # what the executor starts its workers in
        child = ctx.Process(target=report_pending_sigint, args=(child_conn,), daemon=True)
        child.start()
    try:
        os.kill(child.pid, signal.SIGINT)
        conn.send("sent")
        assert conn.poll(30) and conn.recv() is True  # held back: worker_main discards it
        child.join(10)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # lifted here


SCRIPT = """\
from tinypaged import LLM, SamplingParams
{guard}
llm = LLM({path!r}, tensor_parallel_size=2, **{engine!r})
print("WORKER", llm.engine.executor.workers[0].process.pid, flush=True)
params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
while True:
    print("TOKENS", llm.generate({prompt!r}, params, use_tqdm=False)[0].outputs[0].token_ids,
          flush=True)
    if {once}:
        break
"""


def write_script(tmp_path: Path, model_dir: Path, guarded: bool, once: bool) -> Path:
    body = SCRIPT.format(guard="", path=str(model_dir), engine=ENGINE, prompt=PROMPT, once=once)
    if guarded:
        head, rest = body.split("\n", 1)
        body = head + '\nif __name__ == "__main__":\n' + textwrap.indent(rest, "    ")
    script = tmp_path / "script.py"
    script.write_text(body)
    return script


# Runs the script as a terminal would, with Ctrl-C raising KeyboardInterrupt: a test runner that
# was started as a background job of a non-interactive shell (`bash ci &`) inherits SIGINT
# ignored, its children too, and a Python started that way never installs its KeyboardInterrupt
# handler: the script then ran on after the test's SIGINT (#15). SIG_DFL survives the exec.
AS_FROM_A_TERMINAL = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                      "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


def python(script: Path, method: str | None, **kw):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TINYPAGED_WORKER_MULTIPROC_METHOD", None)
    if method:
        env["TINYPAGED_WORKER_MULTIPROC_METHOD"] = method
    return subprocess.Popen([sys.executable, "-c", AS_FROM_A_TERMINAL, str(script)], env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


@pytest.mark.timeout(180)
def test_script_without_main_guard_runs_and_exits(model_dir, tmp_path):
    expected = LLM(str(model_dir), **ENGINE).generate(PROMPT, PARAMS, use_tqdm=False)
    proc = python(write_script(tmp_path, model_dir, guarded=False, once=True), None)
    out, err = proc.communicate(timeout=150)
    assert proc.returncode == 0, err
    lines = dict(line.split(" ", 1) for line in out.splitlines())
    assert lines["TOKENS"] == str(expected[0].outputs[0].token_ids)
    assert gone(int(lines["WORKER"]))  # the exiting interpreter stopped its worker


@pytest.mark.timeout(60)
def test_script_without_main_guard_under_spawn_fails_in_one_sentence(model_dir, tmp_path):
    script = write_script(tmp_path, model_dir, guarded=False, once=True)
    proc = python(script, "spawn")
    out, err = proc.communicate(timeout=50)
    assert proc.returncode == 1 and "WORKER" not in out
    last = err.strip().splitlines()[-1]
    assert "workers with 'spawn', which runs your script again: move line 3 of " in last
    assert f'{script} (and the code that uses the engine) under `if __name__ == "__main__":`' \
        in last
    assert "bootstrapping phase" not in err  # multiprocessing's own long text never shows


@pytest.mark.timeout(180)
@pytest.mark.parametrize("reaches", ["rank 0", "the process group"])  # the latter: a terminal's
def test_guarded_script_under_spawn_ends_soon_after_ctrl_c(model_dir, tmp_path, reaches):
    script = write_script(tmp_path, model_dir, guarded=True, once=False)
    proc = python(script, "spawn", start_new_session=True)  # its own group: only it and its worker
    try:
        worker = int(proc.stdout.readline().split()[1])
        assert proc.stdout.readline().startswith("TOKENS")
        if reaches == "rank 0":
            proc.send_signal(signal.SIGINT)
        else:  # the worker ignores it; rank 0 alone stops it
            os.killpg(proc.pid, signal.SIGINT)
        start = time.monotonic()
        assert proc.wait(timeout=30) == -signal.SIGINT  # KeyboardInterrupt, not a crash
        assert time.monotonic() - start < 10.0
        assert gone(worker)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.timeout(180)
def test_sigterm_of_serve_tp2_exits_at_once_and_stops_its_worker(model_dir):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tinypaged", "serve", str(model_dir), "-tp", "2", "--port",
         str(port), "--dtype", "float32", "--num-kv-blocks", "32", "--max-model-len", "64"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 150
        while True:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert len(children) == 1  # the worker, rank 1
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - start < 10.0
        assert gone(int(children[0]))
    finally:
        if proc.poll() is None:
            proc.kill()
