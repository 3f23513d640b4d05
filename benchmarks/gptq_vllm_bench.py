"""vLLM's GPTQ path (gptq_marlin) and tinypaged's side by side: the Llama-3-8B shape with a GPTQ
int4 group-128 quantization_config in its config.json, dummy weights, decode at batch 1 and 8
(512 prompt tokens, 256 out, per-sequence tok/s): the latency workload of ../shared/vllm-anchor,
imported from its scripts so that both engines run one definition.

On the GPU machine, with vLLM staged as ../shared/vllm-anchor/README.md says (/tmp/stage holds
vllm_bench.py and tinypaged_bench.py, /tmp/vsite the installed vLLM), from the project's root:

    R=$PWD; export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
        PYTHONUNBUFFERED=1
    PYTHONPATH=/tmp/vsite:/tmp/stage python3 $R/benchmarks/gptq_vllm_bench.py vllm
    PYTHONPATH=$R:/tmp/stage python3 $R/benchmarks/gptq_vllm_bench.py tinypaged

One engine per process (vLLM's workers hold the GPU until their process ends). BENCH_BITS=8 runs
GPTQ int8 instead, BENCH_DTYPE=float16 both engines in fp16 (default bf16).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from tinypaged_bench import latency  # /tmp/stage: the anchor's timing loop, batch 1 and 8
from vllm_bench import COMMON, CONFIGS

SHAPE = "llama-3-8b"


def gptq_shape_dir() -> str:
    """A model directory holding only config.json: the shape plus a GPTQ quantization_config."""
    bits = int(os.environ.get("BENCH_BITS", 4))
    config = {**COMMON, **CONFIGS[SHAPE], "quantization_config": {
        "quant_method": "gptq", "bits": bits, "group_size": 128, "desc_act": False, "sym": True,
        "checkpoint_format": "gptq"}}
    path = tempfile.mkdtemp(prefix=f"gptq_int{bits}_{SHAPE}_")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def main(engine: str) -> None:
    path, dtype = gptq_shape_dir(), os.environ.get("BENCH_DTYPE", "bfloat16")
    common = dict(load_format="dummy", dtype=dtype, gpu_memory_utilization=0.85,
                  max_model_len=2048, skip_tokenizer_init=True, seed=0)
    if engine == "vllm":
        from vllm import LLM, SamplingParams

        llm = LLM(model=path, quantization="gptq_marlin", enforce_eager=False,
                  attention_backend=os.environ.get("BENCH_ATTN", "FLASH_ATTN"), **common)
        name = "vllm-0.20.2 gptq_marlin"
    elif engine == "tinypaged":
        from tinypaged import LLM, SamplingParams

        llm = LLM(path, quantization="gptq", max_num_batched_tokens=16384, max_num_seqs=256,
                  **common)
        name = "tinypaged gptq"
    else:
        raise SystemExit(f"usage: gptq_vllm_bench.py vllm|tinypaged (got {engine!r})")
    print(json.dumps({"engine": name, "dtype": dtype, "config": path}), flush=True)
    latency(llm, {**COMMON, **CONFIGS[SHAPE]}, SamplingParams, name, SHAPE)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
