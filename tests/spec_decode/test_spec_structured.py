"""Structured output inside drafts: the per-position masks and the draft cut (spec_decode/
grammar.py), and constrained requests speculating (n-gram, a draft model) with greedy output
token for token equal to decoding without speculation, in batches beside unconstrained ones."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers.models import (  # noqa: F401  (single_thread: an autouse fixture)
    prompts,
    save_byte_tokenizer,
    save_tiny,
    single_thread,
    tiny_hf_model,
)

from tinypaged import LLM, SamplingParams
from tinypaged.sampling.logits_processors import LogitsConstraints
from tinypaged.sampling.structured_output import GrammarCompiler, StructuredOutputsParams
from tinypaged.spec_decode.grammar import DraftMaskBuilder, cut_draft

ENGINE = dict(num_kv_blocks=96, block_size=4, max_model_len=128)
EOS = 2  # the tiny Llama's eos: byte 2 of the ordered byte tokenizer, never in the text
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                            "kind": {"enum": ["cat", "dog"]}},
          "required": ["id", "kind"], "additionalProperties": False}


def allowed(host: torch.Tensor, row: int) -> set[int]:
    words = host[row].numpy().view(np.uint32)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def test_mask_builder_cuts_and_masks_every_position(llama):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llama)
    compiler = GrammarCompiler(tokenizer, 256, [EOS])
    c = LogitsConstraints.build(
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="(abc|abd)x"),
                       bad_words=["z"]),
        256, tokenizer, lambda: compiler)
    matcher = c.matchers[0]
    a, b, cc, d, x, z = tokenizer.encode("abcdxz", add_special_tokens=False)
    assert matcher.accept_token(a)  # the state the masks start from: "a" is out
    # The grammar rejects "x" after "ab": the draft is cut there (and "c" after it is dropped);
    # the matcher is where it was.
    assert cut_draft(c, 0, [b, x, cc]) == [b]
    assert cut_draft(c, 0, [b, d, x]) == [b, d, x]
    # After "x" the grammar is complete; then only the stop token, then nothing (terminated).
    assert cut_draft(c, 0, [b, d, x, EOS, a]) == [b, d, x, EOS]
    assert cut_draft(c, 0, [cc]) == []

    builder = DraftMaskBuilder(256, torch.device("cpu"))
    masks = builder.build_drafts([(3, c, 0, [a], [b, d, x, EOS])])
    assert masks.bitmask_rows.tolist() == [3, 4, 5, 6, 7]
    host = masks.bitmask
    assert allowed(host, 0) == {b}
    assert allowed(host, 1) == {cc, d}
    assert allowed(host, 2) == {x}
    assert allowed(host, 3) == {EOS}
    assert allowed(host, 4) == set(range(256)) - {z}  # terminated: the token is dropped anyway
    # The matcher was rolled back: the next step starts from "a" again.
    assert builder.build_drafts([(0, c, 0, [a], [])]).bitmask_rows.tolist() == [0]
    assert allowed(builder._host, 0) == {b}
    # A scheduled draft the grammar rejects is a bug upstream: an error, the matcher unharmed.
    with pytest.raises(RuntimeError, match="rejects scheduled draft token"):
        builder.build_drafts([(0, c, 0, [a], [b, x])])
    assert matcher.accept_token(b) and not matcher.accept_token(x)


def run(llm, batch, params):
    return [o.outputs[0] for o in llm.generate(batch, params, use_tqdm=False)]


def test_constrained_requests_speculate_greedy_equal(llama, tmp_path):
    tiny_hf_model("llama", seed=9, num_hidden_layers=1).save_pretrained(tmp_path)
    record = '{"id":42,"kind":"dog"}'
    json_so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    json_p = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=json_so)
    choice_p = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=(
        StructuredOutputsParams(choice=["abcabcabcabc", "abcabd", "xyz"])))
    regex_p = SamplingParams(temperature=0.0, max_tokens=30, bad_words=["abd"],
                             structured_outputs=StructuredOutputsParams(regex="(abc|abd){2,6}"))
    free = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    from transformers import AutoTokenizer

    a, b, c, space = AutoTokenizer.from_pretrained(llama).encode("abc ", add_special_tokens=False)
    biased = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                            allowed_token_ids=[a, b, c, space], logit_bias={c: 3.0})
    batch = [f"{record} {record} {record[:8]}", "abcabcabcabc", "abcabcab", "abcab abcab",
             f"{record} {record}", "abc abc ab"]
    params = [json_p, choice_p, regex_p, free, json_p, biased]
    base = run(LLM(llama, **ENGINE), batch, params)
    for out, p in zip(base, params):
        if p is json_p:
            value = json.loads(out.text)
            assert set(value) == {"id", "kind"} and value["kind"] in ("cat", "dog")
    assert base[1].text in ("abcabcabcabc", "abcabd", "xyz") and "abd" not in base[2].text
    # Every grammar request ends because its grammar completed (the JSON mid-draft below).
    assert all(o.finish_reason == "stop" for o in base[:3] + base[4:5])
    assert set(base[5].token_ids) <= {a, b, c, space}
    # n-gram drafts from the JSON in the prompt (accepted where they match, cut where the
    # grammar rejects them); a draft model with other weights (drafts the grammar allows, often
    # rejected by the target); the target as its own draft (its drafts follow the grammar as
    # the target's masked rows do: every draft accepted).
    configs = [{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                "prompt_lookup_max": 4},
               {"model": str(tmp_path), "num_speculative_tokens": 3},
               {"model": llama, "num_speculative_tokens": 3}]
    for config in configs:
        llm = LLM(llama, speculative_config=config, **ENGINE)
        # The constrained requests alone first: the counters are theirs.
        constrained = [i for i, p in enumerate(params) if p is not free]
        outs = run(llm, [batch[i] for i in constrained], [params[i] for i in constrained])
        assert [(o.token_ids, o.text) for o in outs] == [
            (base[i].token_ids, base[i].text) for i in constrained], config
        spec = llm.engine.get_stats()["spec_decode"]
        assert spec["num_drafts"] > 0 and spec["num_accepted_tokens"] > 0, config
        if config.get("model") == llama:
            assert spec["num_accepted_tokens"] == spec["num_draft_tokens"]
        elif config.get("model"):
            assert spec["num_accepted_tokens"] < spec["num_draft_tokens"]
        # ... and beside an unconstrained request.
        outs = run(llm, batch, params)
        assert [(o.token_ids, o.text, o.finish_reason) for o in outs] == [
            (o.token_ids, o.text, o.finish_reason) for o in base], config
        stats = llm.engine.get_stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_sampled_constrained_requests_speculate(llama):
    # Sampled rows verify on the per-position masks too: every emitted token is one the grammar
    # allows (an invalid one would fail the request), and a seed repeats itself.
    llm = LLM(llama, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                         "prompt_lookup_min": 1, "prompt_lookup_max": 3},
              **ENGINE)
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    record = '{"id":7,"kind":"cat"}'
    # n = 2: each sample walks its own matcher along its own drafts.
    params = [SamplingParams(temperature=0.7, top_p=0.95, seed=s, max_tokens=40, n=2,
                             structured_outputs=so) for s in range(4)]
    first, second = ([c for o in llm.generate([f"{record} {record} "] * 4, params,
                                              use_tqdm=False) for c in o.outputs]
                     for _ in range(2))
    assert len(first) == 8 and [o.token_ids for o in first] == [o.token_ids for o in second]
    for out in first:
        value = json.loads(out.text)
        assert 0 <= value["id"] <= 99 and value["kind"] in ("cat", "dog"), out.text
    spec = llm.engine.get_stats()["spec_decode"]
    assert spec["num_drafts"] > 0 and spec["num_accepted_tokens"] > 0
