"""One chat choice's generated text as the assistant's message: reasoning, content, tool calls.

Without parsers the whole text is `content`. With a reasoning parser, `<think>...</think>` goes
to `reasoning_content`; with a tool parser (chosen by `tool_choice`, see `output_for`), the
calls found in the content go to `tool_calls` and `finish_reason` becomes "tool_calls" (vLLM
keeps "stop" for a named function, as OpenAI does). The same object answers both ways: once,
for a whole response (`message`), or step by step for a stream (`delta`), with the cumulative
text each time.
"""

from __future__ import annotations

from typing import Any

from tinypaged.entrypoints.openai.chat_protocol import ChatOptions
from tinypaged.entrypoints.openai.parsers import ReasoningParser, ToolCallStream, ToolParser
from tinypaged.entrypoints.openai.parsers.forced import NamedToolParser, RequiredToolParser
from tinypaged.entrypoints.openai.parsers.reasoning import ReasoningStream


class ChatOutput:
    def __init__(
        self,
        tool_parser: ToolParser | None = None,
        reasoning_parser: ReasoningParser | None = None,
        keep_finish_reason: bool = False,
    ) -> None:
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.keep_finish_reason = keep_finish_reason  # a named tool_choice ends with "stop"
        self.reasoning_stream = reasoning_parser and ReasoningStream(reasoning_parser)
        self.tool_stream = tool_parser and ToolCallStream(tool_parser)
        self.content_sent = 0
        self.called = False

    def finish_reason(self, reason: str | None) -> str | None:
        if self.called and reason == "stop" and not self.keep_finish_reason:
            return "tool_calls"
        return reason

    def message(self, text: str) -> dict[str, Any]:
        """The whole assistant message of a finished output."""
        reasoning, content = None, text
        if self.reasoning_parser is not None:
            reasoning, content = self.reasoning_parser.extract_reasoning(text)
        calls = []
        if self.tool_parser is not None and content is not None:
            content, calls = self.tool_parser.extract_tool_calls(content)
        self.called = bool(calls)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning_parser is not None:
            message["reasoning_content"] = reasoning
        if self.tool_parser is not None:
            message["tool_calls"] = [c.as_dict() for c in calls]
        # vLLM's (and OpenAI's) full message shape: the fields this server never fills are null
        for name in ("tool_calls", "refusal", "annotations", "audio", "function_call"):
            message.setdefault(name, None)
        return message

    def delta(self, text: str, finished: bool) -> dict[str, Any]:
        """What is new in the cumulative `text` since the last call, as a stream delta."""
        delta: dict[str, Any] = {}
        if self.reasoning_stream is not None:
            reasoning, content = self.reasoning_stream.update(text, finished)
            if reasoning:
                delta["reasoning_content"] = reasoning
            if content is None:
                return delta
            text = content
        if self.tool_stream is not None:
            delta.update(self.tool_stream.update(text, finished) or {})
            self.called = self.tool_stream.called
        elif len(text) > self.content_sent:
            delta["content"] = text[self.content_sent :]
            self.content_sent = len(text)
        return delta


def output_for(
    opts: ChatOptions | None,
    tool_parser: type[ToolParser] | None,
    reasoning_parser: type[ReasoningParser] | None,
) -> ChatOutput:
    """The ChatOutput of one choice of a request with these options and the server's parsers
    (`tool_parser` is only used for tool_choice "auto")."""
    reasoning = reasoning_parser() if reasoning_parser is not None else None
    if opts is None or not opts.tools or opts.tool_choice == "none":
        return ChatOutput(None, reasoning)
    if opts.named_tool is not None:
        return ChatOutput(NamedToolParser(opts.named_tool), reasoning, keep_finish_reason=True)
    if opts.tool_choice == "required":
        parser: ToolParser | None = RequiredToolParser(opts.tools)
    else:
        parser = tool_parser(opts.tools) if tool_parser else None
    if parser is not None and not opts.parallel_tool_calls:
        parser.max_calls = 1
    return ChatOutput(parser, reasoning)
