"""Experiment (issue 35): can a grammar process hide a step's accepts and mask fills from the
engine thread? The main thread runs W ms of Python a step (a stand-in for the engine's host
work) and then needs that step's grammar work done, for 128 matchers of the structured-output
benchmark's schema taking tokens it allows. Modes: inline (accept + fill on the main thread after
W), thread (a worker thread, as sampling/grammar_worker.py), process (a spawned process accepts
and fills into shared memory while the main thread runs W; a pipe carries the step number).

    python benchmarks/grammar_process.py [W_MS] [FILL_THREADS]
"""

import json
import multiprocessing as mp
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np

N, V, STEPS = 128, 49152, 60
W_ROWS = V // 32


def setup():
    import xgrammar as xgr
    from transformers import AutoTokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
    from benchmarks.structured_throughput import LONG
    from tinypaged.models.default_model import ensure_default_model

    tok = AutoTokenizer.from_pretrained(str(ensure_default_model()))
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V)
    g = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(LONG))
    return xgr, g


def make_tokens(xgr, g):
    """STEPS x N tokens that the grammar allows (random logits, argmax among allowed)."""
    import torch

    ms = [xgr.GrammarMatcher(g) for _ in range(N)]
    bm = torch.empty((N, W_ROWS), dtype=torch.int32)
    b = xgr.BatchGrammarMatcher(1)
    rng = np.random.default_rng(0)
    out = []
    for _s in range(STEPS + 2):
        b.batch_fill_next_token_bitmask(ms, bm)
        bits = (
            np.unpackbits(bm.numpy().view(np.uint8), bitorder="little")
            .reshape(N, -1)[:, :V]
            .astype(bool)
        )
        logits = rng.standard_normal((N, V)).astype(np.float32)
        toks = np.where(bits, logits, -np.inf).argmax(axis=1).tolist()
        for m, t in zip(ms, toks):
            assert m.accept_token(t)
        out.append(toks)
    return out


class Grammar:
    def __init__(self, xgr, g, threads):
        self.xgr = xgr
        self.ms = [xgr.GrammarMatcher(g) for _ in range(N)]
        self.raw = xgr.base._core.BatchGrammarMatcher
        self.b = xgr.BatchGrammarMatcher(threads)
        self.handles = [m._handle for m in self.ms]

    def step(self, toks, bm):
        self.raw.batch_accept_token(self.handles, toks, False)
        self.b.batch_fill_next_token_bitmask(self.ms, bm)


def child(conn, shm_name, tokens, threads):
    import torch

    xgr, g = setup()
    gr = Grammar(xgr, g, threads)
    shm = shared_memory.SharedMemory(name=shm_name)
    bm = torch.frombuffer(shm.buf, dtype=torch.int32, count=N * W_ROWS).view(N, W_ROWS)
    conn.send("ready")
    while True:
        s = conn.recv()
        if s is None:
            break
        gr.step(tokens[s], bm)
        conn.send(s)
    del bm
    shm.close()


def python_work(ms):
    end = time.perf_counter() + ms / 1e3
    x = 0
    while time.perf_counter() < end:
        x += 1
    return x


def main():
    import torch

    W = float(sys.argv[1]) if len(sys.argv) > 1 else 2.4
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    xgr, g = setup()
    tokens = make_tokens(xgr, g)
    # alone
    t0 = time.perf_counter()
    for _ in range(STEPS):
        python_work(W)
    alone = (time.perf_counter() - t0) / STEPS * 1e3
    # inline
    gr = Grammar(xgr, g, threads)
    bm = torch.empty((N, W_ROWS), dtype=torch.int32)
    t0 = time.perf_counter()
    for s in range(STEPS):
        python_work(W)
        gr.step(tokens[s], bm)
    inline = (time.perf_counter() - t0) / STEPS * 1e3
    # thread (the engine's grammar worker design)
    import queue
    import threading

    gr2 = Grammar(xgr, g, threads)
    bm2 = torch.empty((N, W_ROWS), dtype=torch.int32)
    q_in, q_out = queue.Queue(), queue.Queue()

    def worker():
        while (s := q_in.get()) is not None:
            gr2.step(tokens[s], bm2)
            q_out.put(s)

    th = threading.Thread(target=worker)
    th.start()
    t0 = time.perf_counter()
    for s in range(STEPS):
        q_in.put(s)
        python_work(W)
        assert q_out.get() == s
    thread = (time.perf_counter() - t0) / STEPS * 1e3
    q_in.put(None)
    th.join()
    # process
    shm = shared_memory.SharedMemory(create=True, size=N * W_ROWS * 4)
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=child, args=(b, shm.name, tokens, threads))
    p.start()
    assert a.recv() == "ready"
    t0 = time.perf_counter()
    waits = 0.0
    for s in range(STEPS):
        a.send(s)  # step s's tokens are known: the grammar process takes them
        python_work(W)  # the engine's host work meanwhile
        w0 = time.perf_counter()
        assert a.recv() == s
        waits += time.perf_counter() - w0
    proc = (time.perf_counter() - t0) / STEPS * 1e3
    a.send(None)
    p.join()
    shm.close()
    shm.unlink()
    print(
        f"W {W} ms of Python a step, {N} constrained rows, fill threads {threads}: "
        f"alone {alone:.2f} ms, inline {inline:.2f} (+{inline - alone:.2f}), "
        f"thread {thread:.2f} (+{thread - alone:.2f}), process {proc:.2f} "
        f"(+{proc - alone:.2f}, of which waiting {waits / STEPS * 1e3:.2f})"
    )


if __name__ == "__main__":
    main()
