"""Write a bf16 safetensors copy of a GGUF model folder (the default model's unless named), its
weights dequantized by transformers' GGUF reader, not by tinypaged: the same real weights for
a comparison with an engine whose GGUF path cannot be trusted on that model (vLLM 0.20.2's
output on the default model's Q4_1 GGUF turns to one repeated token from its first multi-row
step; benchmarks/RESULTS.md, Speculative decoding).

    python benchmarks/gguf_to_bf16.py OUT_DIR [--model DIR]
    PYTHONPATH=. python benchmarks/spec_decode_ngram.py OUT_DIR     # then --engine vllm

Needs the `gguf` package (tinypaged's [gguf] extra). OUT_DIR gets model.safetensors (the
tied LM head stored once), the folder's config.json without its quantization_config and with
torch_dtype bfloat16, and its tokenizer and generation files.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
          "generation_config.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", type=Path, default=None,
                        help="a folder with one .gguf and its config (default: the default model)")
    args = parser.parse_args()
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    if args.model is None:
        from tinypaged.models.default_model import ensure_default_model

        args.model = ensure_default_model()
    gguf = sorted(args.model.glob("*.gguf"))
    if len(gguf) != 1:
        raise SystemExit(f"{args.model}: expected one .gguf file, found {len(gguf)}")
    model = AutoModelForCausalLM.from_pretrained(args.model, gguf_file=gguf[0].name,
                                                 dtype=torch.bfloat16)
    weights = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    config = json.loads((args.model / "config.json").read_text())
    if config.get("tie_word_embeddings"):
        weights.pop("lm_head.weight", None)
    config.pop("quantization_config", None)
    config["torch_dtype"] = "bfloat16"
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in COPIED:
        if (args.model / name).exists():
            shutil.copy(args.model / name, args.out / name)
    print(f"{args.out}: {len(weights)} tensors, "
          f"{sum(v.numel() for v in weights.values()) / 1e6:.1f} M parameters in bf16")


if __name__ == "__main__":
    main()
