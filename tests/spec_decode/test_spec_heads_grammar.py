"""Draft heads (EAGLE-3, MTP) under structured output, and the seam of their drafting-step CUDA
graphs (spec_decode/head_proposer.py).

Constrained requests speculate with a head: each draft is the head's argmax among the tokens the
grammar allows after the drafts before it, so a random head is right wherever the grammar forces
the token (acceptance > 0) and a head that computes the target's own next token has every draft
accepted; greedy output equals decoding without speculation token for token, alone and beside
free requests. The drafting steps' fixed-shape padded forward (what a CUDA graph replays) gives
the eager forward's outputs, and batches past the largest bucket run eagerly."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.models import save_byte_tokenizer, single_thread  # noqa: F401  (autouse fixture)
from helpers.spec_heads import save_eagle3, save_glm_mtp

from tinypaged import LLM, SamplingParams
from tinypaged.bench.tiny_models import tiny_hf_model
from tinypaged.sampling.structured_output import StructuredOutputsParams
from tinypaged.worker.cuda_graphs import HeadStepGraphs

ENGINE = dict(num_kv_blocks=96, block_size=4, max_model_len=128)
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                            "kind": {"enum": ["cat", "dog"]}},
          "required": ["id", "kind"], "additionalProperties": False}
RECORD = '{"id":42,"kind":"dog"}'
JSON = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(
    json=SCHEMA, disable_any_whitespace=True))
CHOICE = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=(
    StructuredOutputsParams(choice=["abcabcabcabc", "abcabd", "xyz"])))
REGEX = SamplingParams(temperature=0.0, max_tokens=30, bad_words=["abd"],
                       structured_outputs=StructuredOutputsParams(regex="(abc|abd){2,6}"))
FREE = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
BATCH = [f"{RECORD} {RECORD[:8]}", "abcabcab", "abcab abcab", "xy", f"{RECORD} {RECORD}"]
PARAMS = [JSON, CHOICE, REGEX, FREE, JSON]
CONSTRAINED = [i for i, p in enumerate(PARAMS) if p is not FREE]


def run(llm: LLM, idx: list[int]):
    outs = llm.generate([BATCH[i] for i in idx], [PARAMS[i] for i in idx], use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
            for o in outs]


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """name -> (target dir, speculative_config, whether every draft is accepted, greedy base):
    a 4-layer llama with random EAGLE-3 heads (a 200-id draft vocabulary through d2t, and the
    full vocabulary), and a bigram GLM-4.5 whose MTP layer computes its own next token."""
    root = tmp_path_factory.mktemp("heads_grammar")
    llama4 = tiny_hf_model("llama", seed=3, num_hidden_layers=4)
    llama4.save_pretrained(root / "llama4")
    save_byte_tokenizer(root / "llama4")
    for name, vocab in (("eagle3_d2t", 200), ("eagle3", None)):
        (root / name).mkdir()
        save_eagle3(root / name, llama4.config, draft_vocab=vocab, seed=1)
    (root / "glm").mkdir()
    save_glm_mtp(root / "glm", copy=True, bigram=True)
    save_byte_tokenizer(root / "glm")
    cases = {
        "eagle3_d2t": (root / "llama4", {"method": "eagle3", "model": str(root / "eagle3_d2t"),
                                         "num_speculative_tokens": 3}, False),
        "eagle3": (root / "llama4", {"method": "eagle3", "model": str(root / "eagle3"),
                                     "num_speculative_tokens": 2}, False),
        "mtp": (root / "glm", {"method": "mtp", "num_speculative_tokens": 3}, True),
    }
    bases = {path: run(LLM(str(path), **ENGINE), list(range(len(BATCH))))
             for path in {c[0] for c in cases.values()}}
    return {name: (*case, bases[case[0]]) for name, case in cases.items()}


@pytest.mark.parametrize("name", ["eagle3_d2t", "eagle3", "mtp"])
def test_constrained_requests_draft_under_the_grammar(targets, name):
    path, config, exact, base = targets[name]
    for i in CONSTRAINED:  # the outputs are what their grammars ask for
        tokens, text, finish = base[i]
        if PARAMS[i] is JSON and finish == "stop":
            assert set(json.loads(text)) == {"id", "kind"}
        if PARAMS[i] is CHOICE:
            assert text in ("abcabcabcabc", "abcabd", "xyz")
        if PARAMS[i] is REGEX:
            assert "abd" not in text and set(text) <= set("abcd")
    llm = LLM(str(path), speculative_config=config, **ENGINE)
    # The constrained requests alone: the counters are theirs. A random head drafts tokens
    # the target accepts only where the grammar forces them: acceptance > 0 shows that the
    # drafts follow the grammar (the head's own argmax would be cut at the first token).
    assert run(llm, CONSTRAINED) == [base[i] for i in CONSTRAINED]
    spec = llm.engine.get_stats()["spec_decode"]
    assert spec["num_drafts"] > 0 and spec["num_accepted_tokens"] > 0, spec
    if exact:
        assert spec["num_accepted_tokens"] == spec["num_draft_tokens"], spec
    else:
        assert spec["num_accepted_tokens"] < spec["num_draft_tokens"], spec
    # ... and in one batch with a free request; then every block of both caches is free.
    assert run(llm, list(range(len(BATCH)))) == base
    stats = llm.engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    proposer = llm.engine.spec.proposer
    assert not proposer.twins and proposer.blocks.num_free_blocks == proposer.blocks.num_blocks
    llm.engine.scheduler.check_invariants()


def test_draft_vocabulary_laid_over_the_target_ids(targets):
    path, config, _, _ = targets["eagle3_d2t"]
    head = LLM(str(path), speculative_config=config, **ENGINE).engine.spec.proposer.head
    logits = torch.randn(2, 200)
    full = head.target_logits(logits, 256)  # [2, 256]
    ids = head.to_target_ids(torch.arange(200))
    assert torch.equal(full[:, ids], logits)
    assert torch.isneginf(full).sum() == 2 * 56
    assert torch.equal(full.argmax(-1), head.to_target_ids(logits.argmax(-1)))


@pytest.mark.parametrize("name", ["eagle3_d2t", "mtp"])
def test_drafting_step_graph_seam(targets, name):
    """The drafting steps through HeadStepGraphs' static padded buffers (capture=False: the
    forward a graph would replay, run eagerly) give the eager step's outputs; batches past the
    largest bucket (here 4) run eagerly; the tokens are unchanged."""
    path, config, _, base = targets[name]
    llm = LLM(str(path), speculative_config=config, **ENGINE)
    proposer = llm.engine.spec.proposer
    assert proposer.graphs is None  # the CPU captures nothing
    graphs = HeadStepGraphs(proposer.head, 4, proposer.tables.array.shape[1],
                            proposer.block_size, proposer.head.spec.hidden_size,
                            proposer.device, torch.float32, capture=False)
    proposer.graphs = graphs
    sizes, eager, decode_step = [], proposer._run, proposer._decode_step

    def both(items, features):  # each drafting step twice: eagerly, then through the seam
        sizes.append(len(items))
        want = [t.clone() for t in eager(items, features)]
        got = decode_step(items, features)
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)
        return got

    proposer._decode_step = both
    # A batch of 5: drafting steps of 5 (eager) and, as sequences stop drafting, fewer.
    assert run(llm, list(range(len(BATCH)))) == base
    assert graphs.num_replays == sum(s <= 4 for s in sizes) > 0
    assert 5 in sizes and 3 in sizes  # 3: padded to the bucket of 4
