"""GPTQ checkpoints (AutoGPTQ v1 / GPTQModel v2 packing, int4 and int8, sym and asym, with and
without act-order) loaded through `load_model` and `LLM`: logits and greedy tokens match
transformers running the checkpoint's dequantized weights."""


import pytest
import torch
from helpers.models import (  # noqa: F401  (single_thread: autouse fixture)
    PagedRunner,
    check_llm_greedy,
    check_prefill_then_decode,
    generate_cli,
    single_thread,
)
from helpers.quantize import gptq_pair, random_g_idx
from safetensors.torch import load_file, save_file

from tinypaged import LLM, SamplingParams
from tinypaged.config import EngineConfig
from tinypaged.kernels.awq_format import awq_dequantize_reference
from tinypaged.kernels.gptq_format import (
    act_order_perm,
    gptq_dequantize_reference,
    gptq_to_awq,
    pack_gptq,
    unpack_cols,
    unpack_rows,
)
from tinypaged.models import layers
from tinypaged.models.loader import load_model
from tinypaged.quantization.gptq import GPTQConfig

PROMPTS = [[5, 17, 99, 3, 250, 42, 7], list(range(11, 31))]


def test_packing_follows_the_format():
    """Row 8i + j of qweight at bits 4j of word i; column 4i + j of 8-bit qzeros at bits 8j;
    v1 stores z - 1 (wrapped), v2 stores z."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (64, 8), generator=gen)
    z = torch.randint(0, 256, (2, 8), generator=gen)
    g_idx = torch.arange(64) // 32
    p4 = pack_gptq(q, torch.randint(0, 16, (2, 8), generator=gen), torch.ones(2, 8), g_idx, 4, 2)
    word = sum(int(q[8 + j, 3]) << (4 * j) for j in range(8))
    assert int(p4["qweight"][1, 3]) & 0xFFFFFFFF == word
    assert torch.equal(unpack_rows(p4["qweight"], 4), q.int())
    p8 = pack_gptq(torch.randint(0, 256, (64, 8), generator=gen), z, torch.ones(2, 8), g_idx, 8,
                   1)
    stored = sum(((int(z[1, 4 + j]) - 1) % 256) << (8 * j) for j in range(4))
    assert int(p8["qzeros"][1, 1]) & 0xFFFFFFFF == stored
    assert torch.equal((unpack_cols(p8["qzeros"], 8) + 1) % 256, z.int())


@pytest.mark.parametrize("group_size, act_order, version", [
    (32, False, 1), (32, True, 2), (64, True, 1), (-1, False, 2)])
def test_repacking_into_awq_keeps_every_weight(group_size, act_order, version):
    gen = torch.Generator().manual_seed(1)
    K, N = 128, 16
    g_idx = random_g_idx(K, group_size, act_order, gen)
    groups = int(g_idx.max()) + 1
    packed = pack_gptq(torch.randint(0, 16, (K, N), generator=gen),
                       torch.randint(0, 16, (groups, N), generator=gen),
                       torch.rand(groups, N, generator=gen) + 0.5, g_idx, 4, version)
    G = K if group_size == -1 else group_size
    perm = act_order_perm(packed["g_idx"], G)
    assert (perm is None) == (not act_order)
    awq_group = 128 if group_size == -1 else group_size
    qw, qz, s = gptq_to_awq(packed["qweight"], packed["qzeros"], packed["scales"], perm, G,
                            version, awq_group)
    w = gptq_dequantize_reference(*packed.values(), 4, version)
    expected = w if perm is None else w[perm]
    assert torch.equal(awq_dequantize_reference(qw, qz, s, awq_group), expected)


@pytest.mark.parametrize("kind, bits, group_size, act_order, sym, version", [
    ("llama", 4, 32, False, True, 1),
    ("llama", 4, 32, True, False, 1),
    ("qwen2", 4, 64, True, True, 2),
    ("llama", 4, -1, False, False, 2),
    ("qwen3", 8, 32, False, False, 1),
    ("llama", 8, 64, True, True, 2),
])
def test_checkpoint_matches_dequantized_transformers(tmp_path, kind, bits, group_size, act_order,
                                                      sym, version):
    out, hf_model = gptq_pair(tmp_path, kind, bits, group_size, act_order, sym, version)
    model, hf_config, _ = load_model(EngineConfig(model=str(out)), "cpu")  # auto-detected
    assert hf_config.quantization_config["quant_method"] == "gptq"
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert not hasattr(qkv, "weight") and not hasattr(qkv, "g_idx")
    assert (model.model.layers[0].mlp.down_proj.perm is not None) == act_order  # 2+ groups
    check_prefill_then_decode(PagedRunner(model, block_size=4, num_blocks=32), hf_model,
                              PROMPTS, 2, what=f"gptq int{bits}")


def test_llm_and_cli_generate_the_dequantized_models_tokens(tmp_path):
    out, hf_model = gptq_pair(tmp_path, act_order=True)
    llm = LLM(str(out), num_kv_blocks=64, block_size=16, max_model_len=128,
              quantization="gptq")
    check_llm_greedy(llm, hf_model, PROMPTS)

    text = llm.generate("Hello there", SamplingParams(temperature=0.0, max_tokens=5),
                        use_tqdm=False)[0].outputs[0].text
    cli = generate_cli(out, "Hello there", "--quantization", "gptq")
    assert cli.rstrip("\n") == text.rstrip("\n")


def test_row_parallel_rank_holds_whole_groups(monkeypatch):
    """Rank 1 of 2 loads the second half of the input rows (and their groups); act-order with
    a split row-parallel layer is refused with the reason."""
    monkeypatch.setattr(layers, "get_tp_size", lambda: 2)
    monkeypatch.setattr(layers, "get_tp_rank", lambda: 1)
    gen = torch.Generator().manual_seed(2)
    K, N = 128, 16
    g_idx = random_g_idx(K, 32, False, gen)
    packed = pack_gptq(torch.randint(0, 16, (K, N), generator=gen),
                       torch.randint(0, 16, (K // 32, N), generator=gen),
                       torch.rand(K // 32, N, generator=gen) + 0.5, g_idx, 4, 1)
    method = GPTQConfig(bits=4, group_size=32, desc_act=False, version=1)
    layer = layers.RowParallelLinear(K, N, quant_config=method)
    for name, t in packed.items():
        getattr(layer, name).weight_loader(getattr(layer, name), t)
    method.process_weights_after_loading(layer)
    x = torch.randn(3, K // 2, generator=gen)
    w = gptq_dequantize_reference(*packed.values(), 4, 1)
    torch.testing.assert_close(layer.matmul(x, None), x @ w[K // 2:])
    with pytest.raises(ValueError, match="desc_act=true.*tensor_parallel_size=2"):
        layers.RowParallelLinear(K, N, quant_config=GPTQConfig(4, 32, True, 1))


def test_act_order_shards_of_a_fused_layer_must_share_g_idx(tmp_path):
    out, _ = gptq_pair(tmp_path, act_order=True)
    tensors = load_file(str(out / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="g_idx of shard '[qkv]' differs"):
        load_model(EngineConfig(model=str(out)), "cpu")


@pytest.mark.parametrize("change, match", [
    ({"bits": 3}, "bits=3"),
    ({"group_size": 48}, "group_size=48"),
    ({"checkpoint_format": "marlin"}, "'marlin'"),
    ({"quant_method": "awq"}, "'awq'"),
])
def test_unsupported_gptq_variants(change, match):
    base = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}
    assert GPTQConfig.from_config(base) == GPTQConfig(4, 128, False, 1)
    with pytest.raises(ValueError, match=match):
        GPTQConfig.from_config({**base, **change})
