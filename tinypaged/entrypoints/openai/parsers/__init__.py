"""Parsers of generated text for the chat API, outside the engine: tool calls and reasoning.

One module per format; the server picks one by name, with vLLM's flag values:

    --tool-call-parser  hermes | llama3_json | glm45 | glm47
    --reasoning-parser  qwen3 | deepseek_r1 | glm45
"""

from __future__ import annotations

from tinypaged.entrypoints.openai.parsers.glm45 import Glm45ToolParser
from tinypaged.entrypoints.openai.parsers.hermes import HermesToolParser
from tinypaged.entrypoints.openai.parsers.llama3_json import Llama3JsonToolParser
from tinypaged.entrypoints.openai.parsers.reasoning import (
    DeepSeekR1ReasoningParser,
    Glm45ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
)
from tinypaged.entrypoints.openai.parsers.tool_calls import ToolCall, ToolCallStream, ToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "glm45": Glm45ToolParser,
    "glm47": Glm45ToolParser,
}

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "glm45": Glm45ReasoningParser,
}

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ReasoningParser",
    "ToolCall",
    "ToolCallStream",
    "ToolParser",
]
