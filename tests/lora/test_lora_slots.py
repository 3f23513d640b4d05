"""LoRA slots under load: adapters evicted and reloaded (GPU slots and CPU cache), unloaded while
their requests run, the prefix cache keyed by adapter, TP=2 equal to TP=1; and the clear errors
for adapters that cannot be served."""

import json

import pytest
from helpers.lora import save_peft_adapter
from helpers.models import greedy_reference, prompts, single_thread  # noqa: F401 (autouse)

from tinypaged import LLM, LoRARequest, SamplingParams
from tinypaged.bench.tiny_models import save_tiny
from tinypaged.lora.adapter import load_adapter

STEPS = 5
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    hf = save_tiny("llama", root / "base")
    requests, refs = [None], [hf]
    for i, r in enumerate((8, 16, 4, 12)):
        refs.append(save_peft_adapter(hf, root / f"a{i}", r, 2 * r, rslora=i == 1, seed=10 + i))
        requests.append(LoRARequest(f"a{i}", i + 1, str(root / f"a{i}")))
    return root, requests, refs


def run(llm, batch, loras):
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False,
                        lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


def test_eviction_and_unload_under_load(setup):
    root, requests, refs = setup
    batch = prompts(10, seed=3, hi=14)
    loras = [requests[i % 5] for i in range(len(batch))]
    want = [greedy_reference(refs[i % 5], p, STEPS)[0] for i, p in enumerate(batch)]
    llm = LLM(str(root / "base"), skip_tokenizer_init=True, num_kv_blocks=64,
              enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2)
    runtime = llm.engine.runner.lora
    seen = []
    plan = runtime.plan

    def watched_plan(reqs, num_new):
        seen.append({r.lora_int_id for r in reqs if r is not None})
        return plan(reqs, num_new)

    runtime.plan = watched_plan
    assert run(llm, batch, loras) == want  # 4 adapters through 2 slots and a CPU cache of 2
    assert max(map(len, seen)) == 2 and len(runtime.slot_of) <= 2
    assert len(runtime.cpu.adapters) <= 2
    # Unload adapters while their requests run: they are read again when next needed.
    engine = llm.engine
    for i, (p, lora) in enumerate(zip(batch, loras)):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, GREEDY, lora)
    done = {}
    for step in range(100):
        if step == 2:
            runtime.remove(1)
            runtime.remove(2)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    assert [done[f"r{i}"] for i in range(len(batch))] == want  # no request lost
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert len(runtime.slot_of) <= 2


def test_prefix_cache_is_keyed_by_adapter(setup):
    root, requests, refs = setup
    prompt = prompts(1, seed=5, lo=40, hi=41)[0]  # 2 full blocks of 16
    llm = LLM(str(root / "base"), skip_tokenizer_init=True, num_kv_blocks=64,
              enable_lora=True, max_loras=2)
    for lora, ref in ((requests[1], refs[1]), (requests[2], refs[2]), (None, refs[0]),
                      (requests[1], refs[1])):
        out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False,
                           lora_request=lora)[0]
        assert out.outputs[0].token_ids == greedy_reference(ref, prompt, STEPS)[0]
    assert out.num_cached_tokens == 32  # the same adapter again: its own blocks hit


@pytest.mark.timeout(180)
def test_tp2_equals_tp1(setup):
    root, requests, _ = setup
    batch = prompts(5, seed=7, hi=20)
    kwargs = dict(skip_tokenizer_init=True, num_kv_blocks=64, enable_lora=True, max_loras=4)
    tp1 = run(LLM(str(root / "base"), **kwargs), batch, requests)
    llm = LLM(str(root / "base"), tensor_parallel_size=2, **kwargs)
    try:
        assert len(llm.engine.executor.workers) == 1  # rank 1 in its own process
        assert run(llm, batch, requests) == tp1
    finally:
        llm.shutdown()


def test_request_errors(setup, tmp_path):
    root, requests, _ = setup
    llm = LLM(str(root / "base"), skip_tokenizer_init=True, num_kv_blocks=16)
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate([1, 2, 3], GREEDY, use_tqdm=False, lora_request=requests[1])
    llm = LLM(str(root / "base"), skip_tokenizer_init=True, num_kv_blocks=16, enable_lora=True,
              max_lora_rank=8)
    with pytest.raises(ValueError, match="rank 16 > max_lora_rank=8"):
        llm.generate([1, 2, 3], GREEDY, use_tqdm=False, lora_request=requests[2])
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.generate([1, 2, 3], GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("x", 9, str(tmp_path)))
    assert not llm.engine.has_unfinished_requests()  # the engine still serves
    assert run(llm, [[1, 2, 3]], requests[1])


@pytest.mark.parametrize("change,message", [
    ({"use_dora": True}, "DoRA"), ({"bias": "all"}, "bias='all'"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "embedding or lm_head"),
    ({"target_modules": ["q_proj", "fc9"]}, "unknown target module 'fc9'"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"), ({"peft_type": "IA3"}, "IA3"),
])
def test_unsupported_adapters_are_refused(setup, tmp_path, change, message):
    root = setup[0]
    config = json.loads((root / "a0" / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, **change}))
    (tmp_path / "adapter_model.safetensors").write_bytes(
        (root / "a0" / "adapter_model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=message):
        load_adapter(tmp_path, "x", 1, 16)


def test_scaling_is_folded_into_b(setup):
    root = setup[0]
    plain, rs = load_adapter(root / "a0", "a0", 1, 16), load_adapter(root / "a1", "a1", 2, 16)
    assert plain.rank == 8 and rs.rank == 16
    from safetensors.torch import load_file

    raw = load_file(str(root / "a1" / "adapter_model.safetensors"))
    b = raw["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    got = rs.weights[("model.layers.0.self_attn.qkv_proj", "q")][1]
    assert got.allclose(b * 32 / 16**0.5)  # rsLoRA: alpha / sqrt(r)


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")
def test_triton_kernels_in_the_engine(setup):
    """The engine's LoRA path through the Triton kernels (the interpreter on the CPU): a decode
    batch of two adapters and the base equals PEFT's merged models."""
    root, requests, refs = setup
    llm = LLM(str(root / "base"), skip_tokenizer_init=True, num_kv_blocks=16, enable_lora=True,
              max_loras=2, kernels="triton", dtype="float32")
    batch = prompts(3, seed=9, lo=3, hi=6)
    steps = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], steps, use_tqdm=False,
                        lora_request=[requests[1], None, requests[2]])
    for out, p, ref in zip(outs, batch, (refs[1], refs[0], refs[2])):
        assert out.outputs[0].token_ids == greedy_reference(ref, p, 3)[0]
