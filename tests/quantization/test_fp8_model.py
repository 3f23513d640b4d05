"""FP8 checkpoints in each format (quant_method "fp8" per tensor, static or dynamic inputs, and
block-wise; compressed-tensors float-quantized per channel and per tensor), written here in the
format's layout, and one written by llm-compressor (data/): logits and greedy tokens match
transformers running the dequantized weights
(the CPU path is weight-only FP8 in fp32). The W8A8 path (the Triton kernels, interpreted) is
checked layer by layer, and quantize-at-load (`quantization="fp8"`) against the dense model."""

import json
from pathlib import Path

import pytest
import torch
from helpers.models import (  # noqa: F401  (single_thread: autouse fixture)
    PagedRunner,
    assert_logits_close,
    check_llm_greedy,
    check_prefill_then_decode,
    greedy_reference,
    single_thread,
)
from helpers.quantize import LINEARS, save_tiny
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from tinypaged import LLM
from tinypaged.config import EngineConfig
from tinypaged.kernels import dense_gemv
from tinypaged.kernels.dense_gemv import FP8_GEMV_MAX_M
from tinypaged.kernels.fp8 import FP8_MAX, dequantize_fp8
from tinypaged.models import layers
from tinypaged.models.loader import load_model
from tinypaged.quantization import fp8 as fp8_module
from tinypaged.quantization.fp8 import CompressedTensorsFp8Config, Fp8Config

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")
PROMPTS = [[5, 17, 99, 3, 250, 42, 7], list(range(11, 31))]
BLOCK_SHAPES = dict(hidden_size=128, intermediate_size=256, num_key_value_heads=4)  # whole blocks


def quantize(w, fmt):
    """w [N, K] -> {tensor name suffix: tensor} in the format's layout, and the dequantized w."""
    w = w.float()
    if fmt == "block":
        N, K = w.shape
        blocks = w.reshape(N // 128, 128, K // 128, 128)
        s = blocks.abs().amax((1, 3)) / FP8_MAX
        q = (blocks / s[:, None, :, None]).to(torch.float8_e4m3fn).reshape(N, K)
        return {"weight": q, "weight_scale_inv": s}, dequantize_fp8(q, s, (128, 128))
    s = w.abs().amax(1, keepdim=True) / FP8_MAX if fmt == "channel" else w.abs().amax() / FP8_MAX
    q = (w / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    scale = s if fmt == "channel" else s.reshape(1 if fmt == "ct-tensor" else ())
    return {"weight": q, "weight_scale": scale}, q.float() * s


def fp8_pair(tmp_path, fmt, kind="llama"):
    """(checkpoint dir, transformers model holding its dequantized weights). fmt: "tensor",
    "static" (per tensor, static inputs), "block" (quant_method fp8); "channel", "ct-tensor"
    (static inputs), "ct-block" (compressed-tensors)."""
    hf_model = save_tiny(kind, tmp_path, **(BLOCK_SHAPES if "block" in fmt else {}))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    state = {}
    for name in list(tensors):
        prefix = name[: -len(".weight")]
        if not any(prefix.endswith(linear) for linear in LINEARS):
            continue
        stored, state[name] = quantize(tensors.pop(name), {"static": "tensor",
                                                           "ct-block": "block"}.get(fmt, fmt))
        if fmt == "ct-block":  # compressed-tensors names the block scales weight_scale
            stored["weight_scale"] = stored.pop("weight_scale_inv")
        tensors.update({f"{prefix}.{k}": v for k, v in stored.items()})
        if fmt in ("static", "ct-tensor"):  # q/k/v differ: the layer takes the largest
            tensors[f"{prefix}.input_scale"] = torch.tensor(0.02 + 0.01 * ("k_proj" in prefix))
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    if fmt in ("tensor", "static", "block"):
        q = {"quant_method": "fp8", "fmt": "e4m3",
             "activation_scheme": "static" if fmt == "static" else "dynamic"}
        if fmt == "block":
            q["weight_block_size"] = [128, 128]
    else:
        static = fmt == "ct-tensor"
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                   "strategy": "tensor" if static else "channel"}
        inputs = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not static,
                  "strategy": "tensor" if static else "token"}
        if fmt == "ct-block":
            weights.update(strategy="block", block_structure=[128, 128])
            inputs.update(strategy="group", group_size=128)
        q = {"quant_method": "compressed-tensors", "format": "float-quantized",
             "ignore": ["lm_head"], "config_groups": {"group_0": {
                 "targets": ["Linear"], "weights": weights, "input_activations": inputs}}}
    config["quantization_config"] = q
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf_model.load_state_dict(state, strict=False)
    return tmp_path, hf_model


@pytest.mark.parametrize("fmt, kind", [("tensor", "llama"), ("static", "qwen2"),
                                       ("block", "qwen3"), ("channel", "llama"),
                                       ("ct-tensor", "qwen3"), ("ct-block", "qwen3")])
def test_checkpoint_matches_dequantized_transformers(tmp_path, fmt, kind):
    out, hf_model = fp8_pair(tmp_path, fmt, kind)
    model, _, _ = load_model(EngineConfig(model=str(out)), "cpu")  # format auto-detected
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn
    method = qkv.quant_config
    assert isinstance(method, CompressedTensorsFp8Config if fmt in ("channel", "ct-tensor",
                                                                    "ct-block") else Fp8Config)
    N = qkv.weight.shape[0]  # block-wise: one scale per 128 x 128 block (K = 128 here)
    assert qkv.weight_scale.shape == ((N // 128, 1) if method.block else (N, 1))
    if fmt in ("static", "ct-tensor"):
        assert qkv.input_scale.item() == pytest.approx(0.03)  # the largest of q, k, v
    check_prefill_then_decode(PagedRunner(model, block_size=4, num_blocks=32), hf_model,
                              PROMPTS, 2, what=f"fp8 {fmt}")


LLMCOMPRESSOR_FP8 = Path(__file__).parent / "data" / "llmcompressor_fp8_dynamic"


def test_llm_compressor_checkpoint_matches_dequantized_transformers():
    """A checkpoint llm-compressor itself wrote (FP8_DYNAMIC: data/make_llmcompressor_fp8.py) is
    detected as compressed-tensors FP8 with per-channel scales, and gives the logits and greedy
    tokens of transformers running its dequantized weights."""
    config = json.loads((LLMCOMPRESSOR_FP8 / "config.json").read_text())
    assert config.pop("quantization_config")["format"] == "float-quantized"
    hf_model = LlamaForCausalLM(LlamaConfig(**config)).float().eval()
    tensors = load_file(str(LLMCOMPRESSOR_FP8 / "model.safetensors"))
    hf_model.load_state_dict({  # w = q * scale, one scale per output row
        name: t.float() * tensors[name + "_scale"] if name + "_scale" in tensors else t.float()
        for name, t in tensors.items() if not name.endswith("_scale")}, strict=True)
    model, _, _ = load_model(EngineConfig(model=str(LLMCOMPRESSOR_FP8)), "cpu")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant_config, CompressedTensorsFp8Config)
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale.shape == (128, 1)
    check_prefill_then_decode(PagedRunner(model, block_size=4, num_blocks=32), hf_model,
                              PROMPTS, 2, what="llm-compressor FP8_DYNAMIC")


def test_llm_generates_the_dequantized_models_tokens(tmp_path):
    out, hf_model = fp8_pair(tmp_path, "block", "qwen3")
    llm = LLM(str(out), num_kv_blocks=64, block_size=16, max_model_len=128, quantization="fp8")
    check_llm_greedy(llm, hf_model, PROMPTS)


def test_quantize_at_load_is_close_to_the_dense_model(tmp_path):
    """quantization="fp8" on a dense checkpoint: per-channel FP8 weights. Its logits equal
    transformers' on the per-channel round-to-nearest FP8 weights, and are within 15% (relative
    L2; 8% measured) of the dense model's on this tiny random model (fp32 activations)."""
    hf_model = save_tiny("llama", tmp_path)
    model, _, _ = load_model(EngineConfig(model=str(tmp_path), quantization="fp8"), "cpu")
    down = model.model.layers[1].mlp.down_proj
    assert down.weight.dtype == torch.float8_e4m3fn and down.weight_scale.shape == (64, 1)
    runner = PagedRunner(model, block_size=4, num_blocks=32)
    out = next(iter(runner.step({runner.add_sequence(): PROMPTS[1]}).values()))
    ref = greedy_reference(hf_model, PROMPTS[1], 0)[1][: len(PROMPTS[1])]
    assert 0 < (out - ref).norm() / ref.norm() < 0.15
    state = {}
    for name, w in hf_model.state_dict().items():
        if any(name.endswith(f"{linear}.weight") for linear in LINEARS):
            state[name] = quantize(w, "channel")[1]
    hf_model.load_state_dict(state, strict=False)
    ref = greedy_reference(hf_model, PROMPTS[1], 0)[1][: len(PROMPTS[1])]
    assert_logits_close(out, ref, what="online fp8 vs its round-to-nearest weights")


@pytest.mark.parametrize("method", [Fp8Config(weight_scheme="tensor", static_input=True),
                                    Fp8Config(weight_scheme="block", block=(128, 128)),
                                    CompressedTensorsFp8Config(weight_scheme="channel")])
@pytest.mark.parametrize("rows", [1, 5, 20])
def test_w8a8_path_of_a_fused_layer(monkeypatch, method, rows):
    """The Triton path (interpreted): 20 rows W8A8 (activations quantized, the FP8 GEMM with the
    layer's scale layout), within 5% of x @ W^T with the dequantized weights, and so do 5 rows
    (past FP8_GEMV_MAX_M["w8a16"]); 1 row the W8A16 decode GEMV (activations as they are), as
    close as fp32 sums get."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(3)
    layer = layers.MergedColumnParallelLinear(256, [128, 256], quant_config=method)
    dense = []
    for shard, n in ((0, 128), (1, 256)):
        w = torch.randn(n, 256, generator=gen)
        fmt = {"tensor": "tensor", "block": "block", "channel": "channel"}[method.weight_scheme]
        stored, deq = quantize(w, fmt)
        dense.append(deq)
        for name, t in stored.items():
            getattr(layer, name).weight_loader(getattr(layer, name), t, shard)
        if method.static_input:
            layer.input_scale.weight_loader(layer.input_scale, torch.tensor(4.0 / FP8_MAX), shard)
    method.process_weights_after_loading(layer)
    x = torch.randn(rows, 256, generator=gen)
    ref = x @ torch.cat(dense).t()
    y = layer.matmul(x, None)
    assert (y - ref).norm() / ref.norm() < (0.05 if rows > FP8_GEMV_MAX_M["w8a16"] else 1e-5)
    monkeypatch.delenv("TRITON_INTERPRET")
    torch.testing.assert_close(layer.matmul(x, None), ref, rtol=1e-4, atol=1e-3)  # weight-only


def fp8_down_layer(method, gen) -> layers.RowParallelLinear:
    """A 256 -> 128 row-parallel FP8 layer of `method`, loaded as a checkpoint of its scheme
    holds it (or quantized at load) and processed."""
    layer = layers.RowParallelLinear(256, 128, quant_config=method)
    if method.from_dense:
        layer.weight.data.copy_(torch.randn(128, 256, generator=gen) * 0.05)
    else:
        stored, _ = quantize(torch.randn(128, 256, generator=gen), method.weight_scheme)
        for name, t in stored.items():
            getattr(layer, name).weight_loader(getattr(layer, name), t)
        if method.static_input:
            layer.input_scale.weight_loader(layer.input_scale, torch.tensor(4.0 / FP8_MAX))
    method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("method", [Fp8Config(weight_scheme="tensor", static_input=True),
                                    Fp8Config(weight_scheme="block", block=(128, 128)),
                                    Fp8Config.online()])
def test_w8a8dot_mode_takes_the_gemv_up_to_16_rows(monkeypatch, method):
    """$TINYPAGED_FP8_GEMV=w8a8dot: 1-16 rows go to the decode GEMV with x quantized per row and
    K step inside it (the same numbers as its reference), 17 rows to quantize_fp8 + fp8_gemm;
    the down projection's SiLU-and-mul input too."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TINYPAGED_FP8_GEMV", "w8a8dot")
    seen = []
    real = fp8_module.dense_gemv

    def spy(*args, **kwargs):
        seen.append((args[0].shape[0], kwargs.get("quantize_x")))
        return real(*args, **kwargs)

    monkeypatch.setattr(fp8_module, "dense_gemv", spy)
    gen = torch.Generator().manual_seed(4)
    layer = fp8_down_layer(method, gen)
    scale = layer.weight_scale
    for rows in (1, 5, 16, 17):
        x = torch.randn(rows, 256, generator=gen)
        y = layer.matmul(x, None)
        config = dense_gemv.fp8_gemv_config(min(rows, 16), method.block, "w8a8dot")
        if rows <= 16:
            assert seen.pop() == (rows, True)
            ref = dense_gemv.dense_gemv_reference(x, layer.weight, None, scale, method.block,
                                                  **config)
            torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        else:
            assert not seen
        gate_up = torch.randn(rows, 512, generator=gen)
        y = fp8_module.fp8_silu_and_mul_down(layer, gate_up)
        if rows <= 16:
            assert seen.pop() == (rows, True)
            ref = dense_gemv.dense_gemv_reference(gate_up, layer.weight, None, scale,
                                                  method.block, silu_and_mul=True, **config)
            torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        else:
            assert not seen and (y is None) == method.static_input
    monkeypatch.setenv("TINYPAGED_FP8_GEMV", "w8a16")  # one row only, x as it is
    layer.matmul(torch.randn(2, 256), None)
    layer.matmul(torch.randn(1, 256), None)
    assert seen == [(1, None)]


@pytest.mark.parametrize("method", [Fp8Config(weight_scheme="tensor", static_input=True),
                                    Fp8Config(weight_scheme="block", block=(128, 128)),
                                    Fp8Config.online()])
def test_w8a8_takes_fp8_rows_from_2_to_16_rows(monkeypatch, method):
    """W8A8 (the default w8a16 mode past one row): x quantized by its own kernel, then fp8_rows
    at 2-16 rows (the down projection's SiLU-and-mul input too), fp8_gemm at 17 rows and with
    $TINYPAGED_FP8_ROWS=0; both multiply the same quantized operands (the same numbers)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    seen = []

    def spying(name, real):
        def spy(*args, **kwargs):
            seen.append((name, args[0].shape[0]))
            return real(*args, **kwargs)
        return spy

    for name in ("fp8_rows", "fp8_gemm"):
        monkeypatch.setattr(fp8_module, name, spying(name, getattr(fp8_module, name)))
    gen = torch.Generator().manual_seed(5)
    layer = fp8_down_layer(method, gen)
    for rows in (2, 16, 17):
        x, gate_up = torch.randn(rows, 256, generator=gen), torch.randn(rows, 512, generator=gen)
        y = layer.matmul(x, None)
        y_down = fp8_module.fp8_silu_and_mul_down(layer, gate_up)
        path = "fp8_rows" if rows <= 16 else "fp8_gemm"
        expected = [(path, rows)] * (1 if method.static_input else 2)
        assert seen == expected, (rows, seen)
        seen.clear()
        monkeypatch.setenv("TINYPAGED_FP8_ROWS", "0")
        torch.testing.assert_close(layer.matmul(x, None), y, rtol=1e-5, atol=1e-5)
        if not method.static_input:
            torch.testing.assert_close(fp8_module.fp8_silu_and_mul_down(layer, gate_up), y_down,
                                       rtol=1e-5, atol=1e-5)
        assert {name for name, _ in seen} == {"fp8_gemm"}
        seen.clear()
        monkeypatch.delenv("TINYPAGED_FP8_ROWS")


def test_row_parallel_rank_loads_its_scale_blocks(monkeypatch):
    monkeypatch.setattr(layers, "get_tp_size", lambda: 2)
    monkeypatch.setattr(layers, "get_tp_rank", lambda: 1)
    method = Fp8Config(weight_scheme="block", block=(128, 128))
    layer = layers.RowParallelLinear(512, 128, quant_config=method)
    stored, deq = quantize(torch.randn(128, 512), "block")
    for name, t in stored.items():
        getattr(layer, name).weight_loader(getattr(layer, name), t)
    method.process_weights_after_loading(layer)
    x = torch.randn(3, 256)
    torch.testing.assert_close(layer.matmul(x, None), x @ deq[:, 256:].t(), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="whole blocks"):
        layers.RowParallelLinear(384, 128, quant_config=method)


@pytest.mark.parametrize("config, match", [
    ({"quant_method": "fp8", "fmt": "e5m2"}, "e4m3"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size"),
    ({"quant_method": "fp8", "ignored_layers": ["model.layers.0.mlp.gate_proj"]}, "mixing"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}},
     "float-quantized"),
])
def test_unsupported_variants_are_refused(config, match):
    cls = CompressedTensorsFp8Config if config["quant_method"] != "fp8" else Fp8Config
    with pytest.raises(ValueError, match=match):
        cls.from_config(config)


@pytest.mark.parametrize("fmt, kind", [("block", "qwen3"), ("channel", "llama")])
def test_triton_decode_path_is_the_dequantized_model(tmp_path, fmt, kind):
    """kernels="triton" (the interpreter): every step of at most 16 tokens runs the W8A16 GEMVs
    (the down projection's SiLU-and-mul formed on load), which with fp32 activations compute the
    checkpoint's dequantized model: greedy tokens equal transformers'."""
    pytest.importorskip("triton")
    out, hf_model = fp8_pair(tmp_path, fmt, kind)
    llm = LLM(str(out), num_kv_blocks=64, block_size=16, max_model_len=128, kernels="triton",
              dtype="float32", skip_tokenizer_init=True)
    check_llm_greedy(llm, hf_model, [PROMPTS[0], list(range(11, 19))], steps=3)  # 15 rows
