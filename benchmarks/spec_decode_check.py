"""GPU check of speculative decoding, run before timing it: greedy tokens with speculation equal
the tokens without, for the n-gram, oracle and draft-model proposers (the draft: the target
itself, every draft accepted; a one-layer model of other weights), with the k+1-token CUDA
graphs, the piecewise graphs and eagerly (async scheduling, the default on a GPU), and with
graphs synchronously, at batch 1 and 8 (fp32 tiny random models, so that no bf16 near-tie
between the decode and the verification kernels can flip a token); every KV block free
after. Prints one line per case and exits 1 on any mismatch.

    PYTHONPATH=. python benchmarks/spec_decode_check.py [--kinds llama qwen3] [--methods ...]

`--heads-only` checks the draft heads instead (spec_decode/heads.py), with checkpoints written
in their real formats (bench/tiny_heads.py): a random EAGLE-3 head on a 4-layer llama (every
draft rejected), an EAGLE head and a GLM-4.5 MTP layer that compute their bigram target's own
next token (drafts accepted), each with the CUDA graphs (which keep the target's hidden states),
eagerly, and with graphs synchronously, at batch 1 and 8; half the requests constrained by
allowed_token_ids (the heads draft under the mask, an EAGLE-3 draft vocabulary laid over the
target's ids); the target's and the head's KV blocks all free after. With graphs, every drafting
step of the head runs through its captured graph (HeadStepGraphs) and eagerly on the same
inputs, and the outputs must agree (max |graph - eager| of the logits and features is printed);
the graph run's acceptance counters must equal the eager and the synchronous runs'.

    PYTHONPATH=. python benchmarks/spec_decode_check.py --heads-only
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
    parser.add_argument("--methods", nargs="+", default=None,
                        help="only these proposers (ngram, oracle, oracle_miss, draft_model)")
    parser.add_argument("--heads-only", action="store_true",
                        help="check the EAGLE-3 / EAGLE / MTP heads instead")
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 250) for _ in range(rng.randint(8, 60))] for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    if args.heads_only:
        return check_heads(prompts, params)
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
        other = path.parent / f"{kind}-1layer"  # a draft with other weights: some drafts fail
        other.mkdir()
        save_tiny(kind, other, num_hidden_layers=1)
        configs = [
            {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
             "prompt_lookup_max": 3},
            {"method": "oracle", "num_speculative_tokens": 4, "oracle_token_ids": table},
            {"method": "oracle_miss", "num_speculative_tokens": 3, "oracle_token_ids": table},
            {"method": "draft_model", "model": str(path), "num_speculative_tokens": 4},
            {"method": "draft_model", "model": str(other), "num_speculative_tokens": 3},
        ]
        for config in configs:
            if args.methods and config["method"] not in args.methods:
                continue
            for mode in ({}, {"cudagraph_mode": "FULL_DECODE_ONLY"}, {"enforce_eager": True},
                         {"async_scheduling": False}):
                llm = LLM(str(path), speculative_config=config, **engine, **mode)
                for batch in (1, 8):
                    got = run(llm, prompts[:batch])
                    stats = llm.engine.get_stats()
                    spec = stats["spec_decode"]
                    ok = got == base[:batch]
                    ok = ok and stats["num_free_blocks"] == stats["num_total_blocks"]
                    failures += not ok
                    report(llm, ok, f"{kind} batch {batch} {config['method']}", mode,
                           acceptance(spec))
                llm.shutdown()
                del llm
                gc.collect()
    print("all equal" if not failures else f"{failures} mismatches")
    return 1 if failures else 0


def acceptance(spec: dict) -> float:
    """Accepted over proposed draft tokens so far (the engine's spec_decode counters)."""
    return spec["num_accepted_tokens"] / max(spec["num_draft_tokens"], 1)


def report(llm, ok: bool, case: str, mode, rate: float) -> None:
    """One line per case: OK or BAD, whether the k+1-token graphs ran, how many drafting steps
    a draft model replayed as full graphs, the acceptance."""
    graphs = "spec graphs" if llm.engine.runner.spec_graphs else "no spec graphs"
    draft = getattr(llm.engine.spec.proposer, "runner", None)
    if draft is not None:
        graphs += f", draft graph replays {draft.graphs.num_runs if draft.graphs else 0}"
    print(f"{'OK ' if ok else 'BAD'} {case} {mode or 'graphs'} ({graphs}): "
          f"acceptance so far {100 * rate:.0f}%")


def check_heads(prompts, params) -> int:
    from tinypaged.bench.tiny_heads import make_bigram, save_eagle, save_eagle3, save_glm_mtp
    from tinypaged.bench.tiny_models import tiny_hf_model

    root = Path(tempfile.mkdtemp())
    cases = []  # (name, target dir, speculative_config, expect drafts accepted)
    llama4 = tiny_hf_model("llama", seed=3, num_hidden_layers=4)
    llama4.save_pretrained(root / "llama4")
    (root / "eagle3").mkdir()
    save_eagle3(root / "eagle3", llama4.config, draft_vocab=200)
    cases.append(("eagle3", root / "llama4", {"method": "eagle3", "model": str(root / "eagle3"),
                                              "num_speculative_tokens": 3}, False))
    bigram = tiny_hf_model("llama_untied", seed=3)
    make_bigram(bigram)
    bigram.save_pretrained(root / "bigram")
    (root / "eagle").mkdir()
    save_eagle(root / "eagle", copy=True)
    cases.append(("eagle", root / "bigram", {"method": "eagle", "model": str(root / "eagle"),
                                             "num_speculative_tokens": 3}, True))
    (root / "glm").mkdir()
    save_glm_mtp(root / "glm", copy=True, bigram=True)
    cases.append(("mtp", root / "glm", {"method": "mtp", "num_speculative_tokens": 2}, True))
    engine = dict(dtype="float32", skip_tokenizer_init=True, max_model_len=256, max_num_seqs=8,
                  gpu_memory_utilization=0.3)
    allowed = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True,
                             allowed_token_ids=list(range(2, 130)))
    params = [params if i % 2 == 0 else allowed for i in range(len(prompts))]
    failures = 0
    for name, target, config, accepts in cases:
        llm = LLM(str(target), **engine)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        base = [o.outputs[0].token_ids for o in outs]
        llm.shutdown()
        del llm
        gc.collect()
        counters = {}
        for mode in ({}, {"enforce_eager": True}, {"async_scheduling": False}):
            llm = LLM(str(target), speculative_config=config, **engine, **mode)
            proposer = llm.engine.spec.proposer
            worst = [0.0] if proposer.graphs is not None else None
            if worst is not None:
                compare_graph_steps(proposer, worst)
            for batch in (1, 8):
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:batch]],
                                    params[:batch], use_tqdm=False)
                stats = llm.engine.get_stats()
                spec = stats["spec_decode"]
                rate = acceptance(spec)
                counters.setdefault(batch, []).append(spec["num_accepted_tokens"])
                ok = ([o.outputs[0].token_ids for o in outs] == base[:batch]
                      and stats["num_free_blocks"] == stats["num_total_blocks"]
                      and proposer.blocks.num_free_blocks == proposer.blocks.num_blocks
                      and (rate > 0.5 if accepts else True))
                if not mode:  # the head's drafting steps replayed its graphs, as eager did
                    ok = ok and worst is not None and proposer.graphs.num_replays > 0
                    ok = ok and worst[0] < 1e-3
                else:
                    ok = ok and counters[batch][0] == counters[batch][-1]
                failures += not ok
                head = ("" if worst is None else
                        f" head graphs: {proposer.graphs.num_replays} replays, "
                        f"max |graph - eager| {worst[0]:.2e};")
                report(llm, ok, f"{name} batch {batch}{head}", mode, rate)
            llm.shutdown()
            del llm
            gc.collect()
    print("all equal" if not failures else f"{failures} mismatches")
    return 1 if failures else 0


def compare_graph_steps(proposer, worst: list[float]) -> None:
    """Run each drafting step of the head eagerly, then through its graph (whose outputs the
    proposer goes on with), keeping in worst[0] the largest difference of their logits and
    features (relative to the largest eager value)."""
    eager, decode_step = proposer._run, proposer._decode_step

    def both(items, features):
        want = [t.clone() for t in eager(items, features)]
        got = decode_step(items, features)
        for g, w in zip(got, want):
            diff = (g.float() - w.float()).abs().max() / w.float().abs().max().clamp(min=1e-6)
            worst[0] = max(worst[0], float(diff))
        return got

    proposer._decode_step = both


if __name__ == "__main__":
    sys.exit(main())
