"""PEFT adapters of the tiny models, and PEFT's merged model as the reference."""

from __future__ import annotations

import copy

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_peft_adapter(hf_model, path, r: int, alpha: float, rslora: bool = False,
                      targets=ALL_TARGETS, seed: int = 0, **config):
    """Write a PEFT LoRA adapter of `hf_model` (A and B random, so it changes the tokens) to
    `path`; returns PEFT's merged model (a copy: hf_model is left as it was)."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=targets,
                     lora_dropout=0.0, bias="none", **config)
    peft_model = get_peft_model(copy.deepcopy(hf_model), cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3 / p.shape[-1] ** 0.5)
    peft_model.save_pretrained(str(path))
    return peft_model.merge_and_unload().eval()
