"""SamplingParams.prompt_logprobs on the engine: every prompt token's logprob (and the top-k)
equals transformers' log_softmax of the previous position's logits, through chunked prefill,
n > 1 samples and a prompt the prefix cache already holds."""

from __future__ import annotations

import pytest
import torch
from helpers.models import single_thread, tiny_hf_model  # noqa: F401 - the fixture

from tinypaged import LLM, SamplingParams


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    hf = tiny_hf_model("qwen3")
    path = tmp_path_factory.mktemp("qwen3")
    hf.save_pretrained(path)
    return hf, path


def test_prompt_logprobs_match_transformers(model):
    hf, path = model
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 256, (40,), generator=gen).tolist()
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)  # [L, V]
    llm = LLM(str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=128,
              num_kv_blocks=32, max_num_batched_tokens=16)  # 40 prompt tokens: 3 chunks
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, n=2)
    # The second copy of the prompt is in the prefix cache by the time it runs; prompt logprobs
    # must still cover it, and a request without them still uses the cache.
    outs = llm.generate([prompt, prompt], params, use_tqdm=False)
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0
    for out in outs:
        got = out.prompt_logprobs
        assert got[0] is None and len(got) == len(prompt)
        for i in range(1, len(prompt)):
            row = want[i - 1]
            top = set(row.topk(3).indices.tolist())
            assert set(got[i]) == top | {prompt[i]}
            for token, lp in got[i].items():
                assert lp == pytest.approx(row[token].item(), abs=1e-4)
        assert out.outputs[0].token_ids == plain.outputs[0].token_ids
