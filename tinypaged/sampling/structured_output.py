"""Structured output: constrain a request's tokens to a JSON schema, a regex, a choice of strings
or a grammar, with xgrammar.

    SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object", ...}))

How one request is constrained:
1. At `add_request` the constraint is compiled once for the tokenizer's vocabulary
   (`GrammarCompiler.compile`, cached by its canonical text), and each of the n samples gets its
   own `GrammarMatcher` (a pushdown automaton's state over the grammar).
2. Each step, before the sampler, every sampled constrained sequence gets one row of a packed
   int32 bitmask [R, ceil(V / 32)] (bit t = token t may come next); the rows go to the device in
   one copy and `kernels/logits.py` sets the other tokens' logits to -inf. With async scheduling
   this happens while the step's forward runs (engine.py: such a step samples late).
3. After sampling, the step's matchers take their tokens in batched calls split over a few
   threads and fill their next rows in one call (`batch_accept`, `MaskFiller`), on a worker
   thread while the engine launches the next step (grammar_worker.py); step 2 sends those rows.
   On a GPU the matchers live in a process of their own, which makes those calls
   (grammar_process.py): xgrammar's calls do not run beside the engine thread's Python.
   When the grammar is complete, the mask lets the stop tokens (eos) through; the request ends
   when one is sampled, or at once when the grammar allows nothing but a stop token.
4. With speculative decoding, a speculating sequence gets one mask per verified position, the
   matcher walked along its drafts and rolled back (spec_decode/grammar.py).

Preemption keeps a sequence's tokens, and its matcher has already accepted them, so a recompute
changes nothing here. The grammar engine is xgrammar, chosen over llguidance by mask time per
token on the default model's 49,152-token vocabulary: it precomputes each grammar position's
token masks when it compiles a schema, where llguidance computes them lazily at every step
(figures in benchmarks/RESULTS.md); it is also vLLM's default backend, so `grammar` takes the
same EBNF (GBNF) text. It is an optional dependency: `pip install "tinypaged[structured]"`.
"""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from tinypaged.host.packages import require

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams: set exactly one of json, regex, choice, grammar,
    json_object. `json` is a JSON schema (a dict or its JSON text); `json_object` asks for any
    JSON object; `disable_any_whitespace` allows no free whitespace between JSON tokens."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        chosen = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object; got {chosen or 'none'}"
            )
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(
                f"structured_outputs.json must be a JSON schema object, got {self.json!r:.80}"
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and not (
            isinstance(self.choice, (list, tuple))
            and self.choice
            and all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError(
                f"structured_outputs.choice must be a non-empty list of strings, got "
                f"{self.choice!r:.80}"
            )
        if self.json_object not in (None, True):
            raise ValueError("structured_outputs.json_object must be true when given")
        if type(self.disable_any_whitespace) is not bool:
            raise ValueError("structured_outputs.disable_any_whitespace must be true or false")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> tuple[str, str, bool]:
        """(kind, canonical text, whitespace flag): equal keys compile to the same grammar."""
        kind = self.kind
        value = getattr(self, kind)
        text = json.dumps(value, sort_keys=True) if kind in ("json", "choice") else str(value)
        return kind, text, self.disable_any_whitespace


def _import_xgrammar():
    return require("xgrammar")  # MissingPackageError (a 400 on the server) names the install


def _choice_grammar(choices: list[str]) -> str:
    # One EBNF string literal per choice; JSON string escapes are valid EBNF escapes.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _clean_error(exc: Exception) -> str:
    # xgrammar prefixes its messages with "[time] /path/file.cc:line: "
    return re.sub(r"^\[[\d:]+\] \S+: ", "", str(exc).strip()).splitlines()[0]


class GrammarCompiler:
    """Compiles constraints for one tokenizer and caches them (one per engine, built at the
    first constrained request: reading the vocabulary takes ~0.2-1 s).

    tokenizer: a transformers tokenizer (or an xgrammar TokenizerInfo made from one); vocab_size:
    the logits' width (may exceed the tokenizer's length: padding ids are never allowed);
    stop_token_ids: the ids that end a sequence (the engine's eos set), allowed once the grammar
    is complete."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
        cache_size: int = 256,
    ) -> None:
        xgr = _import_xgrammar()
        self._xgr = xgr
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        info = tokenizer
        if not isinstance(tokenizer, xgr.TokenizerInfo):
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids
            )
        # xgrammar's own cache is off: ours below is the one place a compile is reused.
        self._compiler = xgr.GrammarCompiler(info, max_threads=4, cache_enabled=False)
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self.cache_size = cache_size
        self.num_compiles = 0

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The CompiledGrammar of `params`, from the cache when seen before. Raises ValueError
        naming the field when the schema, regex or grammar is not valid or not supported."""
        key = params.cache_key()
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        kind, c = key[0], self._compiler
        try:
            if kind == "json":
                compiled = c.compile_json_schema(
                    json.dumps(params.json), any_whitespace=not params.disable_any_whitespace
                )
            elif kind == "json_object":  # OpenAI: a JSON object (xgrammar's builtin: any value)
                compiled = c.compile_json_schema(
                    '{"type": "object"}', any_whitespace=not params.disable_any_whitespace
                )
            elif kind == "regex":
                compiled = c.compile_regex(params.regex)
            elif kind == "choice":
                compiled = c.compile_grammar(_choice_grammar(params.choice))
            else:
                compiled = c.compile_grammar(params.grammar)
        except (RuntimeError, ValueError) as e:
            what = {"json": "JSON schema", "regex": "regex", "grammar": "EBNF grammar"}
            raise ValueError(
                f"structured_outputs.{kind}: invalid or unsupported {what.get(kind, kind)}: "
                f"{_clean_error(e)}"
            ) from None
        self.num_compiles += 1
        self._cache[key] = compiled
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return compiled

    def matcher(self, compiled: Any) -> Any:
        """A fresh GrammarMatcher (one per sequence) at the start of `compiled`."""
        return self._xgr.GrammarMatcher(compiled)

    alive = True  # as GrammarProcess's (whose process can die)

    def close(self) -> None:
        """Nothing to end (GrammarProcess ends its process)."""

    def matchers(self, params: StructuredOutputsParams, n: int) -> list[Any]:
        """n fresh matchers of `params`' grammar (compile's ValueError when it does not
        compile); grammar_process.GrammarProcess has the same call."""
        compiled = self.compile(params)
        return [self.matcher(compiled) for _ in range(n)]


def grammar_threads() -> int:
    """Threads for the batched grammar calls: half the usable cores, at most 4 (the engine
    thread and the rest of the process keep the others)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2
    return max(1, min(4, cores // 2))


class MaskFiller:
    """Fills the bitmask rows of many matchers in one call: xgrammar's BatchGrammarMatcher, on
    `grammar_threads()` threads of its own, without the GIL. One per mask builder and one per
    grammar worker: an instance is never called from two threads at once."""

    def __init__(self) -> None:
        self._batch = _import_xgrammar().BatchGrammarMatcher(grammar_threads())

    def fill(self, matchers: list[Any], bitmask: Any, rows: list[int] | None = None) -> None:
        """Matcher i fills row rows[i] of `bitmask` (int32 [R, ceil(V / 32)] on the CPU); row i
        without `rows`."""
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)


# Below this many matchers one call is cheaper than handing chunks to other threads.
MIN_ROWS_PER_CHUNK = 32


def batch_accept(matchers: list[Any], tokens: list[int], pool: Executor | None = None,
                 num_chunks: int = 1) -> list[int]:
    """Each matcher takes its token in batched xgrammar calls (which release the GIL); returns
    the indices of the matchers whose token was rejected (they keep their state). xgrammar walks
    one batch on one thread, so with a `pool` the batch is cut into up to `num_chunks` chunks of
    at least MIN_ROWS_PER_CHUNK matchers, all but the last taken by the pool's threads while the
    caller takes the last."""
    n = len(matchers)
    chunks = min(num_chunks, n // MIN_ROWS_PER_CHUNK) if pool is not None else 1
    if chunks <= 1:
        return _accept_chunk(matchers, tokens, 0)
    size = -(-n // chunks)
    futures = [pool.submit(_accept_chunk, matchers[i : i + size], tokens[i : i + size], i)
               for i in range(0, n - size, size)]
    last = len(futures) * size
    rejected = _accept_chunk(matchers[last:], tokens[last:], last)
    return [i for f in futures for i in f.result()] + rejected  # in order: sorted


def _accept_chunk(matchers: list[Any], tokens: list[int], offset: int) -> list[int]:
    """batch_accept of one chunk whose first matcher is matchers' `offset`-th."""
    xgr = _import_xgrammar()
    raw = getattr(getattr(xgr.base, "_core", None), "BatchGrammarMatcher", None)
    if raw is None:  # another xgrammar layout: its public call, which converts every result
        accepted = xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
        return [offset + i for i, ok in enumerate(accepted) if not ok]
    # The public wrapper reads its result array element by element (an FFI call each, ~1.7 us
    # a row with the GIL held); `0 in result` is one call, and a rejection is rare.
    result = raw.batch_accept_token([m._handle for m in matchers], tokens, False)
    if 0 not in result:
        return []
    return [offset + i for i, ok in enumerate(list(result)) if not ok]


def grammar_only_allows_stop(matcher: Any, vocab_size: int, stop_token_ids: list[int]) -> bool:
    """True when the grammar is complete and no token but a stop token may follow (checked
    only once the grammar is complete, so the extra mask fill is rare)."""
    if not matcher.is_completed():
        return False
    import numpy as np
    import torch

    mask = torch.empty((1, (vocab_size + 31) // 32), dtype=torch.int32)
    matcher.fill_next_token_bitmask(mask, 0)
    words = mask.numpy().view(np.uint32)
    for t in stop_token_ids:
        words[0, t >> 5] &= ~(1 << (t & 31)) & 0xFFFFFFFF
    return not words.any()
