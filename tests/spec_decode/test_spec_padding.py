"""Short drafts padded to k (spec_decode/decoder.py, SpecDecoder._pad), which a GPU with CUDA
graphs does so that a verification replays one graph: the greedy output is still the output
without speculation, every padded step verifies k drafts for each sequence, the counters count
only the proposer's drafts, and no padding where the step could not be one graph anyway."""

from __future__ import annotations

import pytest
from helpers.models import prompts, single_thread  # noqa: F401  (single_thread: autouse fixture)

from tinypaged import LLM, SamplingParams
from tinypaged.spec_decode import decoder

ENGINE = dict(num_kv_blocks=96, block_size=4, max_model_len=128)
K = 4


def ngram_llm(path: str, **kw) -> LLM:
    config = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
              "prompt_lookup_max": 3}
    return LLM(path, skip_tokenizer_init=True, speculative_config=config, **ENGINE, **kw)


def run(llm: LLM, batch, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture
def launches(monkeypatch):
    """The draft lengths of every launched verification, per sampled sequence."""
    seen = []
    launch = decoder.SpecDecoder.launch

    def spy(self, items):
        seen.append([len(it.spec_token_ids) for it in items if it.sample])
        return launch(self, items)

    monkeypatch.setattr(decoder.SpecDecoder, "launch", spy)
    return seen


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_padded_drafts_keep_the_greedy_output(llama, launches, async_scheduling):
    batch = prompts(4, seed=7, lo=6, hi=20)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    base = run(LLM(llama, skip_tokenizer_init=True, **ENGINE), batch, params)
    plain = ngram_llm(llama, async_scheduling=async_scheduling)
    assert not plain.engine.spec.pad_drafts  # a CPU engine runs eagerly: nothing to pad for
    assert run(plain, batch, params) == base
    launches.clear()
    llm = ngram_llm(llama, async_scheduling=async_scheduling)
    llm.engine.spec.pad_drafts = True  # as on a GPU with graphs
    assert run(llm, batch, params) == base
    decodes = [ks for ks in launches if len(ks) == len(batch) and any(ks)]
    # Every step of four decodes verifies k drafts each, until one of them nears max_tokens.
    assert sum(all(k == K for k in ks) for ks in decodes) >= len(decodes) - 2 > 0
    spec = llm.engine.get_stats()["spec_decode"]
    assert 0 < spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    # Sampled rows take the fillers through the same rejection rule (a point-mass draft).
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    assert [len(t) for t in run(llm, batch, sampled)] == [24] * len(batch)
    stats = llm.engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_fillers_are_not_counted_as_drafts(llama, launches):
    # A lookup that never finds a match: every draft the steps verify is filler, and the
    # counters stay at zero.
    batch = prompts(2, seed=8, lo=6, hi=20)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    base = run(LLM(llama, skip_tokenizer_init=True, **ENGINE), batch, params)
    llm = ngram_llm(llama)
    llm.engine.spec.pad_drafts = True
    llm.engine.spec.proposer.propose = lambda seqs, ks: [[] for _ in seqs]
    assert run(llm, batch, params) == base
    assert [K, K] in launches
    spec = llm.engine.get_stats()["spec_decode"]
    assert spec["num_drafts"] == spec["num_draft_tokens"] == spec["num_accepted_tokens"] == 0


def test_no_padding_past_the_token_budget(llama, launches):
    # Four sequences at k + 1 = 5 tokens each would take 20 of a 12-token budget: no padding,
    # so no sequence waits a step for another's fillers.
    batch = prompts(4, seed=7, lo=6, hi=10)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    base = run(LLM(llama, skip_tokenizer_init=True, **ENGINE), batch, params)
    llm = ngram_llm(llama, max_num_batched_tokens=12)
    llm.engine.spec.pad_drafts = True
    llm.engine.spec.proposer.propose = lambda seqs, ks: [[] for _ in seqs]
    assert run(llm, batch, params) == base
    assert any(len(ks) == 4 for ks in launches)  # steps of four decodes, none padded
    assert all(k == 0 for ks in launches for k in ks)


def test_no_padding_while_a_request_waits_or_prefills(llama, launches):
    # Eight prompts and room for two sequences at a time: each admission mixes a prefill into
    # the step, and requests wait; those steps keep the proposer's own drafts.
    batch = prompts(8, seed=9, lo=6, hi=12)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    base = run(LLM(llama, skip_tokenizer_init=True, max_num_seqs=2, **ENGINE), batch, params)
    llm = ngram_llm(llama, max_num_seqs=2)
    llm.engine.spec.pad_drafts = True
    assert run(llm, batch, params) == base
    assert any(0 < len(ks) and not all(k == K for k in ks) for ks in launches)
