"""The grammar process (sampling/grammar_process.py): matchers in a process of their own, each
step's accepts and fills one round trip. Checked call by call against matchers in this process
(masks, verdicts, compile errors, rows past the first shared buffer), then in the engine: the
same tokens as the worker thread's path, every matcher dropped once its request is gone, and a
process that dies failing only the constrained requests of its step."""

from __future__ import annotations

import gc
import glob
import json
import os
import random
import re
import tempfile

import jsonschema
import numpy as np
import pytest
import torch
from helpers.structured import SCHEMA, VOCAB, run_to_end
from transformers import AutoTokenizer

from tinypaged import LLM, SamplingParams, StructuredOutputsParams
from tinypaged.sampling.grammar_process import GrammarProcess
from tinypaged.sampling.grammar_worker import StopTokens, accept_and_fill
from tinypaged.sampling.structured_output import GrammarCompiler, MaskFiller

EOS = 2
WORDS = (VOCAB + 31) // 32
JSON = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
CHOICE = StructuredOutputsParams(choice=["red", "green"])
DIGITS = StructuredOutputsParams(regex=r"[0-9]{3}")
SOME_DIGITS = StructuredOutputsParams(regex=r"[0-9]{1,4}")  # complete, yet more may follow


def allowed_ids(row: torch.Tensor) -> list[int]:
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[:VOCAB]
    return np.flatnonzero(bits).tolist()


@pytest.fixture(scope="module")
def process(model_dir):
    proc = GrammarProcess(AutoTokenizer.from_pretrained(model_dir), VOCAB, [EOS])
    yield proc
    proc.close()


def test_process_calls_equal_matchers_here(model_dir, process):
    """102 matchers (more rows than the first shared buffer holds) walk random paths: each
    step's masks (`fill`, into given rows) and its verdicts and next masks (`step`) are those of
    matchers in this process taking the same tokens (accept_and_fill), through rejections,
    stop tokens and complete grammars. A schema that does not compile raises ValueError naming
    the field, every time it is asked for."""
    local = GrammarCompiler(AutoTokenizer.from_pretrained(model_dir), VOCAB, [EOS])
    kinds = [JSON, CHOICE, DIGITS, SOME_DIGITS, JSON, SOME_DIGITS] * 17
    remote = [m for k in kinds for m in process.matchers(k, 1)]
    here = [local.matchers(k, 1)[0] for k in kinds]
    filler, stop = MaskFiller(), StopTokens([EOS])
    rng = random.Random(0)
    active, seen = list(range(len(kinds))), set()
    want, got = (torch.zeros((len(kinds), WORDS), dtype=torch.int32) for _ in range(2))
    for step in range(200):
        if not active:
            break
        rows = rng.sample(range(len(kinds)), len(active))  # rows in another order
        process.fill([remote[i] for i in active], got, rows)
        filler.fill([here[i] for i in active], want, rows)
        assert torch.equal(got[rows], want[rows]), step
        tokens = []
        for r in rows:
            allowed = allowed_ids(want[r])
            if rng.random() < 0.05:  # a token the grammar does not allow here
                tokens.append(next(t for t in range(3, VOCAB) if t not in set(allowed)))
            elif EOS in allowed and rng.random() < 0.3:
                tokens.append(EOS)
            else:
                tokens.append(rng.choice([t for t in allowed if t != EOS] or [EOS]))
        verdicts = process.step([remote[i] for i in active], tokens, got)
        assert verdicts == accept_and_fill([here[i] for i in active], tokens, filler, want, stop)
        rejected, ended, live = verdicts
        assert torch.equal(got[: len(live)], want[: len(live)]), step
        stopped = {j for j, t in enumerate(tokens) if t == EOS}
        seen |= {"rejected"} if rejected else set()
        seen |= {"eos"} if stopped else set()
        seen |= {"complete"} if set(ended) - stopped else set()
        done = set(rejected) | set(ended) | stopped
        active = [i for j, i in enumerate(active) if j not in done]
    assert not active and {"rejected", "eos", "complete"} <= seen
    bad = StructuredOutputsParams(regex="[0-9")
    for _ in range(2):
        with pytest.raises(ValueError, match="structured_outputs.regex"):
            process.matchers(bad, 1)
    assert not glob.glob(os.path.join(tempfile.gettempdir(), "tinypaged-grammar-*")) and not \
        glob.glob("/dev/shm/tinypaged-grammar-*")  # the shared rows' files: unlinked once mapped


def engine_with_process(model_dir, monkeypatch, **kwargs):
    monkeypatch.setenv("TINYPAGED_GRAMMAR_PROCESS", "1")
    llm = LLM(str(model_dir), num_kv_blocks=64, block_size=8, **kwargs)
    assert isinstance(llm.engine._get_grammar_compiler(), GrammarProcess)
    return llm


def test_outputs_equal_the_thread_path(model_dir, monkeypatch):
    """Through the process, each request's tokens are those of the worker thread's path (the
    matchers in the engine process), with n > 1, seeds, plain rows beside, async scheduling."""
    params = [
        SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=60, structured_outputs=JSON),
        SamplingParams(temperature=0, max_tokens=60, structured_outputs=JSON),
        SamplingParams(temperature=0.8, seed=4, max_tokens=8, structured_outputs=DIGITS),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, structured_outputs=CHOICE),
        SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True),
    ]
    prompts = ["a", "bc d", "num", "pick", "hello there"]
    runs = []
    for where in ("1", "0"):
        monkeypatch.setenv("TINYPAGED_GRAMMAR_PROCESS", where)
        llm = LLM(str(model_dir), num_kv_blocks=64, block_size=8, async_scheduling=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([[c.token_ids for c in o.outputs] for o in outs])
        if where == "1":
            texts = [[c.text for c in o.outputs] for o in outs]
            assert isinstance(llm.engine._get_grammar_compiler(), GrammarProcess)
    assert runs[0] == runs[1]
    for text in texts[0] + texts[1]:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert re.fullmatch(r"[0-9]{3}", texts[2][0]) and texts[3][0] in ("red", "green")


def test_finished_and_aborted_requests_drop_their_matchers(model_dir, monkeypatch):
    """Requests that finish (length, eos, a complete grammar) and one aborted while its steps
    are in flight: once they are gone, the process holds none of their matchers."""
    llm = engine_with_process(model_dir, monkeypatch, async_scheduling=True)
    engine, process = llm.engine, llm.engine._get_grammar_compiler()
    engine.add_request("short", "a", SamplingParams(temperature=0, max_tokens=5,
                                                    structured_outputs=JSON))
    engine.add_request("json", "b", SamplingParams(temperature=0, max_tokens=60,
                                                   structured_outputs=JSON))
    engine.add_request("aborted", "c", SamplingParams(n=2, temperature=1.0, seed=2,
                                                      max_tokens=60, structured_outputs=JSON))
    engine.add_request("digits", "d", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                     structured_outputs=DIGITS))
    assert process.num_matchers() == 5
    early = {o.request_id: o for _ in range(4) for o in engine.step() if o.finished}
    engine.abort_request("aborted")
    finished, errors = run_to_end(engine)
    finished.update(early)
    assert set(finished) == {"short", "json", "digits"} and not errors
    jsonschema.validate(json.loads(finished["json"].outputs[0].text), SCHEMA)
    assert re.fullmatch(r"[0-9]{3}", finished["digits"].outputs[0].text)
    del finished, early
    gc.collect()
    assert process.num_matchers() == 0


def test_a_dead_process_fails_only_its_requests(model_dir, monkeypatch):
    """The grammar process is killed mid-run: the constrained request fails with an error that
    says so, the plain request beside it finishes, and the next constrained request runs in a
    new process."""
    llm = engine_with_process(model_dir, monkeypatch, async_scheduling=True)
    engine, process = llm.engine, llm.engine._get_grammar_compiler()
    engine.add_request("json", "a", SamplingParams(temperature=0, max_tokens=60,
                                                   structured_outputs=JSON))
    engine.add_request("plain", "b", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    engine.step()
    engine.step()
    process._proc.kill()
    finished, errors = run_to_end(engine)
    assert list(errors) == ["json"] and "grammar process" in str(errors["json"])
    assert len(finished["plain"].outputs[0].token_ids) == 12
    out = llm.generate(["again"], SamplingParams(temperature=0, max_tokens=60,
                                                 structured_outputs=JSON), use_tqdm=False)
    jsonschema.validate(json.loads(out[0].outputs[0].text), SCHEMA)
    restarted = engine._get_grammar_compiler()
    assert restarted is not process and restarted.alive
    engine.shutdown()
    assert restarted._proc.poll() == 0  # asked to end, it did
