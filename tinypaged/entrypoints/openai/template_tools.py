"""Chat templates that drop `tools`: detected once per template, answered instead of ignored.

Many small models' templates (SmolLM2's, the built-in default model's, among them) never read
the `tools` variable: the tools a request sends vanish from the prompt, the model cannot know
about them, and `tool_choice: "auto"` would answer prose with no word of why. So the server
renders one probe conversation with and without a probe tool; identical prompts mean the template
drops tools (cached per tokenizer and template). Then:

    tool_choice "auto"                  400: the model never sees the tools, so it cannot call
                                        one; the message names the ways out
    "required" or a named function      served (the output is constrained to the call's JSON
                                        through structured output, so the call is well formed),
                                        with a warning in the log, once per template: the model
                                        sees only the JSON grammar, not the tools' descriptions
    "none"                              nothing to check
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from tinypaged.entrypoints.openai.errors import bad_request

logger = logging.getLogger(__name__)

_PROBE_MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": "tinypaged_probe_tool", "description": "a probe: does the template render tools?",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@functools.lru_cache(maxsize=32)
def template_drops_tools(tok: Any, chat_template: str | None = None) -> bool:
    """Whether `tok`'s chat template (or `chat_template`) renders the same prompt with and
    without tools. A template that cannot render the probe counts as rendering them (the
    request's own rendering then reports its error)."""
    try:
        bare = tok.render_chat(_PROBE_MESSAGES, True, chat_template)
        with_tools = tok.render_chat(_PROBE_MESSAGES, True, chat_template, tools=_PROBE_TOOLS)
    except Exception:  # noqa: BLE001 - e.g. a template that raises on unknown roles
        return False
    return bare == with_tools


_warned: set[tuple[int, str | None]] = set()


def check_template_renders_tools(tok: Any, opts: Any, model: str) -> None:
    """Refuse (400) or warn about a request whose tools the chat template drops (module doc)."""
    if opts is None or not opts.tools or opts.tool_choice == "none":
        return
    template = opts.chat_template_kwargs.get("chat_template")
    if not template_drops_tools(tok, template):
        return
    if opts.tool_choice == "auto":
        raise bad_request(
            "tools",
            f"the chat template of {model} does not render 'tools', so the model never sees "
            "them and cannot call one with tool_choice 'auto'; send tool_choice 'required' or "
            "a named function (the output is then constrained to a call), or start the server "
            "with --chat-template FILE, a template that renders tools",
            code="tools_not_supported",
        )
    key = (id(tok), template)
    if key not in _warned:
        _warned.add(key)
        logger.warning(
            "the chat template of %s does not render 'tools': tool_choice %s is served through "
            "structured output alone (the model does not see the tools' descriptions)",
            model, "required" if opts.tool_choice == "required" else "(a named function)",
        )
