"""Embedding throughput, tinypaged beside vLLM 0.20.2 (`runner="pooling"`) on one workload:
1,024 inputs of 512 random token ids (Random(0), ids in [1000, vocab - 1000)), one batch, the
Qwen3-Embedding-0.6B shape (Qwen3-0.6B's layers, vocab 151,669) with dummy bf16 weights,
last-token pooling + L2 normalization (what both engines pick for this checkpoint with
runner="pooling"), 16,384 batched tokens per step, max_model_len 1,024. Warm-up: 64 inputs of
their own (seed 1), so no timed input is prefix-cached. Each engine's embeddings are checked
(hidden size, finite) and their mean norm printed (1.0: normalized).

    PYTHONPATH=. python benchmarks/embed_throughput.py tinypaged
    PYTHONPATH=.:/tmp/vsite python benchmarks/embed_throughput.py vllm   # the anchor kit's vLLM
    PYTHONPATH=. python benchmarks/embed_throughput.py check   # GPU correctness, ~1 min

`check` compares tinypaged's embeddings on the GPU (Triton kernels, CUDA graphs, chunked
prefill) with transformers' on tiny random Qwen3 checkpoints, last-token and mean pooling:
cosine > 1 - 1e-4 in float32, > 0.99 in bfloat16.

Each prints one JSON line: inputs/s and prompt tok/s. BENCH_N, BENCH_LEN and
BENCH_BATCHED_TOKENS change the workload (the same for both engines).
"""

from __future__ import annotations

import gc
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from tinypaged.bench.model_shapes import SHAPES, write_word_tokenizer

CONFIG = {**SHAPES["qwen3-0.6b"], "vocab_size": 151669, "max_position_embeddings": 32768,
          "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151643,
          "hidden_act": "silu", "attention_bias": False}
N = int(os.environ.get("BENCH_N", 1024))
LENGTH = int(os.environ.get("BENCH_LEN", 512))
BATCHED_TOKENS = int(os.environ.get("BENCH_BATCHED_TOKENS", 16384))
ENGINE_ARGS = dict(load_format="dummy", dtype="bfloat16", max_model_len=1024,
                   max_num_batched_tokens=BATCHED_TOKENS, gpu_memory_utilization=0.85, seed=0)


def inputs(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    vocab = CONFIG["vocab_size"]
    return [{"prompt_token_ids": [rng.randrange(1000, vocab - 1000) for _ in range(LENGTH)]}
            for _ in range(n)]


def model_dir() -> str:
    path = Path(tempfile.mkdtemp(prefix="embed-qwen3-0.6b-"))
    (path / "config.json").write_text(json.dumps(CONFIG))
    write_word_tokenizer(path, CONFIG["vocab_size"], CONFIG["max_position_embeddings"])
    return str(path)


def check(embeddings: list[list[float]]) -> float:
    """Each embedding has the hidden size and finite entries; returns the mean L2 norm (1.0 when
    the engine normalized, as both should here)."""
    norms = []
    for e in embeddings:
        norm = math.sqrt(sum(x * x for x in e))
        if len(e) != CONFIG["hidden_size"] or not math.isfinite(norm):
            raise SystemExit(f"bad embedding: {len(e)} dims, norm {norm}")
        norms.append(norm)
    return sum(norms) / len(norms)


def main(engine: str) -> None:
    if engine == "vllm":
        import vllm
        from vllm import LLM

        llm = LLM(model=model_dir(), runner="pooling", **ENGINE_ARGS)
        name = f"vllm-{vllm.__version__}"
    else:
        from tinypaged import LLM

        llm = LLM(model_dir(), runner="pooling", **ENGINE_ARGS)
        name = "tinypaged"
    check([o.outputs.embedding for o in llm.embed(inputs(64, seed=1), use_tqdm=False)])
    timed = inputs(N, seed=0)
    start = time.perf_counter()
    outs = llm.embed(timed, use_tqdm=False)
    seconds = time.perf_counter() - start
    norm = check([o.outputs.embedding for o in outs])
    print(json.dumps({"engine": name, "inputs": N, "input_len": LENGTH, "mean_norm": norm,
                      "batched_tokens": BATCHED_TOKENS, "seconds": round(seconds, 3),
                      "inputs_s": round(N / seconds, 1),
                      "prompt_tok_s": round(N * LENGTH / seconds)}), flush=True)


def gpu_check() -> None:
    import torch

    from tinypaged import LLM
    from tinypaged.bench.tiny_models import tiny_hf_model

    device = os.environ.get("BENCH_DEVICE", "cuda")  # "cpu": check the check itself
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (1, 7, 64, 200, 250, 17)]
    for mode, st_mode in (("LAST", "pooling_mode_lasttoken"), ("MEAN", "pooling_mode_mean_tokens")):
        hf = tiny_hf_model("qwen3", seed=5).model.to(device)
        path = Path(tempfile.mkdtemp(prefix="embed-check-"))
        hf.save_pretrained(path)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config,
                                                      "architectures": ["Qwen3ForCausalLM"]}))
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps({st_mode: True}))
        with torch.no_grad():
            refs = []
            for p in prompts:
                hidden = hf(torch.tensor([p], device=device)).last_hidden_state[0].float()
                refs.append(hidden[-1] if mode == "LAST" else hidden.mean(0))
        dtypes = (("float32", 1 - 1e-4), ("bfloat16", 0.99))
        for dtype, floor in dtypes[: 2 if device == "cuda" else 1]:
            llm = LLM(str(path), runner="pooling", dtype=dtype, max_model_len=256,
                      max_num_batched_tokens=256, skip_tokenizer_init=True, device=device,
                      gpu_memory_utilization=0.3)
            outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
            cos = [torch.nn.functional.cosine_similarity(
                torch.tensor(o.outputs.embedding, device=device), r, dim=0).item()
                for o, r in zip(outs, refs)]
            print(f"{mode} {dtype}: min cosine {min(cos):.6f}", flush=True)
            if min(cos) < floor:
                raise SystemExit(f"FAIL: {mode} {dtype} cosine {min(cos)} < {floor}")
            del llm
            gc.collect()  # the engine's GPU memory goes back before the next one sizes its cache
            if device == "cuda":
                torch.cuda.empty_cache()
    print("embedding check: OK")


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("tinypaged", "vllm", "check"):
        raise SystemExit("usage: embed_throughput.py tinypaged|vllm|check")
    gpu_check() if sys.argv[1] == "check" else main(sys.argv[1])
