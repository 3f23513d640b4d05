"""GPU correctness check, run before any timing: bf16 greedy agreement with transformers.

For each architecture a tiny random model (tinypaged/bench/tiny_models.py's `save_tiny`, the tests'
models: 2 layers, every parameter random, so a mis-loaded bias or norm cannot hide) runs through
tinypaged (Triton kernels, CUDA graphs) and through transformers on the same GPU in bf16. Prints,
per architecture, the fraction of prompts whose greedy tokens agree fully, the length of the common
prefix, and the max |logprob difference| of the first step.

    PYTHONPATH=. python benchmarks/gpu_check.py [--kinds llama qwen3 ...] [--eager]

`--head-dim 128 --max-prompt 200` gives every kind 128-wide heads and prompts of up to 200
tokens: the shapes the Gluon prefill kernel takes (TINYPAGED_PREFILL_ATTENTION=gluon, the
default on Hopper; =triton for the other kernel).
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import torch

from tinypaged import LLM, SamplingParams
from tinypaged.bench.tiny_models import save_tiny

# Every architecture but two of tiny_models.HF_KINDS: llama_untied adds nothing on a GPU, and
# Phi-3's longrope is left to tests/models/test_models_cuda.py: these prompts outgrow its short
# original context, past which transformers re-rotates the whole sequence with the long factors.
KINDS = ["llama", "llama3_scaling", "qwen2", "qwen3", "glm", "glm4", "chatglm", "qwen2_moe",
         "qwen3_moe", "glm4_moe", "mistral", "qwen2_sliding", "gemma2", "gemma3", "phi3",
         "qwen3_yarn", "llama_dynamic"]


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    ids = torch.tensor([prompt], device="cuda")
    first = None
    for _ in range(steps):
        logits = hf(ids).logits[0, -1].float()
        first = logits if first is None else first
        ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist(), first


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kinds", nargs="+", default=KINDS)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--reference", action="store_true", help="torch reference kernels")
    parser.add_argument("--head-dim", type=int, help="every kind's head_dim (default: its own)")
    parser.add_argument("--max-prompt", type=int, default=60, help="longest prompt (tokens)")
    args = parser.parse_args()
    if args.reference:  # locate a disagreement: kernels or the rest of the engine?
        import importlib

        for name in ("activation", "attention", "kv_cache", "moe", "norm", "rotary"):
            importlib.import_module(f"tinypaged.kernels.{name}").use_triton = lambda x: False
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 250) for _ in range(rng.randint(5, args.max_prompt))]
               for _ in range(8)]
    overrides = {"head_dim": args.head_dim} if args.head_dim else {}
    rows = []
    for kind in args.kinds:
        path = Path(tempfile.mkdtemp())
        hf = save_tiny(kind, path, **overrides).to("cuda", torch.bfloat16)
        llm = LLM(str(path), dtype="bfloat16", skip_tokenizer_init=True, num_kv_blocks=256,
                  enforce_eager=args.eager, max_num_seqs=16)
        params = SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True, logprobs=5)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        full, prefix, err = 0, [], 0.0
        for p, o in zip(prompts, outs):
            ref, first = hf_greedy(hf, p, args.steps)
            ours = o.outputs[0].token_ids
            full += ours == ref
            prefix.append(next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), len(ref)))
            ref_lp = torch.log_softmax(first, -1)
            first_step = o.outputs[0].logprobs[0]
            err = max(err, max(abs(v - ref_lp[t].item()) for t, v in first_step.items()))
        rows.append((kind, full, len(prompts), min(prefix), err))
    print("| arch | prompts fully equal | shortest common prefix | max logprob diff (step 1) |")
    print("|---|---|---|---|")
    for kind, full, n, pre, err in rows:
        print(f"| {kind} | {full}/{n} | {pre}/{args.steps} | {err:.3f} |")


if __name__ == "__main__":
    main()
