"""The `Tokenizer` interface the engine uses, and what every tokenizer shares.

Two tokenizers implement it: the model's own Hugging Face tokenizer (hf.py) and ChatGLM's,
read without its remote code (chatglm.py); `load_tokenizer` (tokenizer.py) picks one.

eos_token_ids = {the tokenizer's eos} | {generation_config.json's eos_token_id (int or list)}:
instruct models often end turns with a token that is not the tokenizer's eos (e.g. <|eot_id|>).
sampling/generation_config.py reads that file (the one place that does); it imports nothing from
tinypaged, so the tokenizers may import it.
"""

from __future__ import annotations

import functools
from typing import Any

Messages = list[dict[str, Any]]


class Tokenizer:
    """The interface the engine uses. Subclasses fill the attributes and the first four methods."""

    eos_token_ids: set[int]  # sampling any of these ends a sequence (unless ignore_eos)
    vocab_size: int  # number of ids the tokenizer knows, added tokens included
    all_special_ids: list[int]
    chat_template: str | None = None  # overrides the model's template when set

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        raise NotImplementedError

    def render_chat(
        self,
        messages: Messages,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The chat prompt as text (what `apply_chat_template` tokenizes).

        template_kwargs: `tools` (OpenAI tool list, rendered by the template),
        `continue_final_message` (leave the last message open) and any variable the template
        reads (e.g. Qwen3's `enable_thinking`)."""
        raise NotImplementedError

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest token string of the vocabulary, in characters: no token stands for more
        characters of text than this (a byte-level token's string has one character per byte,
        a SentencePiece byte token "<0x0A>" more than the one it stands for)."""
        tokens = self.convert_ids_to_tokens(list(range(self.vocab_size)))
        return max((len(t) for t in tokens if t), default=1)

    def apply_chat_template(
        self,
        messages: Messages,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """The chat prompt as token ids, ready to generate from."""
        text = self.render_chat(messages, add_generation_prompt, chat_template, **template_kwargs)
        # The template writes the special tokens (bos included) itself.
        return self.encode(text, add_special_tokens=False)
