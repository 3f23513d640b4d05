"""Which engine gets a request: cache-aware, as SGLang's router, else the least loaded.

The router sees each prompt before any engine does. It hashes the prompt's first blocks, each
hash covering everything before it (a chain, as the prefix cache's block hashes: token ids in
blocks of `block_size`; a text prompt in chunks of CHARS_PER_BLOCK characters, so the router
never tokenizes), and remembers which engine last took each hash. A new request goes to the
engine that served its longest known prefix, unless that engine is overloaded:

    load(e) - load(least) > balance_abs  and  load(e) > balance_rel * load(least)

(load = requests in flight), in which case, or when no prefix is known, it goes to the least
loaded engine (ties taken in turn). `least_loaded` skips the prefix lookup; `round_robin` takes
engines in turn whatever they hold (the baseline the benchmarks compare with). Dead engines are
never chosen. Not thread-safe: one event loop (or one caller) drives it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Any

CHARS_PER_BLOCK = 64  # a text prompt's "block": about 16 tokens of English
MAX_BLOCKS = 64  # hashes per prompt: its first 64 blocks
MAX_ENTRIES = 1 << 16  # remembered hashes, least recently used dropped first
POLICIES = ("cache_aware", "least_loaded", "round_robin")


def prefix_hashes(prompt: Any, block_size: int, max_blocks: int = MAX_BLOCKS) -> list[int]:
    """The chained hashes of the prompt's first full blocks ([] when it has none)."""
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
    if isinstance(prompt, str):
        units, size = prompt, CHARS_PER_BLOCK
    elif isinstance(prompt, (list, tuple)):
        units, size = tuple(prompt), block_size
    else:
        return []
    hashes, h = [], hash(type(units))  # text and ids never share a hash
    for start in range(0, min(len(units) // size, max_blocks) * size, size):
        h = hash((h, units[start : start + size]))
        hashes.append(h)
    return hashes


class Router:
    def __init__(self, num_engines: int, block_size: int, policy: str = "cache_aware",
                 balance_abs: int = 16, balance_rel: float = 1.5):
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        self.block_size = block_size
        self.policy = policy
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.load = [0] * num_engines  # requests in flight
        self.alive = [True] * num_engines
        self.routed = [0] * num_engines  # requests sent, cumulative
        self.cache_hits = 0  # requests sent to the engine holding their prefix
        self._owner: OrderedDict[int, int] = OrderedDict()  # prefix hash -> engine
        self._turn = itertools.count()

    def choose(self, prompt: Any) -> int:
        """The engine for `prompt`; counts it in flight there (call `finished` when it ends).
        RuntimeError when every engine is dead."""
        live = [i for i, ok in enumerate(self.alive) if ok]
        if not live:
            raise RuntimeError("every data-parallel engine has stopped")
        if self.policy == "round_robin":
            engine = live[next(self._turn) % len(live)]
            hashes = []
        else:
            hashes = prefix_hashes(prompt, self.block_size)
            engine = self._cached(hashes) if self.policy == "cache_aware" else None
            least = min(self.load[i] for i in live)
            if engine is not None and self._overloaded(engine, least):
                engine = None
            if engine is None:
                tied = [i for i in live if self.load[i] == least]
                engine = tied[next(self._turn) % len(tied)]
            else:
                self.cache_hits += 1
        for h in hashes:
            self._owner[h] = engine
            self._owner.move_to_end(h)
        while len(self._owner) > MAX_ENTRIES:
            self._owner.popitem(last=False)
        self.load[engine] += 1
        self.routed[engine] += 1
        return engine

    def finished(self, engine: int) -> None:
        self.load[engine] -= 1

    def mark_dead(self, engine: int) -> None:
        """Route nothing more to `engine`, and forget the prefixes it held."""
        self.alive[engine] = False
        for h in [h for h, e in self._owner.items() if e == engine]:
            del self._owner[h]

    def _cached(self, hashes: list[int]) -> int | None:
        """The live engine that took the longest of these prefixes last."""
        for h in reversed(hashes):
            engine = self._owner.get(h)
            if engine is not None and self.alive[engine]:
                return engine
        return None

    def _overloaded(self, engine: int, least: int) -> bool:
        load = self.load[engine]
        return load - least > self.balance_abs and load > self.balance_rel * least
