"""Quantizer test helpers: the linears a tiny model quantizes, a saved tiny model, dequantize,
and tiny AWQ / GPTQ checkpoints beside transformers models holding their dequantized weights."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from helpers.models import (
    save_byte_tokenizer,
    tiny_hf_model,
)
from tinypaged.kernels.awq import unpack_awq
from tinypaged.kernels.gptq_format import gptq_dequantize_reference, pack_gptq
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


def random_g_idx(K, group_size, act_order, gen):
    """Each input row's group: k // G, or under act-order the groups of a random row order."""
    G = K if group_size == -1 else group_size
    order = torch.randperm(K, generator=gen) if act_order else torch.arange(K)
    g_idx = torch.empty(K, dtype=torch.int32)
    g_idx[order] = (torch.arange(K) // G).to(torch.int32)
    return g_idx


def rtn_gptq(w, g_idx, bits, sym):
    """Round-to-nearest per group of W^T = w.t() [K, N]: (q [K, N], zeros [K/G, N], scales)."""
    wt, top = w.t().float(), 2**bits - 1
    groups = int(g_idx.max()) + 1
    q = torch.empty(wt.shape, dtype=torch.int64)
    zeros = torch.empty(groups, wt.shape[1], dtype=torch.int64)
    scales = torch.empty(groups, wt.shape[1], dtype=torch.float16)
    for g in range(groups):
        rows = g_idx == g
        chunk = wt[rows]
        if sym:
            s = (chunk.abs().amax(0) * 2 / top).clamp(min=1e-5).half().float()
            z = torch.full_like(s, (top + 1) // 2)
        else:
            lo, hi = chunk.amin(0).clamp(max=0), chunk.amax(0).clamp(min=0)
            s = ((hi - lo) / top).clamp(min=1e-5).half().float()
            z = (-lo / s).round().clamp(0, top)
        q[rows] = (chunk / s + z).round().clamp(0, top).long()
        zeros[g], scales[g] = z.long(), s.half()
    return q, zeros, scales


def gptq_pair(tmp_path, kind="llama", bits=4, group_size=32, act_order=False, sym=True,
              version=1):
    """(GPTQ checkpoint dir, transformers model holding its dequantized weights)."""
    hf_model = save_tiny(kind, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    gen = torch.Generator().manual_seed(bits * 1000 + group_size)
    state, orders = {}, {}
    for name in list(tensors):
        prefix = name[: -len(".weight")]
        if not any(prefix.endswith(linear) for linear in LINEARS):
            continue
        w = tensors.pop(name)
        # the linears that read one input (q/k/v, gate/up) share one row order, as in GPTQ
        same_input = prefix.replace("k_proj", "q_proj").replace("v_proj", "q_proj")
        same_input = same_input.replace("up_proj", "gate_proj")
        if same_input not in orders:
            orders[same_input] = random_g_idx(w.shape[1], group_size, act_order, gen)
        g_idx = orders[same_input].clone()
        packed = pack_gptq(*rtn_gptq(w, g_idx, bits, sym), g_idx, bits, version)
        tensors.update({f"{prefix}.{k}": v for k, v in packed.items()})
        state[name] = gptq_dequantize_reference(packed["qweight"], packed["qzeros"],
                                                packed["scales"], packed["g_idx"], bits,
                                                version).t()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order,
        "sym": sym, "checkpoint_format": "gptq_v2" if version == 2 else "gptq"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf_model.load_state_dict(state, strict=False)
    return tmp_path, hf_model
