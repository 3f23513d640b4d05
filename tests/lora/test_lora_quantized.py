"""A LoRA adapter on an AWQ int4 base model: the delta is added after the quantized linear, so the
tokens equal those of PEFT's merged model over the checkpoint's dequantized weights. And the
benchmarks' random adapters (bench/lora_adapters.py) are adapters PEFT itself loads."""

import torch
from helpers.lora import save_peft_adapter
from helpers.models import greedy_reference, prompts, single_thread  # noqa: F401 (autouse)
from helpers.quantize import quantized_pair

from tinypaged import LLM, LoRARequest, SamplingParams
from tinypaged.bench.lora_adapters import write_random_adapter
from tinypaged.bench.tiny_models import tiny_hf_model


def test_adapter_on_awq_base(tmp_path):
    awq_dir, dequantized = quantized_pair("llama", tmp_path)
    merged = save_peft_adapter(dequantized, tmp_path / "adapter", 8, 16, seed=3)
    llm = LLM(str(awq_dir), skip_tokenizer_init=True, num_kv_blocks=32, dtype="float32",
              enable_lora=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    lora = LoRARequest("a", 1, str(tmp_path / "adapter"))
    for p in prompts(2, seed=4, hi=12):
        out = llm.generate({"prompt_token_ids": p}, greedy, use_tqdm=False, lora_request=lora)
        assert out[0].outputs[0].token_ids == greedy_reference(merged, p, 5)[0]


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
