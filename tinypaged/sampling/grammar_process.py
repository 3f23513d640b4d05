"""Structured output's grammar work in a process of its own: the matchers live there, and each
step's accepts and mask fills run there, on other cores, while the engine process runs Python.

    engine process                                  grammar process (python -m this module)
    GrammarProcess.matchers(params, n)   compile -> a CompiledGrammar (cached); n GrammarMatchers
        -> n RemoteMatchers (keys)                  made at the next message, kept by key
    LogitsMaskBuilder: .fill(matchers, rows) fill -> masks into the shared fill rows
    GrammarWorker's thread: .step(...)      step -> accept_and_fill into the shared step rows;
        -> (rejected, ended, live)                  the verdicts back through the socket

Why a process: xgrammar's calls do not run beside the engine thread's Python (measured:
benchmarks/RESULTS.md, Structured output), so on a step that the host bounds a thread adds every
constrained row's accept and fill to the step. In another process they cost the engine one
socket round trip a step and a copy of the mask rows.

One message a call, (new matchers, op, args, freed keys), and one reply, ("ok", value) or
("error", text). The masks do not go through the socket: they are int32 [rows, W] files under
/dev/shm that both processes map (unlinked once both have them, so nothing is left behind). A
RemoteMatcher is only a key: `step` and `fill` (and GrammarAdvance's verdicts) are all the
engine asks of it, so speculative decoding, which walks its matchers token by token, keeps them
in the engine process (engine.py builds a GrammarCompiler there).

A request whose schema does not compile gets the ValueError at `matchers` (a 400 on the server).
If the process dies, the calls raise RuntimeError: the constrained requests of that step fail,
and the engine starts a new process for the next constrained request.
"""

from __future__ import annotations

import itertools
import mmap
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import weakref
from collections import OrderedDict, deque
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from tinypaged import envs
from tinypaged.host.packages import require
from tinypaged.sampling.grammar_worker import GrammarWorker, LocalGrammar
from tinypaged.sampling.structured_output import GrammarCompiler, StructuredOutputsParams

_START_TIMEOUT_S = 300.0  # importing torch and xgrammar and reading the vocabulary


def start_grammar(tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                  device: torch.device, builder: Any, speculative: bool) -> Any:
    """The engine's grammar compiler for its `tokenizer` (tokenizer/), with `builder`'s (a
    LogitsMaskBuilder) worker and filler set to match: a GrammarProcess when
    TINYPAGED_GRAMMAR_PROCESS says so (auto: on a GPU, where the host bounds the step) and
    nothing speculates, else a GrammarCompiler here, with a worker thread unless speculative
    decoding walks the matchers itself (spec_decode/)."""
    hf_tokenizer = getattr(tokenizer, "hf", None)
    if hf_tokenizer is None:
        raise ValueError(
            "structured_outputs needs a Hugging Face tokenizer; this model's tokenizer "
            f"({type(tokenizer).__name__}) has none")
    where = envs.TINYPAGED_GRAMMAR_PROCESS
    remote = not speculative and (where == "1" or where == "auto" and device.type == "cuda")
    if remote:
        compiler = GrammarProcess(hf_tokenizer, vocab_size, stop_token_ids)
        builder.filler = compiler
    else:
        compiler = GrammarCompiler(hf_tokenizer, vocab_size, stop_token_ids)
        builder.filler = None
    builder.worker = None if speculative else GrammarWorker(
        vocab_size, stop_token_ids, device, backend=compiler if remote else None)
    return compiler


class RemoteMatcher:
    """A grammar matcher that lives in the grammar process; `key` names it there."""

    __slots__ = ("key", "__weakref__")

    def __init__(self, key: int) -> None:
        self.key = key

    def __repr__(self) -> str:
        return f"RemoteMatcher({self.key})"


class SharedRows:
    """An int32 [rows, width] array in a file that two processes map (`tensor`); `path` is the
    file until `unlink` (the mappings stay)."""

    def __init__(self, rows: int, width: int, path: str | None = None) -> None:
        size = rows * width * 4
        if path is None:
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            fd, path = tempfile.mkstemp(prefix="tinypaged-grammar-", dir=shm)
            os.ftruncate(fd, size)
        else:
            fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.path, self.rows = path, rows
        self.tensor = torch.frombuffer(self._map, dtype=torch.int32).view(rows, width)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class GrammarProcess:
    """The engine's side of the grammar process: GrammarCompiler's `matchers`, MaskFiller's
    `fill` and LocalGrammar's `step`, each one round trip. Thread-safe: the worker thread's
    steps and the engine thread's fills and compiles take turns on the socket.

    hf_tokenizer: a transformers tokenizer; vocab_size: the logits' width; stop_token_ids: the
    ids that end a sequence (allowed once a grammar is complete)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        xgr = require("xgrammar")
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._width = (vocab_size + 31) // 32
        ours, theirs = socket.socketpair()
        root = str(Path(__file__).resolve().parents[2])  # this tinypaged, wherever it is
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH")) if p))
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tinypaged.sampling.grammar_process", str(theirs.fileno())],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._finalizer = weakref.finalize(self, _stop, self._proc, self._conn)
        self._lock = threading.Lock()
        self._news: deque = deque()  # (params, keys): matchers to make at the next message
        self._freed: deque = deque()  # keys of collected RemoteMatchers, to drop there
        self._keys = itertools.count()
        self._valid: OrderedDict = OrderedDict()  # cache keys that compiled there
        self._rows: dict[str, SharedRows] = {}  # "step", "fill"
        self.alive = True
        # While the process imports torch and xgrammar: the vocabulary, read here (the process
        # may not have the tokenizer's files or its Python classes)
        info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids)
        with self._lock:
            self._conn.send((self.stop_token_ids, vocab_size, info.serialize_json()))
            if not self._conn.poll(_START_TIMEOUT_S):
                self.close()
                raise RuntimeError("the grammar process did not start")
        self._reply()

    # ------------------------------------------------------------------ what the engine calls

    def matchers(self, params: StructuredOutputsParams, n: int) -> list[RemoteMatcher]:
        """n fresh matchers of `params`' grammar. Raises ValueError naming the field when it
        does not compile (one round trip the first time a grammar is seen; none after)."""
        key = params.cache_key()
        if key in self._valid:
            self._valid.move_to_end(key)
        else:
            error = self._call("compile", params)
            if error is not None:
                raise ValueError(error)
            self._valid[key] = None
            if len(self._valid) > 1024:
                self._valid.popitem(last=False)
        matchers = [RemoteMatcher(next(self._keys)) for _ in range(n)]
        for m in matchers:
            weakref.finalize(m, self._freed.append, m.key)
        self._news.append((params, [m.key for m in matchers]))
        return matchers

    def fill(self, matchers: list[RemoteMatcher], bitmask: torch.Tensor,
             rows: list[int] | None = None) -> None:
        """Matcher i's next mask into row rows[i] of `bitmask` (int32 [R, W], host); row i
        without `rows` (MaskFiller.fill)."""
        shared = self._shared("fill", len(matchers))
        self._call("fill", [m.key for m in matchers])
        src = shared.tensor[: len(matchers)]
        if rows is None:
            bitmask[: len(matchers)].copy_(src)
        else:
            bitmask[rows] = src

    def step(self, matchers: list[RemoteMatcher], tokens: list[int],
             bitmask: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
        """grammar_worker.accept_and_fill, run there; the live rows are copied into
        `bitmask`."""
        shared = self._shared("step", len(matchers))
        rejected, ended, live = self._call("step", [m.key for m in matchers], tokens)
        if live:
            bitmask[: len(live)].copy_(shared.tensor[: len(live)])
        return rejected, ended, live

    def num_matchers(self) -> int:
        """How many matchers the process holds (a collected RemoteMatcher's goes with the next
        call)."""
        return self._call("count")

    def close(self) -> None:
        """End the process (also at garbage collection and at exit)."""
        self.alive = False
        self._finalizer()

    # ------------------------------------------------------------------ the socket

    def _shared(self, name: str, rows: int) -> SharedRows:
        """The shared `name` rows, at least `rows` of them (a bigger file when they grow)."""
        shared = self._rows.get(name)
        if shared is None or shared.rows < rows:
            shared = SharedRows(max(rows, 64, 2 * shared.rows if shared else 0), self._width)
            try:
                self._call("map", name, shared.path, shared.rows)
            finally:
                shared.unlink()
            self._rows[name] = shared
        return shared

    def _call(self, op: str, *args: Any) -> Any:
        with self._lock:
            news = [self._news.popleft() for _ in range(len(self._news))]
            freed = [self._freed.popleft() for _ in range(len(self._freed))]
            try:
                self._conn.send((news, op, args, freed))
            except OSError as exc:
                self._died(exc)
            return self._reply()

    def _reply(self) -> Any:
        try:
            status, value = self._conn.recv()
        except (EOFError, OSError) as exc:
            self._died(exc)
        if status != "ok":
            raise RuntimeError(f"the grammar process failed: {value}")
        return value

    def _died(self, exc: BaseException) -> None:
        self.alive = False
        raise RuntimeError(
            f"the grammar process exited (exit code {self._proc.poll()})") from exc


def _stop(proc: subprocess.Popen, conn: Connection) -> None:
    try:
        conn.send(([], "exit", (), []))
    except OSError:
        pass
    conn.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------------- the grammar process


def serve(conn: Connection) -> None:
    """The grammar process: answer the engine's calls until it closes the socket."""
    stop_token_ids, vocab_size, info_json = conn.recv()
    try:
        xgr = require("xgrammar")
        info = xgr.TokenizerInfo.deserialize_json(info_json)
        compiler = GrammarCompiler(info, vocab_size, stop_token_ids)
        grammar = LocalGrammar(stop_token_ids)
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ok", None))
    width = (vocab_size + 31) // 32
    matchers: dict[int, Any] = {}
    shared: dict[str, SharedRows] = {}

    def compile_(params: StructuredOutputsParams) -> str | None:
        try:
            compiler.compile(params)
        except ValueError as exc:
            return str(exc)
        return None

    def map_(name: str, path: str, rows: int) -> None:
        shared[name] = SharedRows(rows, width, path)

    def fill(keys: list[int]) -> None:
        grammar.filler.fill([matchers[k] for k in keys], shared["fill"].tensor)

    def step(keys: list[int], tokens: list[int]) -> tuple[list[int], list[int], list[int]]:
        return grammar.step([matchers[k] for k in keys], tokens, shared["step"].tensor)

    ops = {"compile": compile_, "map": map_, "fill": fill, "step": step,
           "count": lambda: len(matchers)}
    while True:
        try:
            news, op, args, freed = conn.recv()
        except EOFError:
            return
        if op == "exit":
            return
        try:
            for params, keys in news:
                compiled = compiler.compile(params)
                matchers.update((k, compiler.matcher(compiled)) for k in keys)
            for k in freed:  # nothing refers to them any more: the op cannot use them
                matchers.pop(k, None)
            reply = ("ok", ops[op](*args))
        except Exception as exc:
            reply = ("error", f"{type(exc).__name__}: {exc}")
        conn.send(reply)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when this process ends
    serve(Connection(int(sys.argv[1])))
