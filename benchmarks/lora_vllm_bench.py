"""vLLM 0.20.2's side of benchmarks/lora_bench.py: the same Llama-3-8B-shape folder (random
weights), the same 4 rank-16 adapter folders, the same workload (the anchor's, see lora_bench.py),
`LLM(..., enable_lora=True, max_loras=4, max_lora_rank=16)`; `--no-lora` runs the base model.

    PYTHONPATH=. python benchmarks/lora_vllm_bench.py [--adapters DIR] [--no-lora]

Prints one JSON line per measurement, as lora_bench.py does.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from benchmarks.lora_bench import NUM_ADAPTERS, RANK, SHAPE, adapter_dirs, prompts
from tinypaged.bench.model_shapes import SHAPES, shape_dir


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adapters", default="/tmp/tinypaged-lora-bench")
    p.add_argument("--no-lora", action="store_true")
    args = p.parse_args()
    dirs = None if args.no_lora else adapter_dirs(Path(args.adapters))
    extra = {} if dirs is None else dict(enable_lora=True, max_loras=NUM_ADAPTERS,
                                         max_lora_rank=RANK)
    llm = LLM(model=str(shape_dir(SHAPE)), load_format="dummy", dtype="bfloat16",
              enforce_eager=False, gpu_memory_utilization=0.85, max_model_len=2048,
              skip_tokenizer_init=True, seed=0,
              attention_backend=os.environ.get("BENCH_ATTN", "FLASH_ATTN"), **extra)
    vocab = SHAPES[SHAPE]["vocab_size"]
    tag = {"engine": "vllm-0.20.2", "model": SHAPE,
           "lora": None if dirs is None else f"{NUM_ADAPTERS}x{RANK}"}

    def requests(n, spread=True):
        if dirs is None:
            return None
        ids = [i % len(dirs) if spread else 0 for i in range(n)]
        return [LoRARequest(f"adapter{i}", i + 1, str(dirs[i])) for i in ids]

    def gen(ps, sp, spread=True):
        return llm.generate([{"prompt_token_ids": q} for q in ps], sp, use_tqdm=False,
                            lora_request=requests(len(ps), spread))

    sp = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    gen(prompts(8, vocab, seed=1), sp)  # warm-up (different seed: no prefix-cache hits)
    ps = prompts(int(os.environ.get("BENCH_N", 256)), vocab, seed=0)
    t0 = time.perf_counter()
    outs = gen(ps, sp)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({**tag, "out_tok": n, "seconds": round(dt, 3),
                      "out_tok_s": round(n / dt, 1)}), flush=True)
    for batch in (1, 8):
        ps = [(q * 2)[:512] for q in prompts(batch, vocab, seed=2 + batch)]
        times = {}
        for out_len in (1, 256, 1, 256):
            sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
            t0 = time.perf_counter()
            gen(ps, sp, spread=batch > 1)
            times[out_len] = time.perf_counter() - t0
        print(json.dumps({**tag, "mode": "latency", "batch": batch,
                          "decode_tok_s_per_seq": round(255 / (times[256] - times[1]), 1)}),
              flush=True)


if __name__ == "__main__":
    main()
