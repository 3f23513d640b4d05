"""Random LoRA adapters in the PEFT format for a model shape (benchmarks: no training needed).

    write_random_adapter(path, config, rank=16, seed=0)

writes `path/adapter_config.json` and `path/adapter_model.safetensors` as PEFT's
`save_pretrained` does for a LoRA on all seven projections (q/k/v/o/gate/up/down) of every layer
of a llama-style `config` (a config.json dict): A [r, in] and B [out, r] in bfloat16, drawn so
that the delta is a few percent of a dummy-weight layer's output. tinypaged and vLLM load the
same folders (benchmarks/lora_bench.py, benchmarks/lora_vllm_bench.py); tests/lora checks that
PEFT itself loads one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projection_shapes(config: dict) -> dict[str, tuple[str, int, int]]:
    """HF module suffix -> (parent, in_features, out_features) of a llama-style config."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {"q_proj": ("self_attn", hidden, q), "k_proj": ("self_attn", hidden, kv),
            "v_proj": ("self_attn", hidden, kv), "o_proj": ("self_attn", q, hidden),
            "gate_proj": ("mlp", hidden, inter), "up_proj": ("mlp", hidden, inter),
            "down_proj": ("mlp", inter, hidden)}


def write_random_adapter(path: str | Path, config: dict, rank: int = 16, seed: int = 0,
                         alpha: int | None = None, base_model: str = "") -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, (parent, n_in, n_out) in projection_shapes(config).items():
            key = f"base_model.model.model.layers.{layer}.{parent}.{name}"
            a = torch.randn(rank, n_in, generator=gen) / n_in**0.5
            b = torch.randn(n_out, rank, generator=gen) * (0.02 / rank**0.5)
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16).contiguous()
            tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16).contiguous()
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": alpha or 2 * rank, "lora_dropout": 0.0, "bias": "none",
        "target_modules": list(TARGETS), "use_rslora": False, "use_dora": False,
        "fan_in_fan_out": False, "modules_to_save": None, "inference_mode": True,
    }
    (path / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return path
