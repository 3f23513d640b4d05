"""Offline AWQ and GPTQ quantization: `tinypaged quantize MODEL OUT --group-size 128
[--method gptq]`. GPTQ (`--method gptq`, the algorithm in gptq_quant.py) quantizes the linear
groups of each layer in order (q/k/v, o, gate/up, down), each from the Hessian of its inputs as
the already quantized groups produce them, and writes an AutoGPTQ checkpoint. The rest of this
docstring is AWQ's.

Activation-aware weight quantization: a few input channels of a linear carry much larger
activations than the rest, and rounding errors in the weight columns they multiply dominate the
output error. Scaling those columns up before rounding gives them finer relative resolution, and
dividing the input by the same factors undoes the scaling exactly in full precision:

    y = x W^T = (x / s) (W * s)^T              x [T, K], W [N, K], s [K] one factor per channel

The 1/s is folded into the op that produces x, so inference pays nothing: the RMSNorm weight in
front of q/k/v and of gate/up, the rows of v_proj in front of o_proj, the rows of up_proj in front
of down_proj. For each such group of linears sharing one input, s = mean_t |x[t, :]|^alpha with
alpha searched on a grid in [0, 1) for the smallest output error of the quantized linears on the
calibration activations (alpha = 0 is plain round-to-nearest, so the search can only help there).
Under grouped-query attention one v channel feeds several o_proj input channels (one per query
head sharing the KV head), so the o_proj factors are tied across those heads.

Then round-to-nearest per group of G input channels with zero points (awq_search.py holds the
searches and the rounding).

Calibration runs the shipped text (tinypaged/data/calibration.txt) cut into blocks of
--calib-seq-len tokens through the model one decoder layer at a time: the inputs of layer 0 are
captured once, each layer's full-precision output feeds the next, and hooks record the inputs of
its linears. The output directory is an AutoAWQ "GEMM" checkpoint: config.json with
quantization_config, model.safetensors with qweight / qzeros / scales for every linear of the
decoder layers (embeddings, norms and the LM head as they were), tokenizer and generation config.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from importlib import resources
from pathlib import Path

import torch

from tinypaged.kernels.awq import SUPPORTED_GROUP_SIZES
from tinypaged.quantization import gptq_quant
from tinypaged.quantization.awq_search import quantize_rtn, search_clip, search_scales

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_COPY_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*",
                  "merges.txt", "chat_template*", "generation_config.json")


# ---------------------------------------------------------------------------- the model walk
class _Captured(Exception):
    """Raised by a hook to stop the forward pass once layer 0's inputs are seen."""


def _layer0_inputs(model, input_ids: torch.Tensor):
    """(hidden [B, L, H], kwargs) that the model passes to its first decoder layer."""
    seen = {}

    def hook(module, args, kwargs):
        seen["hidden"] = args[0] if args else kwargs.pop("hidden_states")
        seen["kwargs"] = kwargs
        raise _Captured

    handle = model.model.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        model(input_ids=input_ids, use_cache=False)
    except _Captured:
        pass
    finally:
        handle.remove()
    return seen["hidden"], seen["kwargs"]


def _scale_groups(layer, config):
    """(name, op in front, linears sharing its output, kv_heads tie) for one decoder layer."""
    attn, mlp = layer.self_attn, layer.mlp
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    tie = (kv, heads // kv, head_dim) if heads != kv else None
    return [
        ("qkv", layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], None),
        ("o", attn.v_proj, [attn.o_proj], tie),
        ("gate_up", layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], None),
        ("down", mlp.up_proj, [mlp.down_proj], None),
    ]


def _capture_inputs(layer, groups, hidden, kwargs):
    """Run the layer in full precision: ({group name: its input [T, K]}, output hidden)."""
    inputs: dict[str, torch.Tensor] = {}
    hooks = [linears[0].register_forward_hook(
        lambda mod, args, out, name=name: inputs.__setitem__(name, args[0].flatten(0, -2)))
        for name, _, linears, _ in groups]
    try:
        out = layer(hidden, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return inputs, out[0] if isinstance(out, tuple) else out


def scale_layer(groups, inputs: dict, group_size: int, n_grid: int):
    """Search and apply the AWQ factors of one layer. Folds 1/s into the norms and biases in
    place and returns ({linear: its scaled weight, fp32}, records); `inputs` becomes what the
    scaled linears read (x / s). Full-precision outputs are unchanged."""
    # fp32 working copies: scaling a bf16 weight in place would round it before quantization
    work = {m: m.weight.float().clone() for _, _, linears, _ in groups for m in linears}
    records = []
    for name, prev, linears, tie in groups:
        s, info = search_scales(inputs[name], [work[m] for m in linears], group_size, n_grid, tie)
        inputs[name] = inputs[name].float() / s
        for m in linears:
            work[m] *= s[None, :]
        s_prev = s if tie is None else s.view(tie)[:, 0].reshape(-1)  # one factor per v channel
        if isinstance(prev, torch.nn.Linear):  # the rows of v_proj / up_proj produce x
            work[prev] /= s_prev[:, None]
            if prev.bias is not None:
                prev.bias.copy_(prev.bias.float() / s_prev)
        else:  # RMSNorm: x = norm(h) * weight
            prev.weight.copy_(prev.weight.float() / s_prev)
        records.append({"group": name, **info})
    return work, records


@torch.no_grad()
def _quantize_layer(layer, hidden, kwargs, config, group_size: int, n_grid: int, clip: bool,
                    prefix: str):
    """Scale, clip and quantize one decoder layer: (next hidden, checkpoint tensors, records)."""
    groups = _scale_groups(layer, config)
    inputs, next_hidden = _capture_inputs(layer, groups, hidden, kwargs)
    work, records = scale_layer(groups, inputs, group_size, n_grid)
    # like AutoAWQ, q/k stay unclipped: their errors count through the attention softmax, which
    # the per-linear output error does not see
    unclipped = (layer.self_attn.q_proj, layer.self_attn.k_proj)
    tensors = {}
    for name, _, linears, _ in groups:
        for m in linears:
            ratio = None if not clip or m in unclipped else search_clip(
                inputs[name], work[m], group_size)
            qweight, qzeros, scales = quantize_rtn(work[m], group_size, ratio)
            path = f"{prefix}.{_module_name(layer, m)}"
            tensors.update({f"{path}.qweight": qweight.cpu(), f"{path}.qzeros": qzeros.cpu(),
                            f"{path}.scales": scales.cpu()})
    return next_hidden, tensors, [{"layer": prefix, **r} for r in records]


def _input_of(layer, linear, hidden, kwargs) -> torch.Tensor:
    """The input [T, K] that `linear` sees when `layer` runs on hidden; the forward stops there."""
    seen = {}

    def hook(module, args):
        seen["x"] = args[0].flatten(0, -2)
        raise _Captured

    handle = linear.register_forward_pre_hook(hook)
    try:
        layer(hidden, **kwargs)
    except _Captured:
        pass
    finally:
        handle.remove()
    return seen["x"]


@torch.no_grad()
def _gptq_layer(layer, hidden, kwargs, config, bits: int, group_size: int, sym: bool,
                act_order: bool, damp: float, clip: bool, prefix: str):
    """GPTQ one decoder layer in place: (next hidden, checkpoint tensors, records).

    The linears of a group read one input and share its Hessian, so they are quantized as one
    weight [sum N_i, K] (GPTQ treats output rows independently). Each group's input is captured
    after the groups before it were quantized (true-sequential), stopping the forward there."""
    from tinypaged.kernels.gptq_format import pack_gptq

    tensors, records = {}, []
    for name, _, linears, _ in _scale_groups(layer, config):
        H = gptq_quant.hessian(_input_of(layer, linears[0], hidden, kwargs))
        w = torch.cat([m.weight.float() for m in linears])  # [sum N_i, K]
        q, zeros, scales, g_idx = gptq_quant.gptq_quantize(w, H, bits, group_size, sym,
                                                           act_order, damp, clip)
        wq = gptq_quant.dequantize(q, zeros, scales, g_idx)  # [sum N_i, K]
        rtn = gptq_quant.rtn_dequantize(w, bits, group_size, sym)
        records.append({"layer": prefix, "group": name,
                        "error": gptq_quant.output_error(w - wq, H),
                        "rtn_error": gptq_quant.output_error(w - rtn, H)})
        row = 0
        for m in linears:
            n = m.weight.shape[0]
            m.weight.copy_(wq[row:row + n])  # later groups and layers see the quantized outputs
            packed = pack_gptq(q[:, row:row + n], zeros[:, row:row + n], scales[:, row:row + n],
                               g_idx.clone(), bits, 1)  # one tensor per linear
            path = f"{prefix}.{_module_name(layer, m)}"
            tensors.update({f"{path}.{k}": v.cpu() for k, v in packed.items()})
            row += n
    out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out, tensors, records


def _module_name(root: torch.nn.Module, module: torch.nn.Module) -> str:
    return next(n for n, m in root.named_modules() if m is module)


def calibration_ids(tokenizer, num_samples: int, seq_len: int) -> torch.Tensor:
    """The shipped calibration text as [num_blocks, seq_len] token ids (fewer blocks if short)."""
    text = resources.files("tinypaged").joinpath("data/calibration.txt").read_text("utf-8")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    num_blocks = min(num_samples, len(ids) // seq_len)
    if num_blocks == 0:
        raise ValueError(f"--calib-seq-len {seq_len} is longer than the calibration text "
                         f"({len(ids)} tokens); pass a smaller --calib-seq-len")
    return torch.tensor(ids[: num_blocks * seq_len]).view(num_blocks, seq_len)


# ---------------------------------------------------------------------------- checkpoint
def _check_model(config, model_dir: Path, group_size: int) -> None:
    if getattr(config, "quantization_config", None):
        raise ValueError(f"{model_dir} is already quantized ({config.quantization_config}); "
                         "pass the unquantized model")
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"tinypaged quantize supports model types {SUPPORTED_MODEL_TYPES}; "
                         f"{model_dir} is {config.model_type!r}")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    in_features = {config.hidden_size, heads * head_dim, config.intermediate_size}
    fits = [g for g in SUPPORTED_GROUP_SIZES if all(k % g == 0 for k in in_features)]
    if group_size != -1 and group_size not in fits:
        raise ValueError(f"--group-size {group_size} does not divide the input sizes "
                         f"{sorted(in_features)} of {model_dir.name}'s linears; use one of {fits}")


def _write_checkpoint(model, tensors: dict, src_dir: Path, out_dir: Path,
                      quantization_config: dict):
    from safetensors.torch import save_file

    src_config = json.loads((src_dir / "config.json").read_text())
    dtype_name = src_config.get("torch_dtype") or src_config.get("dtype")
    dtype = getattr(torch, dtype_name) if isinstance(dtype_name, str) else model.dtype
    embed = model.get_input_embeddings().weight
    for name, t in model.state_dict().items():
        module, kind = name.rsplit(".", 1)
        if kind == "weight" and f"{module}.qweight" in tensors:
            continue  # the fp weight of a quantized linear (its bias stays)
        if name.startswith("lm_head.") and t.data_ptr() == embed.data_ptr():
            continue  # tied to the embeddings: checkpoints store it once
        tensors[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous().cpu()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    src_config["quantization_config"] = quantization_config
    (out_dir / "config.json").write_text(json.dumps(src_config, indent=2) + "\n")
    for pattern in _COPY_PATTERNS:
        for f in src_dir.glob(pattern):
            shutil.copy2(f, out_dir / f.name)


def quantize(model: str | Path, out: str | Path, group_size: int = 128,
             calib_samples: int = 128, calib_seq_len: int = 512, n_grid: int = 20,
             clip: bool = True, device: str | None = None, method: str = "awq", bits: int = 4,
             sym: bool = True, act_order: bool = False, damp: float = 0.01) -> list[dict]:
    """Write the AWQ (or GPTQ: bits, sym, act_order, damp) checkpoint of `model` to `out`;
    returns one record per linear group ({layer, group, error, rtn_error}, AWQ adds alpha)."""
    from tqdm import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from tinypaged.models.gguf_file import dense_state_dict, gguf_file_of
    from tinypaged.models.loader import resolve_model

    if method not in ("awq", "gptq"):
        raise ValueError(f"--method must be 'awq' or 'gptq', got {method!r}")
    gptq_sizes = (*SUPPORTED_GROUP_SIZES, -1)
    if group_size not in (gptq_sizes if method == "gptq" else SUPPORTED_GROUP_SIZES):
        raise ValueError(f"--group-size {group_size} is not supported with --method {method}; "
                         f"use one of {gptq_sizes if method == 'gptq' else SUPPORTED_GROUP_SIZES}")
    if bits not in ((4, 8) if method == "gptq" else (4,)):
        raise ValueError(f"--bits {bits} is not supported with --method {method}; AWQ writes 4 "
                         "bits, GPTQ 4 or 8")
    if n_grid < 1:
        raise ValueError(f"--n-grid must be at least 1 (1 = plain round-to-nearest), got {n_grid}")
    src_dir, out_dir = resolve_model(str(model)), Path(out)
    if (out_dir / "config.json").exists():
        raise ValueError(f"{out_dir} already holds a model (config.json); pass a new directory")
    config = AutoConfig.from_pretrained(src_dir)
    from_gguf = gguf_file_of(src_dir) is not None  # a .gguf (the default model): dequantized
    if from_gguf:
        config.quantization_config = None
    _check_model(config, src_dir, group_size)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    # CPU matmuls are slow and inexact in half precision; on GPU keep the checkpoint's dtype
    dtype = torch.float32 if device.type == "cpu" else "auto"
    if from_gguf:
        hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        hf_model.load_state_dict(dense_state_dict(src_dir), strict=False)
        hf_model.tie_weights()
    else:
        hf_model = AutoModelForCausalLM.from_pretrained(src_dir, dtype=dtype)
    hf_model = hf_model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(src_dir)
    input_ids = calibration_ids(tokenizer, calib_samples, calib_seq_len).to(device)
    print(f"tinypaged quantize: {src_dir.name}, group size {group_size}, calibrating on "
          f"{input_ids.shape[0]} x {input_ids.shape[1]} tokens on {device}", file=sys.stderr)

    with torch.no_grad():
        hidden, kwargs = _layer0_inputs(hf_model, input_ids)
    tensors, records = {}, []
    layers = hf_model.model.layers
    for i in tqdm(range(len(layers)), desc=f"{method.upper()} layers", unit="layer"):
        if method == "gptq":
            hidden, layer_tensors, infos = _gptq_layer(
                layers[i], hidden, kwargs, hf_model.config, bits, group_size, sym, act_order,
                damp, clip, f"model.layers.{i}")
        else:
            hidden, layer_tensors, infos = _quantize_layer(
                layers[i], hidden, kwargs, hf_model.config, group_size, n_grid, clip,
                f"model.layers.{i}")
        tensors.update(layer_tensors)
        records.extend(infos)
    if method == "gptq":  # AutoGPTQ's "gptq" checkpoint format (qzeros hold zero - 1)
        qconfig = {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                   "desc_act": act_order, "sym": sym, "damp_percent": damp,
                   "checkpoint_format": "gptq"}
    else:
        qconfig = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                   "zero_point": True, "version": "gemm", "modules_to_not_convert": None}
    _write_checkpoint(hf_model, tensors, src_dir, out_dir, qconfig)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tinypaged quantize",
        description="Write an AutoAWQ-format int4 (or with --method gptq an AutoGPTQ-format "
                    "int4 / int8) checkpoint of a Llama / Mistral / Qwen2 / Qwen3 model, "
                    "calibrated on the shipped text.")
    parser.add_argument("model", help="Hugging Face model directory, .gguf file or hub id")
    parser.add_argument("out", help="directory to write the quantized checkpoint to")
    parser.add_argument("--method", default="awq", choices=["awq", "gptq"])
    parser.add_argument("--group-size", type=int, default=128,
                        choices=(*SUPPORTED_GROUP_SIZES, -1), help="-1: per channel (GPTQ)")
    parser.add_argument("--bits", type=int, default=4, choices=[4, 8], help="8: GPTQ only")
    parser.add_argument("--act-order", action="store_true",
                        help="GPTQ: quantize inputs by decreasing Hessian diagonal (desc_act)")
    parser.add_argument("--sym", action=argparse.BooleanOptionalAction, default=True,
                        help="GPTQ: symmetric (zero point 2^(bits-1)) or min-max groups")
    parser.add_argument("--damp-percent", type=float, default=0.01,
                        help="GPTQ: Hessian dampening, a fraction of its mean diagonal")
    parser.add_argument("--calib-samples", type=int, default=128,
                        help="calibration blocks (at most what the shipped text holds)")
    parser.add_argument("--calib-seq-len", type=int, default=512, help="tokens per block")
    parser.add_argument("--n-grid", type=int, default=20,
                        help="alpha values searched per linear group; 1 = round-to-nearest only")
    parser.add_argument("--no-clip", action="store_true",
                        help="skip the search for per-group weight clipping ranges (AWQ, GPTQ)")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    args = parser.parse_args(argv)
    try:
        records = quantize(args.model, args.out, args.group_size, args.calib_samples,
                           args.calib_seq_len, args.n_grid, not args.no_clip, args.device,
                           args.method, args.bits, args.sym, args.act_order, args.damp_percent)
    except (ValueError, FileNotFoundError) as e:
        print(f"tinypaged quantize: error: {e}", file=sys.stderr)
        return 1
    error = sum(r["error"] for r in records)
    rtn_error = sum(r["rtn_error"] for r in records)
    print(f"tinypaged quantize: wrote {args.out}; summed output error of the quantized linears "
          f"{error:.4g} vs {rtn_error:.4g} with plain round-to-nearest", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
