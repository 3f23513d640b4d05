"""Writes llmcompressor_fp8_dynamic/: a tiny random Llama quantized by llm-compressor itself
(FP8_DYNAMIC: per-channel e4m3 weights, dynamic per-token activations; compressed-tensors
"float-quantized"), the checkpoint test_fp8_model.py loads. Not run by the tests: llm-compressor
0.14 pins transformers <= 5.17 and compressed-tensors 0.19, so it lives in its own environment:

    python3 -m venv --system-site-packages /tmp/llmc && /tmp/llmc/bin/pip install llmcompressor
    cd tests/quantization/data && /tmp/llmc/bin/python make_llmcompressor_fp8.py
"""

import shutil
import tempfile
from pathlib import Path

import torch
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from transformers import LlamaConfig, LlamaForCausalLM

OUT = Path(__file__).resolve().parent / "llmcompressor_fp8_dynamic"

torch.manual_seed(0)
config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     tie_word_embeddings=False)
model = LlamaForCausalLM(config)
for p in model.parameters():
    p.data.normal_(std=0.1)
with tempfile.TemporaryDirectory() as dense:
    model.save_pretrained(dense)
    recipe = QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"])
    quantized = oneshot(model=dense, recipe=recipe)  # no calibration data: weights only
    shutil.rmtree(OUT, ignore_errors=True)
    quantized.save_pretrained(str(OUT), save_compressed=True)
(OUT / "generation_config.json").unlink(missing_ok=True)
