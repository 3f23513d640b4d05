"""EngineClient: what the server, the CLI and the benchmarks may ask of an engine.

vLLM calls this seam `EngineClient` (vllm/engine/protocol.py): the OpenAI server talks to an
engine only through it, never to the scheduler, the runner or the requests behind it. Here
`AsyncLLM` is the one real implementation, whether its engine loop runs in a thread or in a
process of its own (engine/core_client.py); tests give the server small fakes of it. Both
subclass this ABC, so a fake that lacks a member cannot even be built (TypeError naming the
member), and the server refuses anything else at construction:

    server  -> engine.generate(prompt, params, request_id)   async stream of RequestOutput
               engine.abort(request_id)                      drop it at the next step
               engine.tokenizer / config / model_name        tokenize, limits, /v1/models
               engine.default_sampling_params                the model's generation_config
               engine.is_running                             /health, 503 when the engine died
    metrics -> engine.get_stats(), engine.kv_cache_info      gauges at scrape time
    CLI     -> engine.shutdown()                             when the server stops
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tinypaged.config import EngineConfig
    from tinypaged.outputs import RequestOutput
    from tinypaged.sampling.params import SamplingParams
    from tinypaged.tokenizer.tokenizer import Tokenizer


class EngineClient(ABC):
    """An engine behind an asyncio API: requests in, streams of cumulative outputs back."""

    @property
    @abstractmethod
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer: encode / decode / chat templates."""

    @property
    @abstractmethod
    def config(self) -> EngineConfig:
        """The engine's settings; the server reads max_model_len and max_num_seqs."""

    @property
    @abstractmethod
    def model_name(self) -> str:
        """The model's name, served when no --served-model-name is given."""

    @property
    @abstractmethod
    def default_sampling_params(self) -> dict[str, Any]:
        """SamplingParams fields from the model's generation_config.json ({} when none)."""

    @property
    @abstractmethod
    def kv_cache_info(self) -> dict[str, Any]:
        """The KV cache's layout: num_blocks, block_size, num_tokens, bytes, device, dtype."""

    @property
    @abstractmethod
    def is_running(self) -> bool:
        """False once the engine has stopped (shut down, or a tensor-parallel rank died)."""

    @abstractmethod
    def get_stats(self) -> dict[str, Any]:
        """Queue lengths and KV usage as of the last step (num_running, num_waiting,
        kv_cache_usage, iteration_stats); never blocks."""

    @abstractmethod
    def generate(
        self, prompt: Any, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs as tokens arrive; the last has finished=True.
        A request the engine refuses raises ValueError before the first output."""

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Drop a request; an unknown id is a no-op."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop the engine; every unfinished stream ends with an error."""
