"""Random GGUF weight blocks for the kernel and loader tests: any bytes, finite scales."""

from __future__ import annotations

import numpy as np

from tinypaged.kernels.gguf_format import GGML_TYPES

# byte offsets of each block's fp16 fields (scales and mins): random bytes there could be inf/nan
FP16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2),
               "Q6_K": (208,)}


def random_blocks(type_id: int, N: int, K: int, seed: int = 0, scale: float = 0.01) -> np.ndarray:
    """uint8 [N, row_bytes] of GGML type `type_id`: random quants, fp16 fields in [0, scale)."""
    t = GGML_TYPES[type_id]
    assert K % t.block_elems == 0, f"{t.name} rows are whole blocks of {t.block_elems}, not {K}"
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (N, K // t.block_elems, t.block_bytes), dtype=np.uint8)
    for offset in FP16_FIELDS[t.name]:
        field = (rng.random((N, K // t.block_elems, 1)) * scale).astype(np.float16)
        blocks[..., offset : offset + 2] = field.view(np.uint8)
    return blocks.reshape(N, -1)


def transformers_model(model_dir):
    """A converted GGUF directory (the default model) as a transformers model: its config.json
    without the gguf quantization_config, the file's blocks dequantized to fp32."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tinypaged.models.gguf_file import dense_state_dict

    config = AutoConfig.from_pretrained(str(model_dir))
    config.quantization_config = None
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(dense_state_dict(model_dir), strict=False)
    model.tie_weights()
    return model.eval()
