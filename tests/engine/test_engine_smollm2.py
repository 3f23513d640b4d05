"""The engine on the real default model (SmolLM2-135M-Instruct): greedy text identical to
transformers running the same GGUF weights (dequantized to fp32), and the chat answer to the
capital question."""

from __future__ import annotations

import pytest
import torch
from helpers.gguf import transformers_model
from transformers import AutoTokenizer

from tinypaged import LLM, SamplingParams
from tinypaged.models.default_model import ensure_default_model

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot"]


@pytest.fixture(scope="module")
def llm():
    return LLM(num_kv_blocks=256)


def test_greedy_text_matches_transformers(llm):
    model_dir = ensure_default_model()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    hf = transformers_model(model_dir)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        assert out.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
        if tokenizer.eos_token_id in ref:  # transformers stops at eos; so do we
            ref = ref[: ref.index(tokenizer.eos_token_id) + 1]
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].text == tokenizer.decode(ref, skip_special_tokens=True)


def test_chat_answers_the_capital_question(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)[0]
    assert out.outputs[0].text == "The capital of France is Paris."
    assert out.outputs[0].finish_reason == "stop"
