"""SmolLM2-135M held-out perplexity: fp32, round-to-nearest, AWQ and GPTQ checkpoints written by
`tinypaged quantize`, each dequantized into transformers (CPU is fine; a few minutes).

    PYTHONPATH=. python benchmarks/quant_perplexity.py [--group-size 32] [--methods awq,gptq-asym]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import load_file

from tinypaged import gptq_quant
from tinypaged import quantize as Q
from tinypaged.default_model import ensure_default_model
from tinypaged.kernels.awq import awq_dequantize_reference
from tinypaged.kernels.gptq_format import gptq_dequantize_reference


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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser()
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--methods", default="awq,gptq,gptq-asym,gptq-asym-act-order",
                        help="awq, gptq[-asym][-act-order] (GPTQ is symmetric unless -asym)")
    parser.add_argument("--calib-samples", type=int, default=16)
    parser.add_argument("--calib-seq-len", type=int, default=512)
    args = parser.parse_args()
    src = ensure_default_model()
    text = resources.files("tinypaged").joinpath("data/heldout.txt").read_text("utf-8")
    ids = torch.tensor(AutoTokenizer.from_pretrained(src)(text)["input_ids"])
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    results = {"fp32": perplexity(model, ids)}
    model.load_state_dict({k: gptq_quant.rtn_dequantize(v, 4, args.group_size, False)
                           if k.endswith("_proj.weight") else v for k, v in original.items()})
    results["rtn"] = perplexity(model, ids)
    for method in args.methods.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / method
            extra = {"n_grid": 10} if method == "awq" else {
                "method": "gptq", "act_order": "act-order" in method, "sym": "asym" not in method}
            Q.quantize(src, out, group_size=args.group_size, calib_samples=args.calib_samples,
                       calib_seq_len=args.calib_seq_len, **extra)
            model.load_state_dict(original)
            model.load_state_dict(dequantized_state(out), strict=False)
            results[method] = perplexity(model, ids)
    base = results["fp32"]
    for name, ppl in results.items():
        print(f"{name:16s} {ppl:8.3f}  {100 * (ppl / base - 1):+6.1f}%")
    print(json.dumps({"group_size": args.group_size, **results}))


if __name__ == "__main__":
    main()
