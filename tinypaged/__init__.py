"""tinypaged: a pure-Triton LLM inference engine with a paged KV cache.

    from tinypaged import LLM, SamplingParams
    llm = LLM()  # the built-in SmolLM2-135M-Instruct
    print(llm.generate("The capital of France is")[0].outputs[0].text)

Importing the package loads nothing heavy: torch, triton and transformers are imported when a
name below is first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_LAZY = {
    "LLM": "tinypaged.engine.llm",
    "AsyncLLM": "tinypaged.engine.async_llm",
    "SamplingParams": "tinypaged.sampling.params",
    "EngineConfig": "tinypaged.config",
    "LoRARequest": "tinypaged.lora.request",
    "RequestOutput": "tinypaged.outputs",
    "CompletionOutput": "tinypaged.outputs",
    "StructuredOutputsParams": "tinypaged.sampling.structured_output",
    "PoolingParams": "tinypaged.pooling.params",
}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:
    # For type checkers and IDEs only: at run time `__getattr__` below imports these lazily.
    from tinypaged.config import EngineConfig  # noqa: F401
    from tinypaged.engine.async_llm import AsyncLLM  # noqa: F401
    from tinypaged.engine.llm import LLM  # noqa: F401
    from tinypaged.lora.request import LoRARequest  # noqa: F401
    from tinypaged.outputs import CompletionOutput, RequestOutput  # noqa: F401
    from tinypaged.pooling.params import PoolingParams  # noqa: F401
    from tinypaged.sampling.params import SamplingParams  # noqa: F401
    from tinypaged.sampling.structured_output import StructuredOutputsParams  # noqa: F401


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tinypaged' has no attribute {name!r}")
