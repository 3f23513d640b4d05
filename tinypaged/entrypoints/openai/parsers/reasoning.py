"""Reasoning parsers: split a thinking model's `<think>...</think>` from its answer.

    <think>The user greets me.</think>Hello!   ->   reasoning_content "The user greets me."
                                                     content           "Hello!"

Three families, chosen with `--reasoning-parser` (vLLM's names), differ only in what an output
without the tags means:

    qwen3, glm45   thinking is optional (Qwen3's `enable_thinking: false` writes an empty
                   <think></think> into the prompt): no </think> in the output -> all content
    deepseek_r1    the template opens <think> in the prompt, so the output starts inside the
                   reasoning: no </think> -> all reasoning

Streaming (`ReasoningStream`) sends reasoning deltas until the end tag, then content deltas,
holding back trailing characters that may be the start of a tag split across tokens.
"""

from __future__ import annotations

from tinypaged.entrypoints.openai.parsers.tool_calls import held_prefix

THINK_START, THINK_END = "<think>", "</think>"


class ReasoningParser:
    starts_in_reasoning = False  # the prompt already opened <think>

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished output; either may be None."""
        body = text.lstrip()
        opened = body.startswith(THINK_START)
        if opened:
            body = body[len(THINK_START) :]
        if THINK_END not in body:
            if self.starts_in_reasoning:
                return body or None, None
            return None, text
        reasoning, _, content = body.partition(THINK_END)
        return reasoning or None, content or None


class Qwen3ReasoningParser(ReasoningParser):
    pass


class Glm45ReasoningParser(ReasoningParser):
    pass


class DeepSeekR1ReasoningParser(ReasoningParser):
    starts_in_reasoning = True


class ReasoningStream:
    """One choice's streamed reasoning: `update(text, finished)` with the cumulative text returns
    the new reasoning text and the content so far (None while the model is still thinking)."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.reasoning_sent = 0

    def split(self, text: str, finished: bool) -> tuple[str, str | None]:
        """(reasoning that is certain, content or None while still reasoning)."""
        body = text.lstrip()
        undecided = THINK_START.startswith(body) and not finished
        if undecided:
            return "", None
        opened = body.startswith(THINK_START)
        if not opened and not self.parser.starts_in_reasoning:
            return "", text
        if opened:
            body = body[len(THINK_START) :]
        if THINK_END in body:
            reasoning, _, content = body.partition(THINK_END)
            return reasoning, content
        hold = 0 if finished else held_prefix(body, THINK_END)
        return body[: len(body) - hold], None

    def update(self, text: str, finished: bool) -> tuple[str, str | None]:
        """(new reasoning text, the content so far or None)."""
        reasoning, content = self.split(text, finished)
        new = reasoning[self.reasoning_sent :]
        self.reasoning_sent = len(reasoning)
        return new, content
