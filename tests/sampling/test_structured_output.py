"""Structured output and the logits constraints (allowed_token_ids, bad_words, logit_bias):
parameter validation, grammar compile cache and errors, the step's packed bitmask, and the
engine end to end on a tiny random Llama that speaks the default model's 49,152-token vocabulary
(random weights, so every valid output comes from the grammar, not from the model)."""

from __future__ import annotations

import json
import re
import sys

import jsonschema
import numpy as np
import pytest
import torch
from helpers.models import count_preemptions, single_thread, tiny_hf_model  # noqa: F401
from helpers.structured import SCHEMA, VOCAB, run_to_end, save_tiny_with_smollm2_vocab  # noqa: F401

from tinypaged import LLM, SamplingParams, StructuredOutputsParams
from tinypaged.sampling.logits_processors import LogitsConstraints, LogitsMaskBuilder

JSON = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)


@pytest.fixture(scope="module")
def compiler(llm):
    return llm.engine._get_grammar_compiler()


def gen(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


# ------------------------------------------------------------------ parameters


@pytest.mark.parametrize("kwargs, match", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"json": "{not json"}, "json is not valid JSON"),
    ({"json": [1, 2]}, "JSON schema object"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"choice": ["a", 3]}, "choice must be"),
    ({"regex": 5}, "regex must be"),
    ({"json_object": "yes"}, "json_object"),
])
def test_structured_outputs_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**kwargs)


def test_params_and_cache_key():
    a = StructuredOutputsParams(json=json.dumps({"b": 1, "type": "object"}))
    b = StructuredOutputsParams(json={"type": "object", "b": 1})
    assert a.json == b.json and a.cache_key() == b.cache_key() and a.kind == "json"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    p = SamplingParams(logit_bias={5: 300, 6: -1e9, 7: 1.5})
    assert p.logit_bias == {5: 100.0, 6: -100.0, 7: 1.5}
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})


def test_compile_cache_and_errors(compiler):
    before = compiler.num_compiles
    compiler.compile(StructuredOutputsParams(regex=r"[ab]{2}\d"))
    compiler.compile(StructuredOutputsParams(regex=r"[ab]{2}\d"))
    assert compiler.num_compiles == before + 1
    for kwargs, field in [
        ({"json": {"type": "objectx"}}, "structured_outputs.json: .*objectx"),
        ({"regex": "a(b"}, "structured_outputs.regex: .*parenthesis"),
        ({"grammar": 'root ::= "a" | missing'}, "structured_outputs.grammar: .*missing"),
    ]:
        with pytest.raises(ValueError, match=field):
            compiler.compile(StructuredOutputsParams(**kwargs))


def test_constraints_validated_against_the_vocab(llm):
    for field, value, bad in [
        ("allowed_token_ids", [1, VOCAB], VOCAB), ("logit_bias", {VOCAB + 3: 1.0}, VOCAB + 3)
    ]:
        with pytest.raises(ValueError, match=f"{field} holds token id {bad}, outside"):
            llm.engine.add_request("bad", "hi", SamplingParams(**{field: value}))
    assert not llm.engine.has_unfinished_requests()


# ------------------------------------------------------------------ the step's masks


def allowed_ids(bitmask_row: torch.Tensor) -> set[int]:
    bits = np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little")[:VOCAB]
    return set(np.flatnonzero(bits).tolist())


def test_bad_words_semantics(llm):
    tok = llm.engine.tokenizer
    c = LogitsConstraints.build(SamplingParams(bad_words=["hello world", "Paris"]), VOCAB, tok,
                                lambda: None)
    two = tok.encode("hello world", add_special_tokens=False)
    assert len(two) == 2 and two in c.bad_words_ids
    assert tok.encode(" Paris", add_special_tokens=False) in c.bad_words_ids
    paris = tok.encode("Paris", add_special_tokens=False)
    # One-token words are always banned; the last token of a longer word only after its prefix.
    assert paris[-1] in c.banned_tokens([5, 6])
    assert two[1] not in c.banned_tokens([5, 6])
    assert two[1] in c.banned_tokens([5, two[0]])


def test_json_object_starts_with_a_brace(llm, compiler):
    tok = llm.engine.tokenizer
    c = LogitsConstraints.build(
        SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True)), VOCAB, tok,
        lambda: compiler,
    )
    masks = LogitsMaskBuilder(VOCAB, torch.device("cpu")).build([(0, c, 0, [])])
    first = allowed_ids(masks.bitmask[0])
    texts = {tok.decode([t]) for t in first}
    assert "{" in texts and all(t.lstrip().startswith("{") or not t.strip() for t in texts)
    assert not {tok.encode(w, add_special_tokens=False)[0] for w in ("[", "a", "1")} & first


def test_mask_rows_combine_grammar_allowed_and_bad_words(llm, compiler):
    tok = llm.engine.tokenizer
    choice = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no", "ok"]))
    yes, no, ok = (tok.encode(w, add_special_tokens=False)[0] for w in ("yes", "no", "ok"))
    both = SamplingParams(
        structured_outputs=StructuredOutputsParams(choice=["yes", "no", "ok"]),
        allowed_token_ids=[yes, no, ok, 7], bad_words=["no"], logit_bias={9: 2.0},
    )
    build = lambda p: LogitsConstraints.build(p, VOCAB, tok, lambda: compiler)  # noqa: E731
    c_choice, c_both = build(choice), build(both)
    bias_only = build(SamplingParams(logit_bias={3: -5.0}))
    builder = LogitsMaskBuilder(VOCAB, torch.device("cpu"))
    masks = builder.build([(0, c_choice, 0, []), (2, c_both, 0, []), (3, bias_only, 0, [])])
    assert masks.bitmask_rows.tolist() == [0, 2]  # row 1 (no constraints) and row 3 untouched
    grammar_first = allowed_ids(masks.bitmask[0])
    assert {yes, no, ok} <= grammar_first and len(grammar_first) < 50
    assert allowed_ids(masks.bitmask[1]) == (grammar_first & {yes, no, ok, 7}) - {no}
    entries = sorted(zip(masks.bias_rows.tolist(), masks.bias_ids.tolist(),
                         masks.bias_values.tolist()))
    assert entries == [(2, 9, 2.0), (3, 3, -5.0)]
    assert builder.build([(0, None, 0, [])][:0]) is None


def test_batched_mask_fill_equals_one_fill_per_matcher(llm, monkeypatch):
    """Every step's grammar rows come from one batched xgrammar call (MaskFiller); each row is
    what its matcher fills alone, n > 1 samples and a finishing choice among them, and no row
    is left unfilled (an empty row would let token 0 through: every logit -inf)."""
    from tinypaged.sampling.structured_output import MaskFiller

    fill, checked = MaskFiller.fill, []

    def checking_fill(self, matchers, bitmask, rows=None):
        bitmask.fill_(0)
        fill(self, matchers, bitmask, rows)
        want = torch.zeros_like(bitmask)
        for i, m in zip(rows or range(len(matchers)), matchers):
            m.fill_next_token_bitmask(want, i)
            assert bitmask[i].any()
        assert torch.equal(bitmask, want)
        checked.append(len(matchers))

    monkeypatch.setattr(MaskFiller, "fill", checking_fill)
    choice = StructuredOutputsParams(choice=["red", "green"])
    outs = gen(llm, ["a", "b", "c"], [
        SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=60, structured_outputs=JSON),
        SamplingParams(temperature=0, max_tokens=60, structured_outputs=JSON),
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=choice),
    ])
    assert max(checked) == 4 and len(checked) > 10
    for c in outs[0].outputs + outs[1].outputs:
        validate(c.text)
    assert outs[2].outputs[0].text in ("red", "green")


# ------------------------------------------------------------------ the engine


def validate(text: str) -> dict:
    doc = json.loads(text)
    jsonschema.validate(doc, SCHEMA)
    return doc


def test_json_schema_n_samples_seeded(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=60, structured_outputs=JSON)
    outs = gen(llm, ["a", "bc d"], params)
    docs = [validate(c.text) for o in outs for c in o.outputs]
    assert all(c.finish_reason == "stop" for o in outs for c in o.outputs)
    assert len({json.dumps(d, sort_keys=True) for d in docs}) > 1  # samples differ
    again = gen(llm, ["a", "bc d"], params)
    assert [c.text for o in again for c in o.outputs] == [c.text for o in outs for c in o.outputs]


def test_mixed_batch_leaves_unconstrained_rows_alone(llm):
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = gen(llm, ["x y", "hello there"], plain)
    mixed = llm.generate(
        ["x y", "z", "hello there", "w"],
        [plain, SamplingParams(temperature=0, max_tokens=60, structured_outputs=JSON), plain,
         SamplingParams(temperature=0, max_tokens=8,
                        structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}"))],
        use_tqdm=False,
    )
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == [
        o.outputs[0].token_ids for o in alone
    ]
    validate(mixed[1].outputs[0].text)
    assert re.fullmatch(r"[0-9]{3}", mixed[3].outputs[0].text)


def test_grammar_complete_finishes_even_with_ignore_eos(llm):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["red", "green"]))
    out = gen(llm, ["pick"], params)[0].outputs[0]
    assert out.text in ("red", "green") and out.finish_reason == "stop"


def test_preemption_recomputes_without_breaking_the_grammar(model_dir, llm):
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=JSON)
    prompts = [f"prompt number {i} " * 3 for i in range(6)]
    want = [o.outputs[0].text for o in gen(llm, prompts, params)]
    small = LLM(str(model_dir), num_kv_blocks=12, block_size=8)  # 96 slots for ~6 x 45 tokens
    preempted = count_preemptions(small.engine.scheduler)
    texts = [o.outputs[0].text for o in gen(small, prompts, params)]
    assert preempted[0] > 0
    assert texts == want
    for t in want:
        validate(t)


def test_logit_bias_allowed_token_ids_and_bad_words(llm):
    tok = llm.engine.tokenizer
    base = dict(temperature=0, max_tokens=6, ignore_eos=True)
    free = gen(llm, ["once upon"], SamplingParams(**base))[0].outputs[0].token_ids
    forced = gen(llm, ["once upon"], SamplingParams(**base, logit_bias={777: 100}))[0].outputs[0]
    assert forced.token_ids == [777] * 6 != free
    allowed = [100, 200, 300]
    out = gen(llm, ["once upon"], SamplingParams(**base, allowed_token_ids=allowed))[0].outputs[0]
    assert set(out.token_ids) <= set(allowed)
    paris = tok.encode("Paris", add_special_tokens=False)
    assert len(paris) == 1
    biased = SamplingParams(**base, logit_bias={paris[0]: 100})
    assert gen(llm, ["once upon"], biased)[0].outputs[0].token_ids == paris * 6
    banned = SamplingParams(**base, logit_bias={paris[0]: 100}, bad_words=["Paris"])
    assert paris[0] not in gen(llm, ["once upon"], banned)[0].outputs[0].token_ids


def test_missing_xgrammar_says_what_to_install(monkeypatch):
    from tinypaged.sampling.structured_output import GrammarCompiler

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'xgrammar>=0\.2\.9'"):  # a checkout
        GrammarCompiler(None, VOCAB, [2])


def test_async_scheduling_keeps_constrained_steps_in_flight(model_dir):
    """With async scheduling a step holding constrained requests samples late (its forward
    runs while the previous step is processed, then the masks are built from the matchers that
    just accepted that step's tokens): the steps stay in flight and every request's text,
    sampled or greedy, is the synchronous engine's."""
    params = [
        SamplingParams(temperature=0, max_tokens=60, structured_outputs=JSON),
        SamplingParams(temperature=1.0, seed=3, max_tokens=60, structured_outputs=JSON),
        SamplingParams(temperature=0.8, seed=4, max_tokens=8,
                       structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}")),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True),
    ]
    prompts = ["a", "bc d", "num", "x y", "hello there"]
    sync = LLM(str(model_dir), num_kv_blocks=64, block_size=8, async_scheduling=False)
    want = [o.outputs[0].text for o in gen(sync, prompts, params)]
    llm = LLM(str(model_dir), num_kv_blocks=64, block_size=8, async_scheduling=True)
    engine, in_flight = llm.engine, []
    step = engine.step

    def counting_step(*args, **kwargs):
        outputs = step(*args, **kwargs)
        in_flight.append(engine._in_flight is not None)
        return outputs

    engine.step = counting_step
    assert [o.outputs[0].text for o in gen(llm, prompts, params)] == want
    assert sum(in_flight) > len(in_flight) // 2  # the steps overlapped
    validate(want[0])
    validate(want[1])
    assert re.fullmatch(r"[0-9]{3}", want[2])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_token_the_grammar_rejects_fails_only_its_request(model_dir, async_scheduling):
    """With the masks switched off, greedy sampling picks a token the JSON grammar rejects: that
    request fails with an error naming it, the plain request beside it finishes."""
    llm = LLM(str(model_dir), num_kv_blocks=64, block_size=8, async_scheduling=async_scheduling)
    engine = llm.engine
    engine.mask_builder.build = lambda rows: None
    engine.add_request("json", "a", SamplingParams(temperature=0, max_tokens=8,
                                                   structured_outputs=JSON))
    engine.add_request("plain", "b", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    finished, errors = run_to_end(engine)
    assert list(errors) == ["json"] and "grammar rejected" in str(errors["json"])
    assert len(finished["plain"].outputs[0].token_ids) == 8
