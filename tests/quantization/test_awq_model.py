"""AWQ checkpoints written by `tinypaged quantize`, loaded back through `load_model`: the model's
logits match transformers running the same checkpoint's dequantized weights."""

import pytest
import torch
from helpers.models import (  # noqa: F401  (single_thread: autouse fixture)
    PagedRunner,
    check_prefill_then_decode,
    greedy_reference,
    single_thread,
)
from helpers.quantize import (
    quantized_pair,  # noqa: F401
    )

from tinypaged.config import EngineConfig
from tinypaged.models.loader import load_model
from tinypaged.quantization.awq import AWQConfig

PROMPTS = [[5, 17, 99, 3, 250, 42, 7], list(range(11, 31))]
STEPS = 2


def check_against(model, hf_model):
    """Two prompts prefilled in one flat batch, then batched decode steps: every logit row."""
    check_prefill_then_decode(PagedRunner(model, block_size=4, num_blocks=32), hf_model,
                              PROMPTS, STEPS, what="awq")


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_quantized_checkpoint_matches_dequantized_transformers(kind, tmp_path):
    out, hf_model = quantized_pair(kind, tmp_path)
    model, hf_config, _ = load_model(EngineConfig(model=str(out)), "cpu")  # auto-detected
    assert hf_config.quantization_config["quant_method"] == "awq"
    names = {n for n, _ in model.named_parameters()}
    assert any(n.endswith("qkv_proj.qweight") for n in names)
    assert any(n.endswith("gate_up_proj.qzeros") for n in names)
    assert not any(n.endswith("_proj.weight") for n in names)  # no dense copy anywhere
    check_against(model, hf_model)


def test_forced_awq_through_the_triton_interpreter(tmp_path, monkeypatch):
    """quantization="awq" given explicitly, and every kernel (awq_gemm's GEMV for decode, its
    tiled GEMM for the 27-token prefill) run by Triton under the interpreter."""
    from tinypaged.kernels import awq

    out, hf_model = quantized_pair("llama", tmp_path)
    model, _, _ = load_model(EngineConfig(model=str(out), quantization="awq"), "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []

    def counted(name):
        launcher = getattr(awq, name)

        def run(x, *args, **kwargs):
            calls.append((name, x.shape[0]))
            return launcher(x, *args, **kwargs)
        return run

    for name in ("_awq_gemv", "_awq_gemm"):
        monkeypatch.setattr(awq, name, counted(name))
    check_against(model, hf_model)
    assert ("_awq_gemm", 27) in calls and ("_awq_gemv", 2) in calls


@pytest.mark.parametrize("change, match", [
    ({"version": "gemv"}, "version 'gemv'"),
    ({"zero_point": False}, "zero_point=false"),
    ({"bits": 8}, "bits=8"),
    ({"group_size": 96}, "group_size=96"),
    ({"quant_method": "gptq"}, "'gptq'"),
    ({"modules_to_not_convert": ["visual"]}, "modules_to_not_convert"),
])
def test_unsupported_awq_variants(change, match):
    base = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": None}
    assert AWQConfig.from_config(base) == AWQConfig(group_size=128)
    with pytest.raises(ValueError, match=match):
        AWQConfig.from_hf_config({**base, **change})


def test_layer_sizes_must_fit_the_packing():
    layer = torch.nn.Module()
    with pytest.raises(ValueError, match="96 input features"):
        AWQConfig(group_size=64).create_weights(layer, 96, 64, torch.float32)
    with pytest.raises(ValueError, match="60 output features"):
        AWQConfig(group_size=32).create_weights(layer, 64, 60, torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_quantized_checkpoint_on_cuda(dtype, tmp_path):
    """The GPU kernels in a model: prefill (tiled GEMM), a decode batch of three (the batched
    GEMV, tl.dot on bf16/fp16 magic-number weights) and single-sequence decode (the batch-1
    GEMV, with the layer's gemv_scales copy) against transformers' fp32 forward on the
    dequantized weights, within the precision of `dtype`."""
    out, hf_model = quantized_pair("llama", tmp_path)
    model, _, _ = load_model(EngineConfig(model=str(out), dtype=dtype), "cuda")
    runner = PagedRunner(model, block_size=4, num_blocks=64)
    prompts = PROMPTS + [list(range(40, 53))]
    refs = [greedy_reference(hf_model, p, 4) for p in prompts]  # (tokens, logits)

    def close(got, want, what):
        err = ((got.cpu() - want).norm() / want.norm()).item()
        assert err < 2e-2, f"{dtype} {what}: relative error {err:.1e}"

    seqs = [runner.add_sequence() for _ in prompts]
    out = runner.step(dict(zip(seqs, prompts)))
    for s, p, (_, ref) in zip(seqs, prompts, refs):
        close(out[s], ref[: len(p)], "prefill")
    for i in range(4):  # two steps of the three sequences, then sequence 0 alone
        batch = seqs if i < 2 else seqs[:1]
        out = runner.step({s: [refs[s][0][i]] for s in batch})
        for s in batch:
            close(out[s], refs[s][1][len(prompts[s]) + i : len(prompts[s]) + i + 1],
                  f"decode step {i} of {len(batch)} sequences")
    assert all(hasattr(m, "scales_t") for m in model.modules() if hasattr(m, "qweight"))
