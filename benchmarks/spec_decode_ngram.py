"""Speculative decoding on input-grounded prompts with real weights: n-gram (or a draft model)
against no speculation, batch 1 and 8, greedy, offline (`LLM`).

Each prompt asks the model to repeat a paragraph of tinypaged/data/heldout.txt, so most of the
output is found in the prompt (the case prompt lookup is for: editing, quoting, summarising).
Prints tok/s with and without speculation, the speed-up and the acceptance rate, and checks the
greedy tokens are the same.

    PYTHONPATH=. python benchmarks/spec_decode_ngram.py [MODEL] \\
        [--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}']

MODEL defaults to the built-in SmolLM2-135M-Instruct (fetched once; carry it to an offline GPU).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tinypaged import LLM, SamplingParams

TEXT = Path(__file__).resolve().parents[1] / "tinypaged" / "data" / "heldout.txt"


def prompts(n: int) -> list[list[dict]]:
    paragraphs = [p for p in TEXT.read_text().split("\n\n") if len(p) > 200]
    return [[{"role": "user", "content": "Repeat the following text exactly, word for word:\n\n"
              + paragraphs[i % len(paragraphs)]}] for i in range(n)]


def timed(llm: LLM, batch: list, params: SamplingParams) -> tuple[float, list]:
    llm.chat(batch[:1], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.chat(batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    return sum(map(len, tokens)) / elapsed, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--speculative-config", default='{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, '
                        '"prompt_lookup_max": 5}')
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    args = parser.parse_args()
    spec = json.loads(args.speculative_config)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    engine = dict(gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=2048)
    base_llm = LLM(args.model, **engine)
    base = {b: timed(base_llm, prompts(b), params) for b in args.batch_sizes}
    base_llm.shutdown()
    del base_llm
    llm = LLM(args.model, speculative_config=spec, **engine)
    for b in args.batch_sizes:
        rate, tokens = timed(llm, prompts(b), params)
        same = sum(x == y for x, y in zip(tokens, base[b][1]))
        print(f"batch {b}: {base[b][0]:,.1f} -> {rate:,.1f} tok/s = {rate / base[b][0]:.2f}x "
              f"({same}/{b} outputs identical)")
    stats = llm.engine.get_stats()["spec_decode"]
    print(f"{spec}: acceptance rate {100 * stats['acceptance_rate']:.1f}%, mean acceptance "
          f"length {1 + stats['num_accepted_tokens'] / max(stats['num_drafts'], 1):.2f}")


if __name__ == "__main__":
    main()
