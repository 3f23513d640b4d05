"""Perplexity of the default model (SmolLM2-135M-Instruct) on tinypaged/data/heldout.txt with a
full-precision KV cache and with an FP8 (e4m3) one: the accuracy cost of --kv-cache-dtype fp8.

    python benchmarks/kv_fp8_perplexity.py [--device cpu] [--chunk 256]

The whole text is one prompt, prefilled in chunks of --chunk tokens, so each chunk's attention
reads the earlier chunks' keys and values back from the (FP8) cache; prompt_logprobs give the
log-probability of every token after the first.
"""

import argparse
import math
from pathlib import Path

from tinypaged import LLM, SamplingParams

TEXT = Path(__file__).resolve().parents[1] / "tinypaged" / "data" / "heldout.txt"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None)
    p.add_argument("--chunk", type=int, default=256)
    args = p.parse_args()
    text = TEXT.read_text()
    results = {}
    for kv in ("auto", "fp8"):
        llm = LLM(device=args.device, kv_cache_dtype=kv, max_num_batched_tokens=args.chunk,
                  max_model_len=4096, enable_prefix_caching=False)
        ids = llm.get_tokenizer().encode(text)[:4096]
        out = llm.generate([{"prompt_token_ids": ids}],
                           SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        logprobs = [lp[t] for t, lp in zip(ids[1:], out.prompt_logprobs[1:])]
        results[kv] = math.exp(-sum(logprobs) / len(logprobs))
        info = llm.engine.runner.kv_cache_info
        print(f"kv_cache_dtype={kv}: {len(logprobs)} tokens, perplexity {results[kv]:.4f} "
              f"(cache {info.dtype}, {info.num_blocks} blocks)", flush=True)
        del llm
    change = 100 * (results["fp8"] / results["auto"] - 1)
    print(f"fp8 KV cache: perplexity {results['auto']:.4f} -> {results['fp8']:.4f} "
          f"({change:+.2f}%)")


if __name__ == "__main__":
    main()
