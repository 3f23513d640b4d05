"""Pipeline parallelism on the CPU: stages as processes joined by gloo (worker/pipeline.py).

- The layer split is vLLM's get_pp_indices: consecutive runs covering every layer once, sizes
  differing by at most one, the extra layers before the last stage.
- Greedy tokens of `LLM(..., pipeline_parallel_size=2)` equal the single-process engine's (fp32)
  for tied (llama; gemma2, whose embedding is also scaled: the last stage keeps the embedding
  for its LM head) and untied (qwen2) models with an uneven split (3 layers: 2 + 1), under
  chunked prefill and prefix caching; the engine's process (the last stage) holds only its
  layer, the final norm and the LM head, and a KV cache for that layer alone. TP=2 x PP=2
  (4 ranks) gives the same tokens too.
- Clear errors before any process starts: more stages than layers, LoRA with stages. A killed
  stage fails the engine within seconds with an error naming its rank and pid.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.models import single_thread, tiny_hf_model  # noqa: F401 - autouse fixture

from tinypaged import LLM, SamplingParams
from tinypaged.models.pipeline import get_pp_indices

ENGINE = dict(skip_tokenizer_init=True, num_kv_blocks=64, block_size=8, dtype="float32",
              device="cpu", max_num_batched_tokens=24)  # chunked prefill


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    dirs = {}
    for kind in ("llama", "qwen2", "gemma2"):
        path = tmp_path_factory.mktemp(kind)
        tiny_hf_model(kind, seed=5, num_hidden_layers=3).save_pretrained(path)
        dirs[kind] = str(path)
    return dirs


def prompts() -> list[dict]:
    rng = np.random.default_rng(1)
    shared = rng.integers(2, 250, 20).tolist()
    return [{"prompt_token_ids": p} for p in
            (shared + [7, 8], shared + [9], rng.integers(2, 250, 5).tolist())]


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]


def reference(model_dir: str) -> list[list[int]]:
    llm = LLM(model_dir, **ENGINE)
    try:
        return greedy(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("num_layers,pp", [(3, 2), (10, 4), (28, 3), (4, 4), (7, 1)])
def test_layer_split_is_vllms(num_layers, pp):
    ranges = [get_pp_indices(num_layers, r, pp) for r in range(pp)]
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # consecutive, no overlap
    sizes = [end - start for start, end in ranges]
    base, extra = divmod(num_layers, pp)
    if pp > 1:  # the extra layers sit just before the last stage, which runs the LM head
        assert sizes == [base] * (pp - 1 - extra) + [base + 1] * extra + [base]


def test_more_stages_than_layers_or_lora_is_refused_before_any_process(model_dirs):
    with pytest.raises(ValueError, match="larger than the model's 3 layers"):
        LLM(model_dirs["llama"], pipeline_parallel_size=4, **ENGINE)
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(model_dirs["llama"], pipeline_parallel_size=2, enable_lora=True, **ENGINE)
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(model_dirs["llama"], pipeline_parallel_size=2, async_scheduling=True, **ENGINE)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2"])
def test_pp2_greedy_matches_one_rank_and_stages_hold_their_layers(model_dirs, kind):
    expected = reference(model_dirs[kind])
    llm = LLM(model_dirs[kind], pipeline_parallel_size=2, **ENGINE)
    try:
        assert greedy(llm) == expected
        executor = llm.engine.executor
        names = {n.split(".")[0] if not n.startswith("model.layers") else
                 ".".join(n.split(".")[:3]) for n, _ in executor.model.named_parameters()}
        # the engine's process runs the last stage: layer 2 of 3, the norm and the LM head
        tied = kind != "qwen2"
        assert {n for n in names if n.startswith("model.layers")} == {"model.layers.2"}
        assert ("lm_head" in names) != tied  # tied: the LM head is the embedding's weight
        assert len(executor.runner.attn_layers) == 1  # a KV cache for its one layer
    finally:
        llm.shutdown()


@pytest.mark.timeout(240)
def test_tp2_pp2_greedy_matches_one_rank(model_dirs):
    expected = reference(model_dirs["llama"])
    llm = LLM(model_dirs["llama"], tensor_parallel_size=2, pipeline_parallel_size=2, **ENGINE)
    try:
        assert len(llm.engine.executor.workers) == 3
        assert greedy(llm) == expected
    finally:
        llm.shutdown()


@pytest.mark.timeout(120)
def test_a_killed_stage_fails_the_engine_with_its_rank(model_dirs):
    import os
    import signal
    import time

    llm = LLM(model_dirs["llama"], pipeline_parallel_size=2, **ENGINE)
    try:
        greedy(llm)
        worker = llm.engine.executor.workers[0].process  # stage 0: the engine waits for it
        os.kill(worker.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=f"worker rank 1 \\(pid {worker.pid}\\) was killed"):
            greedy(llm)
        assert time.monotonic() - start < 30
    finally:
        llm.shutdown()
