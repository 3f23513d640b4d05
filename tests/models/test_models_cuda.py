"""Every architecture on a CUDA GPU with the Triton kernels, against transformers (GPU only).

The same flow as test_models.py (three prompts prefilled into a paged cache, then decode steps fed
transformers' greedy tokens), in two precisions:
- fp32: within 5e-3 relative of transformers' fp32 logits (Triton's fp32 `tl.dot` may use TF32);
- bf16: our error against the fp32 reference may be at most twice transformers' own bf16 error
  (plus 1% of the logit scale): "within bf16 tolerance" measured, not guessed.
"""

from __future__ import annotations

import pytest
import torch
from helpers.models import (
    HF_KINDS,
    PagedRunner,
    build_model,
    chatglm_checkpoint,
    checkpoint_weights,
    greedy_reference,
    tiny_hf_model,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPT_LENS = (5, 19, 35)
STEPS = 8


def run_ours(kind: str, hf, dtype: torch.dtype, prompts, refs) -> list[torch.Tensor]:
    """Our logits for every prompt position and decode step, per sequence, on cuda."""
    if kind == "chatglm":
        config, weights = chatglm_checkpoint(hf)
    else:
        config, weights = hf.config, checkpoint_weights(hf)
    model = build_model(config, weights, dtype=dtype, device="cuda")
    runner = PagedRunner(model, block_size=16, num_blocks=32, seed=1)
    seqs = [runner.add_sequence() for _ in prompts]
    out = runner.step(dict(zip(seqs, prompts)))
    rows = [[out[s].cpu()] for s in seqs]
    for i in range(STEPS):
        out = runner.step({s: [tokens[i]] for s, (tokens, _) in zip(seqs, refs)})
        for s in seqs:
            rows[s].append(out[s].cpu())
    return [torch.cat(r) for r in rows]  # [len + STEPS, vocab] each


@pytest.mark.parametrize("kind", [*HF_KINDS, "chatglm"])
def test_cuda_fp32_and_bf16_match_transformers(kind):
    hf = tiny_hf_model("glm" if kind == "chatglm" else kind, seed=11)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    refs = [greedy_reference(hf, p, STEPS) for p in prompts]  # fp32 on the CPU
    full = [torch.tensor([p + tokens]) for p, (tokens, _) in zip(prompts, refs)]

    ours32 = run_ours(kind, hf, torch.float32, prompts, refs)
    for got, (_, ref) in zip(ours32, refs):
        scale = ref.abs().max()
        assert (got - ref).abs().max() <= 5e-3 * scale, f"{kind} fp32 on cuda"

    ours16 = run_ours(kind, hf, torch.bfloat16, prompts, refs)  # weights rounded at load
    hf16 = hf.to("cuda", torch.bfloat16)  # in place: hf is not used after this
    with torch.no_grad():
        hf_errs = [(hf16(ids.cuda()).logits[0].float().cpu() - ref).abs().max()
                   for ids, (_, ref) in zip(full, refs)]
    for got, (_, ref), hf_err in zip(ours16, refs, hf_errs):
        err, scale = (got - ref).abs().max(), ref.abs().max()
        assert err <= 2 * hf_err + 1e-2 * scale, (
            f"{kind} bf16: ours {err:.3g} vs transformers' bf16 {hf_err:.3g} (scale {scale:.3g})"
        )

