"""Quantizer test helpers: the linears a tiny model quantizes, a saved tiny model, dequantize."""

from __future__ import annotations

from safetensors.torch import load_file

from helpers.models import (
    save_byte_tokenizer,
    tiny_hf_model,
)
from tinypaged.kernels.awq import unpack_awq
from tinypaged.quantization import quantize as Q

LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def save_tiny(kind, path, **overrides):
    model = tiny_hf_model(kind, **overrides)
    model.save_pretrained(str(path))
    save_byte_tokenizer(path)
    return model


def dequantize(tensors, prefix, group_size):
    """[N, K] weights of one linear of a checkpoint, with the kernel module's unpack only."""
    q, z = unpack_awq(tensors[prefix + ".qweight"], tensors[prefix + ".qzeros"])  # [K, N]
    s = tensors[prefix + ".scales"].float()
    return ((q - z.repeat_interleave(group_size, 0)) * s.repeat_interleave(group_size, 0)).t()


def quantized_pair(kind, tmp_path, group_size=32):
    """(AWQ checkpoint dir, transformers model holding that checkpoint's dequantized weights)."""
    src, out = tmp_path / "src", tmp_path / "awq"
    hf_model = save_tiny(kind, src)
    assert Q.main([str(src), str(out), "--group-size", str(group_size), "--calib-samples", "2",
                   "--calib-seq-len", "64", "--n-grid", "4"]) == 0
    tensors = load_file(str(out / "model.safetensors"))
    state = {}
    for name, t in tensors.items():
        if name.endswith(".qweight"):
            prefix = name[: -len(".qweight")]
            state[prefix + ".weight"] = dequantize(tensors, prefix, group_size)
        elif not name.endswith((".qzeros", ".scales")):
            state[name] = t
    missing, unexpected = hf_model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied heads stored once
    return out, hf_model
