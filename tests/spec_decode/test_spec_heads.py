"""EAGLE-3, EAGLE and MTP draft heads (spec_decode/heads.py) end to end on tiny random models,
loaded from checkpoints written in their real on-disk formats (tests/helpers/spec_heads.py):
greedy output token for token equal to decoding without speculation for k = 1..3 in batches
mixing k, with random heads (every draft rejected) and with heads that compute the target's own
next token (drafts accepted, and partly rejected where the target leaks context); the hidden
states the target keeps are transformers' own; every KV block of the target and of the head is
free afterwards; bad configs are refused with clear errors."""

from __future__ import annotations

import pytest
import torch
from helpers.models import prompts, single_thread  # noqa: F401  (an autouse fixture)
from helpers.spec_heads import make_bigram, save_eagle, save_eagle3, save_glm_mtp

from tinypaged import LLM, SamplingParams
from tinypaged.bench.tiny_models import tiny_hf_model

ENGINE = dict(num_kv_blocks=96, block_size=4, max_model_len=128, skip_tokenizer_init=True)
BATCH = prompts(3, seed=7, hi=24)
# Different max_tokens: sequences near their limit speculate fewer tokens (batches mix k).
PARAMS = [SamplingParams(temperature=0.0, max_tokens=10 + 3 * i, ignore_eos=True)
          for i in range(len(BATCH))]


def run(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in BATCH], PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def spec_llm(target, method: str, k: int, model=None) -> LLM:
    config = {"method": method, "num_speculative_tokens": k}
    if model is not None:
        config["model"] = str(model)
    return LLM(str(target), speculative_config=config, **ENGINE)


def check(llm: LLM, base) -> dict:
    """Greedy tokens equal `base`; every block of the target's cache and the head's is free."""
    assert run(llm) == base
    stats = llm.engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    llm.engine.scheduler.check_invariants()
    proposer = llm.engine.spec.proposer
    assert not proposer.twins and proposer.blocks.num_free_blocks == proposer.blocks.num_blocks
    spec = stats["spec_decode"]
    assert spec["num_drafts"] > 0
    return spec


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    """A 4-layer llama target (EAGLE-3 reads three of its layers) and its greedy tokens."""
    path = tmp_path_factory.mktemp("llama4")
    hf = tiny_hf_model("llama", seed=3, num_hidden_layers=4)
    hf.save_pretrained(path)
    return path, hf, run(LLM(str(path), **ENGINE))


def test_kept_hidden_states_are_transformers(llama4, tmp_path):
    path, hf, _ = llama4
    save_eagle3(tmp_path, hf.config, aux_layers=(3, 1, 2))  # any order: kept in layer order
    llm = spec_llm(path, "eagle3", 2, tmp_path)
    prompt = BATCH[0]
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)
    kept = llm.engine.runner.model.aux_hidden_states  # the prompt's prefill: [T, 3 * hidden]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    want = torch.cat([ref[i][0] for i in (1, 2, 3)], dim=-1)
    torch.testing.assert_close(kept, want, rtol=1e-4, atol=1e-4)
    assert LLM(str(path), **ENGINE).engine.runner.model.aux_layers == ()  # nothing kept


@pytest.mark.parametrize("fmt", ["hf", "speculators"])
def test_eagle3_greedy_equals_no_speculation(llama4, tmp_path, fmt):
    path, hf, base = llama4
    # A random head (every draft rejected), with a draft vocabulary of 200 of the 256 ids
    # (d2t) and, in the speculators layout, its own embedding.
    save_eagle3(tmp_path, hf.config, fmt=fmt, draft_vocab=200, embed=fmt == "speculators")
    for k in (1, 3) if fmt == "hf" else (2,):
        check(spec_llm(path, "eagle3", k, tmp_path), base)


@pytest.fixture(scope="module")
def bigram(tmp_path_factory):
    """Llama targets whose next token depends on the current one alone (leak 0), or mostly
    (leak 0.4); and the EAGLE heads that compute that token (copy) or not (random)."""
    root = tmp_path_factory.mktemp("bigram")
    out = {}
    for leak in (0.0, 0.4):
        hf = tiny_hf_model("llama_untied", seed=3)
        make_bigram(hf, leak)
        hf.save_pretrained(root / f"target{leak}")
        out[leak] = (root / f"target{leak}", run(LLM(str(root / f"target{leak}"), **ENGINE)))
    for copy in (False, True):
        save_eagle(_mkdir(root / f"eagle{copy}"), seed=1, copy=copy)
    return root, out


def _mkdir(path):
    path.mkdir()
    return path


def test_eagle_greedy_and_acceptance(bigram):
    root, targets = bigram
    (exact, exact_base), (leaky, leaky_base) = targets[0.0], targets[0.4]
    assert check(spec_llm(exact, "eagle", 2, root / "eagleFalse"), exact_base)[
        "num_accepted_tokens"] == 0
    spec = check(spec_llm(exact, "eagle", 3, root / "eagleTrue"), exact_base)
    assert spec["num_accepted_tokens"] == spec["num_draft_tokens"]  # the target's own tokens
    spec = check(spec_llm(leaky, "eagle", 3, root / "eagleTrue"), leaky_base)
    assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"]  # accept, then reject


@pytest.mark.parametrize("copy", [False, True])
def test_mtp_greedy_and_acceptance(tmp_path, copy):
    save_glm_mtp(tmp_path, copy=copy, bigram=copy)
    base = run(LLM(str(tmp_path), **ENGINE))
    for k in (1, 3) if copy else (2,):
        spec = check(spec_llm(tmp_path, "mtp", k), base)
        if copy:
            assert spec["num_accepted_tokens"] == spec["num_draft_tokens"]
        else:
            assert spec["num_accepted_tokens"] < spec["num_draft_tokens"]


def test_bad_head_configs_are_refused(llama4, tmp_path):
    path, hf, _ = llama4
    with pytest.raises(ValueError, match="'eagle3' needs 'model'"):
        LLM(str(path), speculative_config={"method": "eagle3", "num_speculative_tokens": 2},
            **ENGINE)
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        spec_llm(path, "mtp", 2)
    save_eagle3(tmp_path, hf.config, aux_layers=(1, 2, 9))
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        spec_llm(path, "eagle3", 2, tmp_path)
    save_eagle3(tmp_path, hf.config, fmt="speculators")
    with pytest.raises(ValueError, match="speculators 'eagle3' checkpoint"):
        spec_llm(path, "eagle", 2, tmp_path)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill_preemption_and_both_prefix_caches(bigram, async_scheduling):
    from helpers.models import count_preemptions

    root, targets = bigram
    target = targets[0.4][0]
    batch = prompts(4, seed=4, lo=16, hi=30)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def generate(llm, prompts_):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts_], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], outs

    base = generate(LLM(str(target), **ENGINE), batch)[0]
    # 16 blocks of 4 tokens for 4 sequences of up to 46 tokens, 8 tokens a step: chunked
    # prefills, preemptions with drafts in flight, recomputes through the prefix cache.
    llm = LLM(str(target), skip_tokenizer_init=True, num_kv_blocks=16, block_size=4,
              max_model_len=128, max_num_batched_tokens=8,
              speculative_config={"method": "eagle", "model": str(root / "eagleTrue"),
                                  "num_speculative_tokens": 3}, async_scheduling=async_scheduling)
    preempted = count_preemptions(llm.engine.scheduler)
    assert generate(llm, batch)[0] == base
    assert preempted[0] > 0
    assert llm.engine.get_stats()["spec_decode"]["num_accepted_tokens"] > 0
    # Twice on a roomier cache: the second time the target's prefix cache and the head's own
    # serve the prompt, so the head computes fewer rows (the drafts' rows are the same), and
    # the tokens stay the same.
    llm = spec_llm(target, "eagle", 3, root / "eagleTrue")
    proposer = llm.engine.spec.proposer
    computed, run_head = [], proposer._run

    def counting_run(items, features):
        computed[-1] += sum(it.num_new_tokens for it in items)
        return run_head(items, features)

    proposer._run = counting_run
    for _ in range(2):
        computed.append(0)
        tokens, outs = generate(llm, batch[:1])
        assert tokens == base[:1]
    assert outs[0].num_cached_tokens > 0
    assert computed[1] <= computed[0] - outs[0].num_cached_tokens
    stats = llm.engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert not proposer.twins and proposer.blocks.num_free_blocks == proposer.blocks.num_blocks


def test_sampled_and_constrained_requests_beside_a_head(llama4, tmp_path):
    path, hf, base = llama4
    save_eagle3(tmp_path, hf.config)
    llm = spec_llm(path, "eagle3", 3, tmp_path)
    # A request with a logits constraint drafts among its allowed tokens in the same batches.
    allowed = SamplingParams(temperature=0.0, max_tokens=8, allowed_token_ids=list(range(100)))
    want = LLM(str(path), **ENGINE).generate({"prompt_token_ids": BATCH[0]}, allowed,
                                             use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate([{"prompt_token_ids": p} for p in BATCH + BATCH[:1]],
                        [*PARAMS, allowed], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [*base, want]
    assert all(t < 100 for t in want)
    # Seeded sampling through the head's drafts repeats itself.
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=5, ignore_eos=True)
    first, second = (llm.generate([{"prompt_token_ids": p} for p in BATCH], params,
                                  use_tqdm=False) for _ in range(2))
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    assert all(len(o.outputs[0].token_ids) == 12 for o in first)
