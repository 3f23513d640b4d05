"""The typed messages between AsyncLLM and the engine loop (EngineCore, engine/core.py).

The same messages travel in both modes: through a queue when the loop runs in a thread, through
pipes when it runs in a process of its own (engine/core_client.py). So every one of them pickles.

    AsyncLLM  --- AddRequest | AbortRequest | Shutdown --->  EngineCore (between two steps)
              <-- EngineStepOutput (one per step) --------   Engine.step()
              <-- EngineStopped (always the last one) ----
    the engine process, once, before anything else: EngineReady

A request's prompt and prompt ids travel back only in its first output (later ones carry None,
AsyncLLM keeps the first copy): a long prompt is not pickled again at every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tinypaged.config import EngineConfig
    from tinypaged.engine.engine import Engine, PromptType
    from tinypaged.outputs import RequestOutput
    from tinypaged.sampling.params import SamplingParams


# ------------------------------------------------------------------ to the engine loop


@dataclass
class AddRequest:
    """Queue a request. The engine loop tokenizes and validates it (Engine.add_request); a
    refusal comes back as that request's error in the next EngineStepOutput."""

    request_id: str
    prompt: PromptType
    params: SamplingParams
    lora_request: Any = None  # a LoRARequest: run by that adapter


@dataclass
class AbortRequest:
    """Drop a request and free its KV blocks; an unknown id is a no-op."""

    request_id: str


@dataclass
class Shutdown:
    """Stop after the step in progress; the requests still open are dropped."""


EngineCoreRequest = AddRequest | AbortRequest | Shutdown


# ------------------------------------------------------------------ from the engine loop


@dataclass
class EngineReady:
    """What the client side needs of an engine it cannot touch: sent once the engine is built."""

    config: EngineConfig  # as the engine resolved it (max_model_len, async_scheduling)
    model_name: str
    model_dir: str  # where the client side loads its own copy of the tokenizer
    kv_cache_info: dict[str, Any]
    default_sampling_params: dict[str, Any]  # from the model's generation_config.json
    stats: dict[str, Any]  # Engine.get_stats() before the first step

    @classmethod
    def of(cls, engine: Engine) -> EngineReady:
        return cls(engine.config, engine.model_name, str(engine.model_dir),
                   engine.kv_cache_info, engine.default_sampling_params, engine.get_stats())


@dataclass
class EngineStepOutput:
    """One step's news: the outputs of the requests that moved, the requests that failed (each
    with its exception: refused at admission, or failed in the step), and the engine's stats
    after the step (queue lengths, KV usage; what /metrics shows)."""

    outputs: list[RequestOutput]
    errors: list[tuple[str, BaseException]]
    stats: dict[str, Any] | None  # None only when the client made this message (no step ran)


@dataclass
class EngineStopped:
    """The loop has ended and will answer nothing more: every open request fails with `error`,
    or with "the engine was shut down" when `error` is None (a Shutdown was asked for)."""

    error: BaseException | None
    stats: dict[str, Any] | None = None  # the engine's last stats, when it could still tell


EngineCoreOutput = EngineStepOutput | EngineStopped
