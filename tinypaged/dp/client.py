"""DPAsyncLLM: N engines behind one EngineClient (engine/client.py), for `serve
--data-parallel-size N`.

Each engine is an AsyncLLM around its own engine process (launch.py); the router (router.py)
picks one per request. The server sees one engine:

    generate(prompt, ..., id)  router.choose(prompt) -> engines[i].generate; i remembered
    abort(id)                  engines[i].abort(id), the engine that has it
    get_stats()                the sums over the live engines, and "per_engine": each engine's
                               own (the /metrics gauges carry an `engine` label, as vLLM's)
    is_running                 while at least one engine runs

An engine that dies (its process exited) fails its own open requests with an error naming it;
the router sends nothing more to it and the other engines keep serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from tinypaged.config import EngineConfig
from tinypaged.dp.launch import start_engines
from tinypaged.dp.router import Router
from tinypaged.engine.async_llm import AsyncLLM
from tinypaged.engine.client import EngineClient
from tinypaged.engine.stats import IterationStats

if TYPE_CHECKING:
    from tinypaged.outputs import RequestOutput
    from tinypaged.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

_SUMMED = ("num_running", "num_waiting", "num_free_blocks", "num_total_blocks")


def merged_stats(per_engine: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's stats dict for all of them: counts summed, KV usage over all blocks."""
    out: dict[str, Any] = {k: sum(s.get(k, 0) for s in per_engine) for k in _SUMMED}
    total = out["num_total_blocks"]
    out["kv_cache_usage"] = (
        sum(s.get("kv_cache_usage", 0.0) * s.get("num_total_blocks", 0) for s in per_engine)
        / total if total else 0.0)
    steps = [s["iteration_stats"] for s in per_engine if s.get("iteration_stats") is not None]
    if steps:
        merged = IterationStats()
        for st in steps:
            merged.bucket_counts = [a + b for a, b in zip(merged.bucket_counts, st.bucket_counts)]
            merged.num_steps += st.num_steps
            merged.num_tokens += st.num_tokens
            merged.num_preemptions += st.num_preemptions
        out["iteration_stats"] = merged
    out["per_engine"] = per_engine
    return out


class DPAsyncLLM(EngineClient):
    def __init__(self, model: str | None = None, *, multiprocess_mode: bool = True,
                 **kwargs: Any):
        """As AsyncLLM's; the engines always run in processes of their own."""
        self._start(EngineConfig.from_kwargs(model=model, **kwargs))

    @classmethod
    def from_config(cls, config: EngineConfig) -> DPAsyncLLM:
        self = cls.__new__(cls)
        self._start(config)
        return self

    def _start(self, config: EngineConfig) -> None:
        self.engines = [AsyncLLM.from_client(c) for c in start_engines(config)]
        first = self.engines[0].config
        self._config = dataclasses.replace(first, data_parallel_size=len(self.engines),
                                           data_parallel_routing=config.data_parallel_routing)
        self.router = Router(len(self.engines), first.block_size, config.data_parallel_routing)
        self._owner: dict[str, int] = {}  # request id -> its engine, while in flight
        self._closing = False

    # The EngineClient interface: engine 0 speaks for the settings every engine shares.
    @property
    def tokenizer(self):
        return self.engines[0].tokenizer

    @property
    def config(self) -> EngineConfig:
        return self._config

    @property
    def model_name(self) -> str:
        return self.engines[0].model_name

    @property
    def default_sampling_params(self) -> dict:
        return self.engines[0].default_sampling_params

    @property
    def kv_cache_info(self) -> dict:
        """Engine 0's layout; num_blocks and num_tokens summed over the engines."""
        info = dict(self.engines[0].kv_cache_info)
        for key in ("num_blocks", "num_tokens"):
            if key in info:
                info[key] = sum(e.kv_cache_info.get(key, 0) for e in self.engines)
        return info

    @property
    def is_running(self) -> bool:
        self._notice_deaths()
        return any(self.router.alive)

    def get_stats(self) -> dict:
        self._notice_deaths()
        return merged_stats([e.get_stats() for e in self.engines])

    async def generate(
        self, prompt: Any, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        if request_id in self._owner:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self._notice_deaths()
        i = self.router.choose(prompt)
        self._owner[request_id] = i
        engine = self.engines[i]
        stream = engine.generate(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        except RuntimeError as exc:
            if engine.is_running:
                raise
            self._notice_deaths()
            raise RuntimeError(f"data-parallel engine {i} stopped: {exc}") from exc
        finally:
            self._owner.pop(request_id, None)
            self.router.finished(i)
            await stream.aclose()  # closed early (a disconnect): the engine drops it now

    async def abort(self, request_id: str) -> None:
        i = self._owner.get(request_id)
        if i is not None:
            await self.engines[i].abort(request_id)

    async def shutdown(self) -> None:
        self._closing = True
        await asyncio.gather(*(e.shutdown() for e in self.engines))

    def _notice_deaths(self) -> None:
        for i, engine in enumerate(self.engines):
            if self.router.alive[i] and not engine.is_running:
                self.router.mark_dead(i)
                if self._closing:
                    continue
                why = getattr(engine, "_fatal", None) or "shut down"
                logger.error("data-parallel engine %d stopped (%s); %d of %d still serving", i,
                             why, sum(self.router.alive), len(self.engines))
