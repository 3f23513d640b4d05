"""SmolLM2-135M held-out perplexity: fp32, round-to-nearest, AWQ and GPTQ checkpoints written by
`tinypaged quantize`, each dequantized into transformers (CPU is fine; a few minutes).

    PYTHONPATH=. python benchmarks/quant_perplexity.py [--group-size 32] [--methods awq,gptq-asym]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import load_file

from tinypaged.kernels.awq import awq_dequantize_reference
from tinypaged.kernels.gptq_format import gptq_dequantize_reference
from tinypaged.models.default_model import ensure_default_model
from tinypaged.quantization import gptq_quant
from tinypaged.quantization import quantize as Q


def perplexity(model, ids) -> float:
    with torch.no_grad():
        return math.exp(model(input_ids=ids[None], labels=ids[None]).loss.item())


def dequantized_state(out: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's linears dequantized to nn.Linear's [N, K], the other tensors as stored."""
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    tensors, state = load_file(str(out / "model.safetensors")), {}
    for name, t in tensors.items():
        if not name.endswith(".qweight"):
            if not name.endswith((".qzeros", ".scales", ".g_idx")):
                state[name] = t.float()
            continue
        p = name[: -len(".qweight")]
        if qconfig["quant_method"] == "awq":
            w = awq_dequantize_reference(t, tensors[p + ".qzeros"], tensors[p + ".scales"],
                                         qconfig["group_size"])
        else:
            w = gptq_dequantize_reference(t, tensors[p + ".qzeros"], tensors[p + ".scales"],
                                          tensors[p + ".g_idx"], qconfig["bits"], 1)
        state[p + ".weight"] = w.t()
    return state


def main() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from tinypaged.models.gguf_file import dense_state_dict

    parser = argparse.ArgumentParser()
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--methods", default="awq,gptq,gptq-asym,gptq-asym-act-order",
                        help="awq, gptq[-asym][-act-order][-clip] (GPTQ: symmetric unless -asym; "
                             "-clip searches group ranges)")
    parser.add_argument("--calib-samples", type=int, default=16)
    parser.add_argument("--calib-seq-len", type=int, default=512)
    parser.add_argument("--device", default=None, help="where to quantize (default: cuda if any)")
    args = parser.parse_args()
    src = ensure_default_model()
    text = resources.files("tinypaged").joinpath("data/heldout.txt").read_text("utf-8")
    ids = torch.tensor(AutoTokenizer.from_pretrained(src)(text)["input_ids"])
    config = AutoConfig.from_pretrained(src)
    config.quantization_config = None  # the default model is a GGUF: its blocks dequantized
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.load_state_dict(dense_state_dict(src), strict=False)
    model.tie_weights()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    results, fit, seconds = {"fp32": perplexity(model, ids)}, {}, {}
    model.load_state_dict({k: gptq_quant.rtn_dequantize(v, 4, args.group_size, False)
                           if k.endswith("_proj.weight") else v for k, v in original.items()})
    results["rtn"] = perplexity(model, ids)
    for method in args.methods.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / method
            extra = {"n_grid": 10} if method == "awq" else {
                "method": "gptq", "act_order": "act-order" in method, "sym": "asym" not in method,
                "clip": "clip" in method}
            start = time.perf_counter()
            records = Q.quantize(src, out, group_size=args.group_size,
                                 calib_samples=args.calib_samples,
                                 calib_seq_len=args.calib_seq_len, device=args.device, **extra)
            seconds[method] = time.perf_counter() - start
            # output error of the quantized linears on the calibration inputs, vs round-to-nearest
            fit[method] = sum(r["error"] for r in records) / sum(r["rtn_error"] for r in records)
            model.load_state_dict(original)
            model.load_state_dict(dequantized_state(out), strict=False)
            results[method] = perplexity(model, ids)
            print(f"{method}: perplexity {results[method]:.3f}, calibration error "
                  f"{fit[method]:.2f}x RTN, {seconds[method]:.0f} s", flush=True)
    base = results["fp32"]
    for name, ppl in results.items():
        extra = f"  calibration error {fit[name]:.2f}x RTN, {seconds[name]:.0f} s" \
            if name in fit else ""
        print(f"{name:20s} {ppl:8.3f}  {100 * (ppl / base - 1):+6.1f}%{extra}")
    print(json.dumps({"group_size": args.group_size, "calib_samples": args.calib_samples,
                      "calib_seq_len": args.calib_seq_len, **results}))


if __name__ == "__main__":
    main()
