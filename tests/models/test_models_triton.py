"""Whole models through the real Triton kernels, under the Triton interpreter on CPU.

TRITON_INTERPRET must be set before triton is imported, so the models run in a child process:
the parent builds tiny random models with transformers and saves their weights, prompts and
reference logits; the child (no transformers) loads them into tinypaged, checks that the ops
dispatch to Triton, runs a prefill of two prompts and one decode step through the paged cache,
and compares every logit row with transformers. Llama is the plain path; Qwen3-MoE's experts run
the fused MoE kernel; Gemma 2 adds sliding windows, attention soft-capping and GeGLU, Gemma 3
q/k norms and a local rotary base, Phi-3 the fused checkpoint projections and partial rotary
under a window.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.models import checkpoint_weights, greedy_reference, tiny_hf_model

pytest.importorskip("triton")

TESTS = Path(__file__).resolve().parents[1]  # tests/, for helpers

CHILD = r"""
import sys, types
import torch
from helpers.models import PagedRunner, assert_logits_close, build_model
from tinypaged.kernels._triton import use_triton

torch.set_num_threads(1)
assert use_triton(torch.empty(0)), "the kernels would not dispatch to Triton"
for case in torch.load(sys.argv[1]):
    model = build_model(types.SimpleNamespace(**case["config"]), case["weights"])
    runner = PagedRunner(model, block_size=16, num_blocks=8, seed=3)
    prompts, refs, nexts, kind = case["prompts"], case["refs"], case["nexts"], case["kind"]
    seqs = [runner.add_sequence() for _ in prompts]
    out = runner.step(dict(zip(seqs, prompts)))
    for s, p in zip(seqs, prompts):
        assert_logits_close(out[s], refs[s][: len(p)], what=f"{kind} interpreted prefill")
    out = runner.step({s: [nexts[s]] for s in seqs})
    for s, p in zip(seqs, prompts):
        assert_logits_close(out[s], refs[s][len(p) : len(p) + 1], what=f"{kind} interpreted decode")
print("ok")
"""

# kind: layers (Gemma alternates sliding and global layers, so it needs two)
KINDS = {"llama": 1, "qwen3_moe": 1, "gemma2": 2, "gemma3": 2, "phi3": 1}


def test_tiny_models_through_triton_interpreter(tmp_path):
    prompts = [[3, 1, 4, 1, 5], list(range(10, 30))]  # the second crosses a 16-token block
    cases = []
    for kind, layers in KINDS.items():
        hf = tiny_hf_model(kind, num_hidden_layers=layers)
        refs = [greedy_reference(hf, p, 1) for p in prompts]
        cases.append({
            "kind": kind, "config": hf.config.to_dict(), "weights": checkpoint_weights(hf),
            "prompts": prompts, "refs": [logits for _, logits in refs],
            "nexts": [tokens[0] for tokens, _ in refs],
        })
    torch.save(cases, tmp_path / "cases.pt")
    root = TESTS.parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(root), str(TESTS), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "cases.pt")], env=env,
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
