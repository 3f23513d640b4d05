"""GPU check of speculative decoding, run before timing it: greedy tokens with speculation equal
the tokens without, for the n-gram and oracle proposers, with the k+1-token CUDA graphs, the
piecewise graphs and eagerly, at batch 1 and 8 (fp32 tiny random models, so that no bf16
near-tie between the decode and the verification kernels can flip a token); every KV block free
after. Prints one line per case and exits 1 on any mismatch.

    PYTHONPATH=. python benchmarks/spec_decode_check.py [--kinds llama qwen3]
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
from pathlib import Path

from tinypaged import LLM, SamplingParams
from tinypaged.bench.tiny_models import save_tiny


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", nargs="+", default=["llama", "qwen3"])
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 250) for _ in range(rng.randint(8, 60))] for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    failures = 0
    for kind in args.kinds:
        path = Path(tempfile.mkdtemp()) / kind
        path.mkdir()
        save_tiny(kind, path)
        engine = dict(dtype="float32", skip_tokenizer_init=True, max_model_len=256,
                      max_num_seqs=8, gpu_memory_utilization=0.3)

        def run(llm, batch):
            outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
            return [o.outputs[0].token_ids for o in outs]

        base_llm = LLM(str(path), **engine)
        base = run(base_llm, prompts)
        base_llm.shutdown()
        del base_llm
        gc.collect()  # the engine's GPU memory goes back before the next one sizes its cache
        table = [[p, b] for p, b in zip(prompts, base)]
        configs = [
            {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
             "prompt_lookup_max": 3},
            {"method": "oracle", "num_speculative_tokens": 4, "oracle_token_ids": table},
            {"method": "oracle_miss", "num_speculative_tokens": 3, "oracle_token_ids": table},
        ]
        for config in configs:
            for mode in ({}, {"cudagraph_mode": "FULL_DECODE_ONLY"}, {"enforce_eager": True}):
                llm = LLM(str(path), speculative_config=config, **engine, **mode)
                for batch in (1, 8):
                    got = run(llm, prompts[:batch])
                    stats = llm.engine.get_stats()
                    spec = stats["spec_decode"]
                    ok = got == base[:batch]
                    ok = ok and stats["num_free_blocks"] == stats["num_total_blocks"]
                    failures += not ok
                    rate = spec["num_accepted_tokens"] / max(spec["num_draft_tokens"], 1)
                    graphs = "spec graphs" if llm.engine.runner.spec_graphs else "no spec graphs"
                    print(f"{'OK ' if ok else 'BAD'} {kind} batch {batch} {config['method']} "
                          f"{mode or 'graphs'} ({graphs}): acceptance so far {100 * rate:.0f}%")
                llm.shutdown()
                del llm
                gc.collect()
    print("all equal" if not failures else f"{failures} mismatches")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
