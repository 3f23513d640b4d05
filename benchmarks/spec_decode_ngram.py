"""Speculative decoding on input-grounded prompts with real weights: n-gram (or a draft model)
against no speculation, batch 1 and 8, greedy, offline (`LLM`).

Each prompt asks the model to repeat a paragraph of tinypaged/data/heldout.txt, so most of the
output is found in the prompt (the case prompt lookup is for: editing, quoting, summarising).
A run is --num-prompts such prompts (8), `b` at a time at batch b: batch 1 times all 8 one after
another, not one short output whose few steps a single stall would swing.
Prints tok/s with and without speculation, the speed-up and the acceptance rate (each batch
size's, then overall), and checks the greedy tokens are the same; for tinypaged on a GPU also
how many verification steps replayed their full CUDA graph (the rest ran the piecewise graphs;
TINYPAGED_SPEC_PAD_DRAFTS=0 for the A/B of the draft padding that keeps them in it), and, with
overlapped verification, how many steps were launched before the tokens of the one in flight
(`--overlap both`: without it, then with it, against the same runs without speculation).
`--engine vllm` runs the same workload through vLLM's `LLM` (the anchor kit's vLLM on
PYTHONPATH), so both speed-ups come from one GPU in one sitting:

    PYTHONPATH=. python benchmarks/spec_decode_ngram.py [MODEL] \\
        [--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}']
    PYTHONPATH=.:/tmp/vsite python benchmarks/spec_decode_ngram.py --engine vllm [MODEL]

MODEL defaults to the built-in SmolLM2-135M-Instruct (fetched once; carry it to an offline GPU).
vLLM is given the model's .gguf file with the folder as its tokenizer (both engines then read the
same Q4_1 weights).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
import warnings
from pathlib import Path

import torch

from tinypaged.bench.compile_watch import CompileWatch

TEXT = Path(__file__).resolve().parents[1] / "tinypaged" / "data" / "heldout.txt"


def prompts(n: int) -> list[list[dict]]:
    paragraphs = [p for p in TEXT.read_text().split("\n\n") if len(p) > 200]
    return [[{"role": "user", "content": "Repeat the following text exactly, word for word:\n\n"
              + paragraphs[i % len(paragraphs)]}] for i in range(n)]


def timed(llm, work: list, batch: int, params,
          sync_debug: bool = False) -> tuple[float, list, dict]:
    """(tok/s, each request's tokens, the kernels compiled in the second and in the timed run)
    of the third of three identical runs; a run is every prompt, `batch` at a time (one chat
    call each). The first run compiles what these shapes need (in either engine) and fills the
    prefix cache, the second meets the shapes of a cached prompt (its prefill is only what the
    cache lacks; a compile there is the stall the first fully cached prompt brings a server), so
    both engines and both configurations are timed warm. `sync_debug` (a GPU): the second run
    under torch's sync debug mode; the compiles then also count the host syncs it warned of."""
    groups = [work[i : i + batch] for i in range(0, len(work), batch)]

    def run() -> list:
        return [o for g in groups for o in llm.chat(g, params, use_tqdm=False)]

    run()
    with CompileWatch() as cached, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if sync_debug:  # what makes the host wait for the GPU, as torch names it
            torch.cuda.set_sync_debug_mode("warn")
        try:
            run()  # reported too: a server would stall here the same way
        finally:
            if sync_debug:
                torch.cuda.set_sync_debug_mode("default")
    with CompileWatch() as watch:
        start = time.perf_counter()
        outs = run()
        elapsed = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    compiles = {"second_run": cached.summary()["kernels"], "timed": watch.summary()["kernels"]}
    if sync_debug:
        compiles["syncs_warned"] = sum("synchroniz" in str(w.message) for w in caught)
    return sum(map(len, tokens)) / elapsed, tokens, compiles


def diverge_at(a, b) -> int:
    """The first index where token lists a and b differ (one ending counts), -1 if equal."""
    if list(a) == list(b):
        return -1
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def counters(llm) -> dict[str, int]:
    """The spec-decode counters from vLLM's LLM.get_metrics() (tinypaged's has the same)."""
    out = {}
    for metric in llm.get_metrics():
        name = metric.name.split(":")[-1]
        if name.startswith("spec_decode_") and hasattr(metric, "value"):
            out[name.removeprefix("spec_decode_")] = metric.value
    return out


def graph_steps(llm) -> tuple[int, int] | None:
    """tinypaged on a GPU: (verification steps launched, those replayed as one CUDA graph) so
    far; the others ran the piecewise graphs with eager attention. None elsewhere."""
    spec, runner = getattr(llm.engine, "spec", None), getattr(llm.engine, "runner", None)
    graphs = getattr(runner, "spec_graphs", None)
    return None if spec is None or graphs is None else (spec.num_launched, graphs.num_runs)


def overlapped_steps(llm) -> int:
    """tinypaged: steps proposed before the verification in flight gave its tokens, so far."""
    spec = getattr(llm.engine, "spec", None)
    return 0 if spec is None else spec.num_overlapped


def engine_args(engine: str, model: str | None, memory: float) -> dict:
    args = dict(gpu_memory_utilization=memory, max_model_len=2048)
    if engine == "tinypaged":
        return dict(model=model, **args)
    from tinypaged.models.default_model import ensure_default_model

    folder = Path(model) if model else ensure_default_model()
    gguf = sorted(folder.glob("*.gguf"))
    return dict(model=str(gguf[0]) if gguf else str(folder), tokenizer=str(folder),
                disable_log_stats=False, **args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--engine", choices=("tinypaged", "vllm"), default="tinypaged")
    parser.add_argument("--speculative-config", default='{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, '
                        '"prompt_lookup_max": 5}')
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts a run: at batch "
                        "b, b at a time (batch 1: one after another)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    parser.add_argument("--overlap", choices=("env", "off", "on", "both"), default="env",
                        help="tinypaged: overlapped verification (TINYPAGED_SPEC_OVERLAP) as "
                        "the environment sets it, off, on, or off then on against the same "
                        "runs without speculation")
    parser.add_argument("--sync-debug", action="store_true", help="tinypaged on a GPU: the "
                        "speculative engine's second (untimed) run under torch's sync debug "
                        "mode, counting the host syncs it warns of (spec_compiles)")
    parser.add_argument("--json", type=Path, help="also write the speed-ups here "
                        "(docs/plot_speculative.py's input)")
    args = parser.parse_args()
    if args.engine == "vllm":
        from vllm import LLM, SamplingParams
    else:
        from tinypaged import LLM, SamplingParams
    spec = json.loads(args.speculative_config)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=False)
    engine = engine_args(args.engine, args.model, args.gpu_memory_utilization)
    base_llm = LLM(**engine)
    work = prompts(args.num_prompts)
    base = {b: timed(base_llm, work, b, params) for b in args.batch_sizes}
    del base_llm
    gc.collect()
    modes = {"env": [None], "off": ["0"], "on": ["1"], "both": ["0", "1"]}[args.overlap]
    for mode in modes if args.engine == "tinypaged" else [None]:
        if mode is not None:
            os.environ["TINYPAGED_SPEC_OVERLAP"] = mode
        result = run_speculative(LLM, engine, spec, work, params, base, args)
        gc.collect()
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


def run_speculative(LLM, engine: dict, spec: dict, work: list, params, base: dict, args) -> dict:
    """Time the speculative engine at every batch size against `base`; print a line each and
    the overall acceptance; return the speed-ups and counters (--json's content)."""
    llm = LLM(speculative_config=dict(spec), **engine)  # vLLM fills in the dict it is given
    result: dict = {"engine": args.engine, "speculative_config": spec}
    overlap = args.engine == "tinypaged" and llm.engine.spec.overlap
    for b in args.batch_sizes:
        before = graph_steps(llm) if args.engine == "tinypaged" else None
        overlapped = overlapped_steps(llm) if args.engine == "tinypaged" else 0
        counted = counters(llm)
        rate, tokens, compiles = timed(llm, work, b, params, args.sync_debug
                                       and args.engine == "tinypaged" and torch.cuda.is_available())
        # this batch size's three runs: drafted and accepted tokens since `counted`
        drafted, accepted = (counters(llm).get(k, 0) - counted.get(k, 0)
                             for k in ("num_draft_tokens", "num_accepted_tokens"))
        same = sum(x == y for x, y in zip(tokens, base[b][1]))
        result[f"speedup_batch_{b}"] = rate / base[b][0]
        line = {"engine": args.engine, "batch": b, "base_tok_s": round(base[b][0], 1),
                "spec_tok_s": round(rate, 1), "speedup": round(rate / base[b][0], 3),
                "identical": f"{same}/{len(work)}",
                "acceptance": round(accepted / max(drafted, 1), 3), "base_compiles": base[b][2],
                "spec_compiles": compiles,
                # each request's output tokens: at batch b the longest of each group of b
                # sets how many steps the group takes, with and without speculation
                "out_lens": [len(t) for t in tokens], "base_out_lens": [len(t) for t in base[b][1]],
                # where each output first leaves the one without speculation (-1: never)
                "diverge_at": [diverge_at(x, y) for x, y in zip(tokens, base[b][1])]}
        if before is not None:  # the three runs' verifications, and how many were one graph
            after = graph_steps(llm)
            line["graph_verifications"] = f"{after[1] - before[1]}/{after[0] - before[0]}"
        if args.engine == "tinypaged":  # on only where it applies (async scheduling, one rank)
            line["overlap"] = overlap
        if overlap:
            line["overlapped_steps"] = overlapped_steps(llm) - overlapped
        print(json.dumps(line), flush=True)
    c = counters(llm)
    accepted = c["num_accepted_tokens"] / max(c["num_draft_tokens"], 1)
    print(f"{args.engine} {spec}{' overlapped' if overlap else ''}: acceptance rate "
          f"{100 * accepted:.1f}%, mean acceptance length "
          f"{1 + c['num_accepted_tokens'] / max(c['num_drafts'], 1):.2f}")
    result["spec_decode"] = {**c, "acceptance_rate": accepted}
    del llm
    return result

if __name__ == "__main__":
    main()
