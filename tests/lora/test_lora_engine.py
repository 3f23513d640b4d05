"""Multi-LoRA through the engine: every adapter's greedy tokens equal those of PEFT's merged model
in transformers, in one batch that mixes adapters and the base model."""

import pytest
from helpers.lora import save_peft_adapter
from helpers.models import greedy_reference, prompts, single_thread  # noqa: F401 (autouse)

from tinypaged import LLM, LoRARequest, SamplingParams
from tinypaged.bench.tiny_models import save_tiny

STEPS = 5

# (rank, alpha, rsLoRA, targets): several ranks (8 = zero-padded below max_lora_rank 16),
# alpha scaling and rsLoRA, all seven projections or a few of them
ADAPTERS = [(8, 16, False, None), (16, 8, True, None), (4, 32, False, ["q_proj", "v_proj"]),
            (16, 16, False, ["gate_proj", "down_proj", "o_proj"])]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_adapters_match_peft_merged_in_one_batch(kind, tmp_path):
    hf = save_tiny(kind, tmp_path / "base")
    requests, refs = [None], [hf]
    for i, (r, alpha, rslora, targets) in enumerate(ADAPTERS):
        extra = {} if targets is None else {"targets": targets}
        refs.append(save_peft_adapter(hf, tmp_path / f"a{i}", r, alpha, rslora, seed=i, **extra))
        requests.append(LoRARequest(f"a{i}", i + 1, str(tmp_path / f"a{i}")))
    batch = prompts(len(requests) + 1, seed=1, hi=16)
    per_prompt = [requests[i % len(requests)] for i in range(len(batch))]
    llm = LLM(str(tmp_path / "base"), skip_tokenizer_init=True, num_kv_blocks=64,
              enable_lora=True, max_loras=4, max_lora_rank=16, max_cpu_loras=5)
    greedy = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy, use_tqdm=False,
                        lora_request=per_prompt)
    assert llm.engine.runner.lora.batch.num_slots == 4  # 4 adapters + base over 4 slots
    changed = 0
    for i, (p, out) in enumerate(zip(batch, outs)):
        want, _ = greedy_reference(refs[i % len(refs)], p, STEPS)
        assert out.outputs[0].token_ids == want, f"prompt {i}, adapter {per_prompt[i]}"
        changed += per_prompt[i] is not None and want != greedy_reference(hf, p, STEPS)[0]
    assert changed >= 2  # the adapters do change the tokens: the test could fail
    if kind == "llama":  # each request alone gets the tokens it got in the mixed batch
        for i in (1, 2):
            alone = llm.generate({"prompt_token_ids": batch[i]}, greedy, use_tqdm=False,
                                 lora_request=per_prompt[i])
            assert alone[0].outputs[0].token_ids == outs[i].outputs[0].token_ids
