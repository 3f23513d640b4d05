"""The offline AWQ quantizer on tiny random models: rounding, the scale and clip searches, the
exactness of folding the scales, and the AutoAWQ checkpoint `tinypaged quantize` writes."""

import json
import re

import pytest
import torch
from helpers.models import (  # noqa: F401  (autouse fixture)
    save_byte_tokenizer,
    single_thread,
    tiny_hf_model,
)
from helpers.quantize import LINEARS, dequantize, save_tiny  # noqa: F401
from safetensors.torch import load_file

from tinypaged.kernels.awq import unpack_awq
from tinypaged.quantization import awq_search as S
from tinypaged.quantization import quantize as Q


def expected_rtn(w, group_size):
    """Round-to-nearest written out group by group (AutoAWQ's rule, the range holding 0):
    (q [N, K], zeros [N, K/G], scales [N, K/G])."""
    N, K = w.shape
    q = torch.empty(N, K)
    zeros, scales = torch.empty(N, K // group_size), torch.empty(N, K // group_size)
    for n in range(N):
        for g in range(K // group_size):
            cols = slice(g * group_size, (g + 1) * group_size)
            chunk = w[n, cols]
            lo, hi = min(chunk.min().item(), 0.0), max(chunk.max().item(), 0.0)
            scale = float(torch.tensor(max(hi - lo, 1e-5) / 15).half())  # stored as fp16
            zero = min(max(round(-lo / scale), 0), 15)
            q[n, cols] = ((chunk / scale).round() + zero).clamp(0, 15)
            zeros[n, g], scales[n, g] = zero, scale
    return q, zeros, scales


def test_quantize_rtn_matches_autoawq_rounding():
    w = torch.randn(16, 96, generator=torch.Generator().manual_seed(0))
    w[3, :32] = 0.5  # all positive: the range is widened to [0, 0.5]
    w[4, 32:64] = 0.0  # all zero: the range clamps at 1e-5
    qweight, qzeros, scales = S.quantize_rtn(w, 32)
    assert (qweight.dtype, qweight.shape) == (torch.int32, (96, 2))
    assert (qzeros.dtype, qzeros.shape) == (torch.int32, (3, 2))
    assert (scales.dtype, scales.shape) == (torch.float16, (3, 16))
    q, zeros, s = expected_rtn(w, 32)
    got_q, got_z = unpack_awq(qweight, qzeros)
    assert torch.equal(got_q.t().float(), q) and torch.equal(got_z.t().float(), zeros)
    assert torch.equal(scales.t().float(), s)
    # the integer zero point shifts the grid by up to half a step, so a weight comes back within
    # one step (half a step inside the range, up to one at its ends)
    deq = dequantize({"l.qweight": qweight, "l.qzeros": qzeros, "l.scales": scales}, "l", 32)
    step = s.repeat_interleave(32, 1)
    assert ((deq - w).abs() <= step + 1e-6).all()
    assert (deq - w).abs().mean() < 0.3 * step.mean()


def test_scale_search_beats_round_to_nearest_on_outlier_channels():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(512, 128, generator=gen)
    x[:, :6] *= 40  # a few channels with large activations, as in real LLMs
    w = torch.randn(64, 128, generator=gen) * 0.1
    s, info = S.search_scales(x, [w], 32, n_grid=20)
    assert info["alpha"] > 0 and info["error"] < 0.5 * info["rtn_error"]
    error = ((x / s) @ S.fake_quantize(w * s, 32).t() - x @ w.t()).pow(2).mean()
    torch.testing.assert_close(error.item(), info["error"], rtol=1e-4, atol=0)
    rtn = (x @ S.fake_quantize(w, 32).t() - x @ w.t()).pow(2).mean()
    torch.testing.assert_close(rtn.item(), info["rtn_error"], rtol=1e-4, atol=0)
    # GQA: the factors of query heads sharing a KV head (2 KV heads x 2 queries x head_dim 32)
    s, _ = S.search_scales(x, [w], 32, n_grid=5, kv_heads=(2, 2, 32))
    per_head = s.view(2, 2, 32)
    assert torch.equal(per_head[:, 0], per_head[:, 1])


def test_clip_search_lowers_output_error():
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(256, 128, generator=gen), torch.randn(48, 128, generator=gen)
    clip = S.search_clip(x, w, 32)
    assert clip.shape == (48, 4) and clip.min() >= 0.5 and clip.max() <= 1 and clip.min() < 1
    # brute force: every ratio on the grid, each group's share of the output error on its own
    best_error, best = torch.full((48, 4), float("inf")), torch.ones(48, 4)
    for i in range(20):
        ratio = torch.full((48, 4), 1 - 0.5 * i / 20)
        d = S.fake_quantize(w, 32, ratio) - w
        error = torch.stack([(x[:, g * 32:(g + 1) * 32] @ d[:, g * 32:(g + 1) * 32].t())
                             .pow(2).sum(0) for g in range(4)], dim=1)  # [48, 4]
        best, best_error = torch.where(error < best_error, ratio, best), error.minimum(best_error)
    assert torch.equal(clip, best)
    ref = x @ w.t()
    clipped = (x @ S.fake_quantize(w, 32, clip).t() - ref).pow(2).mean()
    plain = (x @ S.fake_quantize(w, 32).t() - ref).pow(2).mean()
    assert clipped < 0.95 * plain


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_folded_scales_keep_full_precision_logits(kind):
    """Scaling the linears and folding 1/s into norms / v_proj / up_proj changes nothing in fp32
    (qwen2 brings biases, qwen3 per-head q/k norms, all three GQA)."""
    model = tiny_hf_model(kind)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        hidden, kwargs = Q._layer0_inputs(model, ids)
        norms_before = [layer.input_layernorm.weight.clone() for layer in model.model.layers]
        for layer in model.model.layers:
            groups = Q._scale_groups(layer, model.config)
            inputs, hidden = Q._capture_inputs(layer, groups, hidden, kwargs)
            work, records = Q.scale_layer(groups, inputs, 32, n_grid=4)
            assert all(r["alpha"] > 0 for r in records)  # every fold below is really exercised
            for m, w in work.items():
                m.weight.copy_(w)
        out = model(input_ids=ids).logits
    assert any(not torch.equal(a, layer.input_layernorm.weight)
               for a, layer in zip(norms_before, model.model.layers))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    return save_tiny("llama", path), path


def run_cli(src, out, *extra):
    args = [str(src), str(out), "--group-size", "32", "--calib-samples", "4",
            "--calib-seq-len", "64", *extra]
    assert Q.main(args) == 0
    return load_file(str(out / "model.safetensors")), json.loads((out / "config.json").read_text())


def test_cli_writes_an_autoawq_checkpoint(tiny_llama, tmp_path):
    model, src = tiny_llama
    tensors, config = run_cli(src, tmp_path / "awq", "--n-grid", "4", "--no-clip")
    assert config["quantization_config"] == {
        "quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
        "version": "gemm", "modules_to_not_convert": None}
    assert config["hidden_size"] == 64 and config["architectures"] == ["LlamaForCausalLM"]
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "awq" / name).is_file()

    original = model.state_dict()
    expected_keys = {k for k in original if not k.startswith("lm_head.")}  # tied: stored once
    for i in range(2):
        for linear in LINEARS:
            p = f"model.layers.{i}.{linear}"
            N, K = original[p + ".weight"].shape
            expected_keys = (expected_keys - {p + ".weight"}) | {
                p + ".qweight", p + ".qzeros", p + ".scales"}
            assert (tensors[p + ".qweight"].dtype, tensors[p + ".qweight"].shape) == (
                torch.int32, (K, N // 8))
            assert (tensors[p + ".qzeros"].dtype, tensors[p + ".qzeros"].shape) == (
                torch.int32, (K // 32, N // 8))
            assert (tensors[p + ".scales"].dtype, tensors[p + ".scales"].shape) == (
                torch.float16, (K // 32, N))
    assert set(tensors) == expected_keys
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        assert torch.equal(tensors[name], original[name])

    # q/k and gate read norm(h) * weight: the factors s are the ratio of the norm weights, and
    # each holds round-to-nearest of W * s (within one step, see above). (v and up also hold
    # o's and down's factors in their rows; test_folded_scales_keep_full_precision_logits.)
    # (A grid point of alpha = 0 gives s = 1 for a group; on this tiny random model that can win
    # for some groups, depending on float rounding, so only "some group moved" is asserted.)
    moved = []
    for i in range(2):
        p = f"model.layers.{i}."
        for norm, linears in (("input_layernorm", LINEARS[:2]),
                              ("post_attention_layernorm", LINEARS[4:5])):
            s = original[p + norm + ".weight"] / tensors[p + norm + ".weight"]
            moved.append(not torch.allclose(s, torch.ones_like(s)))
            for linear in linears:
                w = original[p + linear + ".weight"] * s
                step = tensors[p + linear + ".scales"].float().t().repeat_interleave(32, 1)
                assert ((dequantize(tensors, p + linear, 32) - w).abs() <= step * 1.001).all()
    assert any(moved)


def test_one_grid_point_without_clipping_is_plain_round_to_nearest(tiny_llama, tmp_path):
    model, src = tiny_llama
    tensors, _ = run_cli(src, tmp_path / "rtn", "--n-grid", "1", "--no-clip")
    original = model.state_dict()
    for i in range(2):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            assert torch.equal(tensors[p + norm + ".weight"], original[p + norm + ".weight"])
        for linear in LINEARS:
            q, zeros, scales = expected_rtn(original[p + linear + ".weight"], 32)
            torch.testing.assert_close(
                dequantize(tensors, p + linear, 32),
                ((q.view(q.shape[0], -1, 32) - zeros[..., None]) * scales[..., None]).flatten(1),
                rtol=0, atol=0)


def test_clipping_changes_only_what_the_search_picked(tiny_llama, tmp_path):
    _, src = tiny_llama
    plain, _ = run_cli(src, tmp_path / "plain", "--n-grid", "1", "--no-clip")
    clipped, _ = run_cli(src, tmp_path / "clip", "--n-grid", "1")
    for i in range(2):
        p = f"model.layers.{i}."
        for linear in LINEARS:
            same = torch.equal(plain[p + linear + ".qweight"], clipped[p + linear + ".qweight"])
            # q/k stay unclipped; a random linear always has some group worth clipping
            assert same == (linear in LINEARS[:2])


def test_rejects_what_it_cannot_quantize(tiny_llama, tmp_path, capsys):
    _, src = tiny_llama
    glm = tmp_path / "glm"
    save_tiny("glm", glm)
    done = tmp_path / "done"
    run_cli(src, done, "--n-grid", "1", "--no-clip")
    cases = [
        ([src, tmp_path / "a", "--group-size", "128"], r"does not divide the input sizes \[64, "),
        ([glm, tmp_path / "b"], "supports model types.*'glm'"),
        ([src, done], "already holds a model"),
        ([done, tmp_path / "d"], "already quantized"),
        ([src, tmp_path / "e", "--calib-seq-len", "100000"], "--calib-seq-len 100000 is longer"),
        ([tmp_path / "nowhere", tmp_path / "f"], "does not exist"),
    ]
    for args, match in cases:
        capsys.readouterr()
        assert Q.main([str(a) for a in args] + (["--group-size", "32"] if "--group-size" not in
                                                 args else [])) == 1
        assert re.search(match, capsys.readouterr().err), match
    with pytest.raises(ValueError, match="--n-grid must be at least 1"):
        Q.quantize(src, tmp_path / "g", group_size=32, n_grid=0)
