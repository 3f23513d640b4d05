"""Architecture name in config.json -> tinypaged model class.

`architectures` (e.g. ["Qwen3ForCausalLM"]) is looked up first, then `model_type` (e.g. "qwen3"),
so configs written by other tools (GGUF conversion, remote-code checkpoints) resolve too.
"""

from __future__ import annotations

import importlib

from torch import nn

# architecture -> (module, class)
_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Qwen2ForCausalLM": ("qwen", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen", "Qwen3ForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen_moe", "Qwen3MoeForCausalLM"),
    "GlmForCausalLM": ("glm", "GlmForCausalLM"),
    "Glm4ForCausalLM": ("glm", "Glm4ForCausalLM"),
    "Glm4MoeForCausalLM": ("glm_moe", "Glm4MoeForCausalLM"),
    "ChatGLMModel": ("glm", "ChatGLMForConditionalGeneration"),
    "ChatGLMForConditionalGeneration": ("glm", "ChatGLMForConditionalGeneration"),
}

_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "glm": "GlmForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "chatglm": "ChatGLMModel",
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def get_model_class(hf_config) -> type[nn.Module]:
    """The class to build for `hf_config`; ValueError naming the architecture when unknown."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    model_type = getattr(hf_config, "model_type", None)
    names = [a for a in architectures if a in _ARCHITECTURES]
    if not names and model_type in _MODEL_TYPES:
        names = [_MODEL_TYPES[model_type]]
    if not names:
        raise ValueError(
            f"unsupported model architecture {architectures or None} (model_type "
            f"{model_type!r}); tinypaged supports: {', '.join(supported_architectures())}"
        )
    module, cls = _ARCHITECTURES[names[0]]
    return getattr(importlib.import_module(f"tinypaged.models.{module}"), cls)
