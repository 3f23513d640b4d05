"""Which grammar engine: llguidance vs xgrammar, timed on the default model's tokenizer (CPU).

    PYTHONPATH=. python benchmarks/grammar_engines.py [--model DIR] [--repeats 5]

For a nested JSON schema, each engine compiles the schema for SmolLM2's 49,152-token vocabulary,
then walks a valid document token by token: fill the packed int32 bitmask of the allowed next
tokens, then accept the token. Checks first that every token of the document is allowed by both
engines' masks (and the end is reached), then prints compile time and the median and p99 time
of one mask fill. Needs both packages (`pip install llguidance xgrammar`); tinypaged itself uses
only the one named in tinypaged/sampling/structured_output.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "pets": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "kind": {"enum": ["cat", "dog", "fish"]},
                    "age": {"type": "number"},
                },
                "required": ["kind", "age"],
                "additionalProperties": False,
            },
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "address", "tags", "pets", "active"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Ada Lovelace", "age": 36,
    "address": {"street": "12 St James's Square", "city": "London", "zip": "12345"},
    "tags": ["math", "engines"],
    "pets": [{"kind": "cat", "age": 3}, {"kind": "dog", "age": 7.5}],
    "active": True,
}


def allowed(mask: torch.Tensor, token: int) -> bool:
    return bool((int(mask[0, token // 32]) >> (token % 32)) & 1)


def walk_llguidance(hf_tok, vocab: int, ids: list[int], eos: int, repeats: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    t0 = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab)
    t_tok = time.perf_counter() - t0
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False}
    )
    mask = llguidance.torch.allocate_token_bitmask(1, vocab)
    times, compile_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(tok, grammar)
        compile_s.append(time.perf_counter() - t0)
        for t in ids:
            t0 = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(m, mask, 0)
            times.append(time.perf_counter() - t0)
            assert allowed(mask, t), f"llguidance masked out document token {t}"
            assert m.consume_token(t), m.get_error()
        llguidance.torch.fill_next_token_bitmask(m, mask, 0)
        assert allowed(mask, eos) and m.is_accepting()
    return {"tokenizer_s": t_tok, "compile_s": min(compile_s), "times": times}


def walk_xgrammar(hf_tok, vocab: int, ids: list[int], eos: int, repeats: int) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab)
    t_tok = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, vocab)
    times, compile_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        # A fresh compiler each time: the cache would make later compiles free.
        compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(
            json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")
        )
        m = xgr.GrammarMatcher(compiled)
        compile_s.append(time.perf_counter() - t0)
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask, 0)
            times.append(time.perf_counter() - t0)
            assert allowed(mask, t), f"xgrammar masked out document token {t}"
            assert m.accept_token(t)
        m.fill_next_token_bitmask(mask, 0)
        assert allowed(mask, eos)
    return {"tokenizer_s": t_tok, "compile_s": min(compile_s), "times": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model dir (default: the built-in model)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    if args.model is None:
        from tinypaged.models.default_model import ensure_default_model

        args.model = str(ensure_default_model())
    hf_tok = AutoTokenizer.from_pretrained(args.model)
    vocab = len(hf_tok)
    # Compact separators: the grammars above allow no free whitespace.
    ids = hf_tok.encode(json.dumps(DOCUMENT, separators=(",", ":")), add_special_tokens=False)
    eos = hf_tok.eos_token_id
    print(f"vocab {vocab}, document {len(ids)} tokens, {args.repeats} walks, CPU")
    print("| engine | tokenizer init | schema compile | mask fill median | p99 | mean |")
    print("|---|---|---|---|---|---|")
    for name, walk in (("llguidance", walk_llguidance), ("xgrammar", walk_xgrammar)):
        r = walk(hf_tok, vocab, ids, eos, args.repeats)
        t = sorted(r["times"])
        p99 = t[min(len(t) - 1, int(0.99 * len(t)))]
        print(
            f"| {name} | {r['tokenizer_s'] * 1e3:.0f} ms | {r['compile_s'] * 1e3:.1f} ms | "
            f"{statistics.median(t) * 1e6:.0f} us | {p99 * 1e6:.0f} us | "
            f"{statistics.fmean(t) * 1e6:.0f} us |"
        )


if __name__ == "__main__":
    main()
