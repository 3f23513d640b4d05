"""A LoRA adapter on AWQ, GPTQ and GGUF base models: the delta is added after the quantized linear,
so the tokens equal those of PEFT's merged model over the checkpoint's dequantized weights. And
the benchmarks' random adapters (bench/lora_adapters.py) are adapters PEFT itself loads."""

import os

import pytest
import torch
from helpers.gguf import transformers_model
from helpers.lora import save_peft_adapter
from helpers.models import greedy_reference, prompts, single_thread  # noqa: F401 (autouse)
from helpers.quantize import gptq_pair, quantized_pair

from tinypaged import LLM, LoRARequest, SamplingParams
from tinypaged.bench.lora_adapters import write_random_adapter
from tinypaged.bench.tiny_models import tiny_hf_model
from tinypaged.models import default_model


def check_adapter_on(base_dir, dequantized, adapter_dir, num_prompts=2, steps=5, **targets):
    merged = save_peft_adapter(dequantized, adapter_dir, 8, 16, seed=3, **targets)
    llm = LLM(str(base_dir), skip_tokenizer_init=True, num_kv_blocks=32, dtype="float32",
              enable_lora=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    lora = LoRARequest("a", 1, str(adapter_dir))
    for p in prompts(num_prompts, seed=4, hi=12):
        out = llm.generate({"prompt_token_ids": p}, greedy, use_tqdm=False, lora_request=lora)
        assert out[0].outputs[0].token_ids == greedy_reference(merged, p, steps)[0]


def test_adapter_on_awq_base(tmp_path):
    check_adapter_on(*quantized_pair("llama", tmp_path), tmp_path / "adapter")


def test_adapter_on_gptq_base(tmp_path):
    check_adapter_on(*gptq_pair(tmp_path / "gptq", act_order=True), tmp_path / "adapter")


@pytest.mark.skipif(os.environ.get("TINYPAGED_LONG_TESTS") != "1",
                    reason="TINYPAGED_LONG_TESTS=1: the reference dequantizes the default model's "
                    "GGUF file in Python (~15 s); AWQ and GPTQ cover the same path in CI")
def test_adapter_on_gguf_base(tmp_path):
    """The default model: a GGUF file's Q4_1 blocks under an adapter's delta."""
    model_dir = default_model.ensure_default_model()
    check_adapter_on(model_dir, transformers_model(model_dir), tmp_path / "adapter",
                     num_prompts=1, steps=3, targets=["q_proj", "o_proj", "down_proj"])


def test_bench_adapters_load_in_peft(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    hf = tiny_hf_model("llama", seed=1)
    write_random_adapter(tmp_path, hf.config.to_dict(), rank=4, seed=2)
    model = PeftModel.from_pretrained(hf, str(tmp_path))
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert len(saved) == 2 * 7 * hf.config.num_hidden_layers
    got = model.base_model.model.model.layers[1].mlp.down_proj.lora_B["default"].weight
    want = saved["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
    assert torch.equal(got.to(want.dtype), want)


def test_fused_qkv_and_gate_up_adapter(tmp_path):
    """Phi-3 stores qkv_proj and gate_up_proj fused, and so do its adapters: one A, B over the
    fused output, cut into the shards here."""
    from tinypaged.bench.tiny_models import save_tiny

    hf = save_tiny("phi3", tmp_path / "base")
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    merged = save_peft_adapter(hf, tmp_path / "a", 8, 8, targets=targets, seed=5)
    llm = LLM(str(tmp_path / "base"), skip_tokenizer_init=True, num_kv_blocks=32,
              enable_lora=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    p = prompts(1, seed=6, hi=12)[0]
    out = llm.generate({"prompt_token_ids": p}, greedy, use_tqdm=False,
                       lora_request=LoRARequest("a", 1, str(tmp_path / "a")))
    assert out[0].outputs[0].token_ids == greedy_reference(merged, p, 5)[0]
    assert out[0].outputs[0].token_ids != greedy_reference(hf, p, 5)[0]
