"""The grammar worker (sampling/grammar_worker.py): each step's matchers take their tokens in one
batched call and fill their next masks on a thread of their own. Checked against one matcher at a
time (verdicts and masks), then in the engine: the same outputs as the per-row path, the matchers'
state after aborts and finishes, and a rejection or a worker failure ending only its requests."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest
import torch
from helpers.structured import SCHEMA, VOCAB, run_to_end

from tinypaged import LLM, SamplingParams, StructuredOutputsParams
from tinypaged.sampling import grammar_worker
from tinypaged.sampling.grammar_worker import GrammarWorker
from tinypaged.sampling.structured_output import grammar_only_allows_stop

EOS = 2
JSON = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
CHOICE = StructuredOutputsParams(choice=["red", "green"])
DIGITS = StructuredOutputsParams(regex=r"[0-9]{3}")
SOME_DIGITS = StructuredOutputsParams(regex=r"[0-9]{1,4}")  # complete, yet more may follow


def gen(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def allowed_ids(row: torch.Tensor) -> list[int]:
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[:VOCAB]
    return np.flatnonzero(bits).tolist()


class Seq:  # what the worker reads of a Sequence
    def __init__(self, seq_id: int) -> None:
        self.seq_id, self.finish_reason = seq_id, None


class Tokens:  # what the worker reads of SampledTokens
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def tolist(self) -> list[int]:
        return list(self.ids)


def test_worker_matches_one_matcher_at_a_time(llm):
    """Random walks through four grammars, six matchers: every step the worker's
    matchers take the step's tokens in one call, reference matchers one at a time. The verdicts
    (rejected; ended: a stop token taken, or only a stop token allowed next) and the next masks
    agree; a rejected token leaves its matcher where it was, and the walks reach every kind of
    end (a stop token taken, a complete grammar)."""
    compiler = llm.engine._get_grammar_compiler()
    kinds = [JSON, CHOICE, DIGITS, SOME_DIGITS, JSON, SOME_DIGITS]
    live = [compiler.matcher(compiler.compile(k)) for k in kinds]
    ref = [compiler.matcher(compiler.compile(k)) for k in kinds]
    worker = GrammarWorker(VOCAB, [EOS], torch.device("cpu"))
    seqs = [Seq(100 + i) for i in range(len(kinds))]
    rng = random.Random(0)
    mask = torch.empty((1, (VOCAB + 31) // 32), dtype=torch.int32)
    active, seen, advance = list(range(len(kinds))), set(), None
    for step in range(60):
        if not active:
            break
        tokens = [0] * len(kinds)
        for i in active:
            ref[i].fill_next_token_bitmask(mask, 0)
            allowed = allowed_ids(mask[0])
            if advance is not None:  # the worker's next mask is the reference's
                assert allowed_ids(advance.bitmask[advance.rows[id(live[i])]]) == allowed
            if step == 3 and i == 0:  # a token the grammar does not allow here
                tokens[i] = next(t for t in range(VOCAB) if t not in set(allowed))
            elif EOS in allowed and rng.random() < 0.5:
                tokens[i] = EOS
            else:
                tokens[i] = rng.choice([t for t in allowed if t != EOS] or [EOS])
        advance = worker.advance(seqs, active, [live[i] for i in active], Tokens(tokens))
        for i in list(active):
            rejected = not ref[i].accept_token(tokens[i])
            ended = not rejected and (ref[i].is_terminated() or grammar_only_allows_stop(
                ref[i], VOCAB, [EOS]))
            assert advance.verdict(seqs[i].seq_id, tokens[i]) == (rejected, ended), (step, i)
            seen.add("rejected" if rejected else "eos" if tokens[i] == EOS else
                     "complete" if ended else "")
            if ended:
                active.remove(i)
    assert not active and {"rejected", "eos", "complete"} <= seen


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_outputs_equal_the_per_row_path(model_dir, async_scheduling):
    """Through the worker, every constrained output parses or matches, and each request's
    tokens are those of the path without it (one matcher at a time on the engine thread)."""
    params = [
        SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=60, structured_outputs=JSON),
        SamplingParams(temperature=0, max_tokens=60, structured_outputs=JSON),
        SamplingParams(temperature=0.8, seed=4, max_tokens=8, structured_outputs=DIGITS),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, structured_outputs=CHOICE),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True),
    ]
    prompts = ["a", "bc d", "num", "pick", "x y", "hello there"]
    runs = []
    for use_worker in (True, False):
        llm = LLM(str(model_dir), num_kv_blocks=64, block_size=8,
                  async_scheduling=async_scheduling)
        llm.engine._get_grammar_compiler()
        worker, advances = llm.engine.mask_builder.worker, []
        if use_worker:
            worker.advance = lambda *a, f=worker.advance, n=advances: n.append(1) or f(*a)
        else:
            llm.engine.mask_builder.worker = None
        outs = gen(llm, prompts, params)
        runs.append([[c.token_ids for c in o.outputs] for o in outs])
        texts = [[c.text for c in o.outputs] for o in outs]
        assert len(advances) > 20 or not use_worker
    assert runs[0] == runs[1]
    for text in texts[0] + texts[1]:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert re.fullmatch(r"[0-9]{3}", texts[2][0]) and texts[3][0] in ("red", "green")


def replayed(compiler, params: StructuredOutputsParams, token_ids: list[int]):
    m = compiler.matcher(compiler.compile(params))
    assert all(m.accept_token(t) for t in token_ids)
    return m


def same_state(compiler, live, params, token_ids) -> bool:
    """`live` has taken exactly `token_ids`: the same next mask as a matcher replaying them."""
    ref = replayed(compiler, params, token_ids)
    if ref.is_terminated() or live.is_terminated():
        return ref.is_terminated() == live.is_terminated()
    a, b = (torch.zeros((1, (VOCAB + 31) // 32), dtype=torch.int32) for _ in range(2))
    live.fill_next_token_bitmask(a, 0)
    ref.fill_next_token_bitmask(b, 0)
    return torch.equal(a, b)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_matchers_after_aborts_and_finishes(model_dir, async_scheduling):
    """A request aborted while its steps are in flight, others ending by length, by eos or by a
    complete grammar mid-batch: every remaining matcher has taken exactly its sequence's tokens
    (no token of a wasted row, none twice), and the requests beside the abort finish valid."""
    llm = LLM(str(model_dir), num_kv_blocks=64, block_size=8, async_scheduling=async_scheduling)
    engine = llm.engine
    compiler = engine._get_grammar_compiler()
    reqs = {
        "short": (JSON, SamplingParams(temperature=0, max_tokens=5, structured_outputs=JSON)),
        "json": (JSON, SamplingParams(temperature=0, max_tokens=60, structured_outputs=JSON)),
        "aborted": (JSON, SamplingParams(temperature=0, max_tokens=60, structured_outputs=JSON)),
        "digits": (DIGITS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                          structured_outputs=DIGITS)),
        "choice": (CHOICE, SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=8,
                                          structured_outputs=CHOICE)),
    }
    matchers = {}
    for i, (rid, (_, params)) in enumerate(reqs.items()):
        engine.add_request(rid, f"prompt {i}", params)
        matchers[rid] = engine.requests[rid].constraints.matchers
    engine.add_request("plain", "p", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    worker, handed = engine.mask_builder.worker, []
    advance = worker.advance

    def checked_advance(seqs, positions, matchers, tokens):
        handed.extend(seqs[p].finish_reason for p in positions)  # a finished row's token drops
        return advance(seqs, positions, matchers, tokens)

    worker.advance = checked_advance
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        if steps == 4:
            engine.abort_request("aborted")
    assert set(finished) == set(reqs) - {"aborted"} | {"plain"}
    assert len(handed) > 20 and set(handed) == {None}
    assert engine.pop_request_errors() == []
    assert finished["short"].outputs[0].finish_reason == "length"
    for rid, out in finished.items():
        if rid == "plain":
            continue
        for c in out.outputs:
            assert same_state(compiler, matchers[rid][c.index], reqs[rid][0], c.token_ids), rid
    jsonschema.validate(json.loads(finished["json"].outputs[0].text), SCHEMA)
    assert re.fullmatch(r"[0-9]{3}", finished["digits"].outputs[0].text)
    assert all(c.text in ("red", "green") for c in finished["choice"].outputs)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_rejection_fails_only_its_request(model_dir, async_scheduling):
    """One constrained request samples without its mask, so greedy picks a token its grammar
    rejects: it alone fails; the constrained and plain requests beside it finish."""
    llm = LLM(str(model_dir), num_kv_blocks=64, block_size=8, async_scheduling=async_scheduling)
    engine = llm.engine
    engine.add_request("bad", "a", SamplingParams(temperature=0, max_tokens=20,
                                                  structured_outputs=JSON))
    engine.add_request("good", "b", SamplingParams(temperature=0, max_tokens=60,
                                                   structured_outputs=JSON))
    engine.add_request("plain", "c", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    bad, build = engine.requests["bad"].constraints, engine.mask_builder.build
    engine.mask_builder.build = lambda rows: build([r for r in rows if r[1] is not bad])
    finished, errors = run_to_end(engine)
    assert list(errors) == ["bad"] and "grammar rejected" in str(errors["bad"])
    jsonschema.validate(json.loads(finished["good"].outputs[0].text), SCHEMA)
    assert len(finished["plain"].outputs[0].token_ids) == 8


def test_a_worker_failure_fails_the_constrained_requests_of_its_step(model_dir, monkeypatch):
    """An exception on the worker thread surfaces at the step's stop checks: the constrained
    requests of that step fail with it, the plain request finishes, the engine goes on."""
    llm = LLM(str(model_dir), num_kv_blocks=64, block_size=8, async_scheduling=True)
    engine = llm.engine
    calls = []

    def failing(matchers, tokens, *pool):
        calls.append(len(matchers))
        raise RuntimeError("boom")

    monkeypatch.setattr(grammar_worker, "batch_accept", failing)
    engine.add_request("json", "a", SamplingParams(temperature=0, max_tokens=20,
                                                   structured_outputs=JSON))
    engine.add_request("plain", "b", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    finished, errors = run_to_end(engine)
    assert calls and list(errors) == ["json"] and "boom" in repr(errors["json"].__cause__)
    assert len(finished["plain"].outputs[0].token_ids) == 8
    monkeypatch.undo()
    out = gen(llm, ["again"], SamplingParams(temperature=0, max_tokens=60,
                                             structured_outputs=JSON))[0].outputs[0]
    jsonschema.validate(json.loads(out.text), SCHEMA)


def test_accepts_in_chunks_equal_one_matcher_at_a_time(llm, monkeypatch):
    """batch_accept with a pool: the matchers are cut into chunks taken on several threads; the
    rejected indices (sorted, over the whole batch) and every matcher's next mask are those of
    one matcher taking its token at a time."""
    from concurrent.futures import ThreadPoolExecutor

    from tinypaged.sampling import structured_output as so

    compiler = llm.engine._get_grammar_compiler()
    kinds = [JSON, SOME_DIGITS, CHOICE] * 34  # 102 matchers: chunks of 26 on 4 threads
    live = [compiler.matcher(compiler.compile(k)) for k in kinds]
    ref = [compiler.matcher(compiler.compile(k)) for k in kinds]
    chunks = []
    accept_chunk = so._accept_chunk

    def recording(matchers, tokens, offset):
        chunks.append((offset, len(matchers)))
        return accept_chunk(matchers, tokens, offset)

    monkeypatch.setattr(so, "_accept_chunk", recording)
    monkeypatch.setattr(so, "MIN_ROWS_PER_CHUNK", 16)
    rng = random.Random(1)
    got, want = (torch.empty((len(kinds), (VOCAB + 31) // 32), dtype=torch.int32)
                 for _ in range(2))
    filler = so.MaskFiller()
    seen_rejected = False
    with ThreadPoolExecutor(3) as pool:
        for step in range(6):
            for i, m in enumerate(ref):
                m.fill_next_token_bitmask(want, i)
            filler.fill(live, got)
            assert torch.equal(got, want), step
            tokens = []
            for i in range(len(kinds)):
                allowed = allowed_ids(want[i])
                others = [t for t in allowed if t != EOS]
                if not others or rng.random() < 0.1:  # a token the grammar does not allow
                    tokens.append(next(t for t in range(3, VOCAB) if t not in set(allowed)))
                else:
                    tokens.append(rng.choice(others))
            chunks.clear()
            rejected = so.batch_accept(live, tokens, pool, 4)
            assert rejected == [i for i, m in enumerate(ref) if not m.accept_token(tokens[i])]
            assert sorted(chunks) == [(0, 26), (26, 26), (52, 26), (78, 24)]
            seen_rejected |= bool(rejected)
    assert seen_rejected


def test_worker_rows_are_the_steps_mask_as_they_stand(llm):
    """When the worker's matchers are the step's masked rows in order and nothing else masks
    them, LogitsMaskBuilder.build sends the worker's bitmask itself (no host copy); otherwise
    (another order, allowed_token_ids on a row) it builds its own rows. Either way every row is
    what its matcher fills alone (and'ed with allowed_token_ids)."""
    from tinypaged.sampling.logits_processors import LogitsConstraints, LogitsMaskBuilder

    compiler = llm.engine._get_grammar_compiler()
    kinds = [JSON, DIGITS, CHOICE, SOME_DIGITS] * 3
    live = [compiler.matcher(compiler.compile(k)) for k in kinds]
    ref = [compiler.matcher(compiler.compile(k)) for k in kinds]
    worker = GrammarWorker(VOCAB, [EOS], torch.device("cpu"))
    builder = LogitsMaskBuilder(VOCAB, torch.device("cpu"))
    builder.worker = worker
    mask = torch.empty((1, (VOCAB + 31) // 32), dtype=torch.int32)
    tokens = []
    for m in ref:
        m.fill_next_token_bitmask(mask, 0)
        tokens.append(min(t for t in allowed_ids(mask[0]) if t != EOS))
        assert m.accept_token(tokens[-1])
    seqs = [Seq(i) for i in range(len(kinds))]
    advance = worker.advance(seqs, list(range(len(kinds))), live, Tokens(tokens))
    constraints = [LogitsConstraints(matchers=[m]) for m in live]

    def expected(i: int) -> list[int]:
        ref[i].fill_next_token_bitmask(mask, 0)
        return allowed_ids(mask[0])

    rows = [(2 * i, c, 0, ()) for i, c in enumerate(constraints)]
    masks = builder.build(rows)
    assert masks.bitmask.data_ptr() == advance.wait().bitmask.data_ptr()  # as they stand
    assert masks.bitmask_rows.tolist() == [2 * i for i in range(len(kinds))]
    assert [allowed_ids(r) for r in masks.bitmask] == [expected(i) for i in range(len(kinds))]

    masks = builder.build(rows[::-1])  # another order: copied row by row
    assert masks.bitmask.data_ptr() != advance.bitmask.data_ptr()
    assert [allowed_ids(r) for r in masks.bitmask] == [
        expected(i) for i in reversed(range(len(kinds)))]

    allowed = expected(0)[:3] + [7]
    constraints[0].allowed_words = np.zeros((VOCAB + 31) // 32, dtype=np.uint32)
    for t in allowed:
        constraints[0].allowed_words[t >> 5] |= np.uint32(1 << (t & 31))
    masks = builder.build(rows)  # a row with allowed_token_ids: its own rows
    assert masks.bitmask.data_ptr() != advance.bitmask.data_ptr()
    assert allowed_ids(masks.bitmask[0]) == sorted(set(expected(0)) & set(allowed))
    assert [allowed_ids(r) for r in masks.bitmask[1:]] == [
        expected(i) for i in range(1, len(kinds))]
