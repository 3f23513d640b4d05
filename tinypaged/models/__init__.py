"""Model definitions: Llama, Qwen2/2.5, Qwen3, GLM / GLM-4 / ChatGLM on shared layers.

    cls = get_model_class(hf_config)          # registry.py
    with torch.device(device):                # under the target default dtype
        model = cls(hf_config, quant_config=None)
    model.load_weights(pairs_of_name_and_tensor)
    hidden = model(input_ids, positions, attn_metadata)   # [T, hidden]
    logits = model.compute_logits(hidden[rows])           # [N, vocab], the model's dtype

layers.py holds the tensor-parallel building blocks, decoder.py the transformer they form,
rope.py the rotary settings; llama.py, qwen.py and glm.py declare each architecture's differences.
"""

from tinypaged.models.registry import get_model_class, supported_architectures

__all__ = ["get_model_class", "supported_architectures"]
