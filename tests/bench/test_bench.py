"""`tinypaged bench`: the workload recipe, the roofline arithmetic, and each mode end to end on a
tiny model on the CPU (the speed itself is measured on the GPU, not here)."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from helpers.server import build_tiny_model, running_server

from tinypaged import AsyncLLM
from tinypaged.bench.offline import SHAPES, main, roofline_seconds, sample_requests, warmup_requests
from tinypaged.entrypoints.openai.api_server import build_app


def test_warmup_prompts_share_no_block_with_the_measured_ones():
    measured = {tuple(p[:16]) for p in sample_requests(256, 100, 1024, 151936)}
    assert not measured & {tuple(p[:16]) for p in warmup_requests(100, 1024, 151936)}


def test_requests_follow_the_recipe():
    # ENVIRONMENT.md: Random(0); per request randint(100, 1024), then that many randrange ids.
    rng = random.Random(0)
    expected = []
    for _ in range(5):
        n = rng.randint(100, 1024)
        expected.append([rng.randrange(1000, 151936 - 1000) for _ in range(n)])
    assert sample_requests(5, 100, 1024, 151936) == expected


def test_roofline_terms():
    cfg = dict(SHAPES["llama3-8b"])
    prefill_only = roofline_seconds(cfg, [1000], 0)
    # 2 * params * tokens + causal attention, over 790 TFLOP/s: about 0.02 s for 1000 tokens.
    assert 0.015 < prefill_only < 0.03
    one_step = roofline_seconds(cfg, [1000], 1) - prefill_only
    weight_bytes = 2 * 8.03e9  # Llama-3-8B, untied
    kv_bytes = 1000 * 2 * 32 * 8 * 128 * 2
    assert one_step == pytest.approx((weight_bytes + kv_bytes) / 4.2e12, rel=0.01)


def test_moe_roofline_reads_only_the_experts_hit():
    cfg = dict(SHAPES["qwen3-30b-a3b"])
    h, per_expert = 2048, 3 * 2048 * 768
    attn = h * 128 * (32 + 2 * 4) + 32 * 128 * h
    steps = {n: roofline_seconds(cfg, [1000] * n, 1) - roofline_seconds(cfg, [1000] * n, 0)
             for n in (1, 256)}
    kv = 1000 * 2 * 48 * 4 * 128 * 2
    lm = 2 * 151936 * h  # LM head and the (untied) embedding table
    # one sequence: the router and 8 experts per layer; 256: every expert (1 - (1 - 1/16)^256)
    for n, experts in ((1, 8), (256, 128)):
        layer = attn + h * 128 + experts * per_expert
        weight_bytes = 2 * (48 * layer + lm)
        assert steps[n] == pytest.approx((weight_bytes + n * kv) / 4.2e12, rel=1e-3)
    # prefill multiplies by the 3.3B active parameters, not the 30.5B
    active = 48 * (attn + h * 128 + 8 * per_expert) + 151936 * h
    prefill = roofline_seconds(cfg, [1000], 0)
    assert prefill == pytest.approx((2 * active * 1000 + 2 * 48 * 32 * 128 * 1000**2) / 790e12,
                                    rel=1e-6)


def test_qwen3_30b_a3b_shape_has_its_parameter_count():
    import torch

    from tinypaged.bench.offline import shape_dir
    from tinypaged.models.loader import load_hf_config
    from tinypaged.models.qwen_moe import Qwen3MoeForCausalLM

    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(load_hf_config(shape_dir("qwen3-30b-a3b")))
    total = sum(p.numel() for p in model.parameters())
    assert 30.4e9 < total < 30.6e9  # Qwen3-30B-A3B: 30.5B parameters
    assert model.model.layers[47].mlp.experts.w13_weight.shape == (128, 2 * 768, 2048)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench-model")
    build_tiny_model(path)  # vocab of the default tokenizer: room for randrange(1000, V - 1000)
    return path


def test_throughput_and_latency_on_cpu(tiny_dir, tmp_path):
    common = ["--model-shape", str(tiny_dir), "--dtype", "float32", "--output-len", "4",
              "--max-model-len", "256"]
    out = main(["throughput", *common, "--num-prompts", "6", "--min-input-len", "5",
                "--max-input-len", "40", "--json", str(tmp_path / "t.json")])
    assert out["requests"] == 6 and out["output_tokens"] == 24
    # the warm-up ran prompts of its own: nothing of the measured run was in the prefix cache
    assert out["cached_prompt_tokens"] == 0
    assert out["output_tok_s"] > 0 and out["roofline_fraction"] > 0
    assert json.loads((tmp_path / "t.json").read_text())["output_tokens"] == 24
    lat = main(["latency", *common, "--input-len", "16", "--batch-sizes", "1", "2",
                "--cudagraph-mode", "FULL_DECODE_ONLY"])
    assert set(lat) == {1, 2}
    assert [r["decode_tokens"] for r in lat.values()] == [3, 6]  # all but each first token
    assert all(r["tok_s_per_seq"] > 0 and r["GB_s"] > 0 for r in lat.values())


def test_serve_mode_against_a_server(tiny_dir, tmp_path):
    engine = AsyncLLM(str(tiny_dir), dtype="float32", max_model_len=256, num_kv_blocks=200)
    try:
        with running_server(build_app(engine)) as url:
            out = main(["serve", "--base-url", url, "--num-prompts", "4", "--request-rate", "50",
                        "--random-input-len", "8", "--random-output-len", "5", "--ignore-eos",
                        "--save-result", "--result-dir", str(tmp_path),
                        "--result-filename", "serve.json"])
    finally:
        asyncio.run(engine.shutdown())
    assert out["completed"] == 4 and out["failed"] == 0
    assert out["total_output_tokens"] == 20 and out["total_input_tokens"] == 32
    assert out["request_throughput"] > 0 and out["output_throughput"] > 0
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < out[f"median_{name}_ms"] <= out[f"p99_{name}_ms"]
    assert out["mean_ttft_ms"] < out["mean_e2el_ms"]
    assert json.loads((tmp_path / "serve.json").read_text())["output_lens"] == [5] * 4
