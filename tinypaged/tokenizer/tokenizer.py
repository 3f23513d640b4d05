"""Tokenizers: text <-> token ids, chat templates and the set of end-of-sequence ids.

`load_tokenizer(model_dir)` wraps the model's own HF tokenizer (`transformers.AutoTokenizer`,
never remote code). A ChatGLM checkpoint ships its tokenizer as remote code around a
sentencepiece `tokenizer.model`; for it we load the sentencepiece model directly
(`chatglm.py`). Both give the engine the same `Tokenizer` interface.

eos_token_ids = {the tokenizer's eos} | {generation_config.json's eos_token_id (int or list)}:
instruct models often end turns with a token that is not the tokenizer's eos (e.g. <|eot_id|>).
sampling/generation_config.py reads that file (the one place that does); it imports nothing from
tinypaged, so the tokenizer may import it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from tinypaged.sampling.generation_config import read_eos_token_ids

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


class HFTokenizer(Tokenizer):
    """A `transformers` tokenizer behind the engine's interface (`.hf` is the wrapped one)."""

    def __init__(self, hf, eos_token_ids: set[int], chat_template: str | None = None) -> None:
        self.hf = hf
        self.eos_token_ids = set(eos_token_ids)
        self.vocab_size = len(hf)
        # Named special tokens plus every added token marked special: what decode skips.
        added = getattr(hf, "added_tokens_decoder", {}) or {}
        special = set(hf.all_special_ids) | {i for i, t in added.items() if t.special}
        self.all_special_ids = sorted(special)
        self.chat_template = chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(ids)

    def render_chat(
        self,
        messages: Messages,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        template = chat_template or self.chat_template or self.hf.chat_template
        if not template:
            raise ValueError(
                f"the tokenizer of {self.hf.name_or_path!r} has no chat template; pass "
                "chat_template=<a Jinja template string or file> or send a plain prompt"
            )
        return self.hf.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=template,
            **template_kwargs,
        )


def _read_chat_template(chat_template: str | None) -> str | None:
    # Like vLLM's --chat-template: a path to a template file, or the template itself.
    if chat_template and "{" not in chat_template and Path(chat_template).is_file():
        return Path(chat_template).read_text()
    return chat_template


def tokenizer_path(tokenizer: str | None, model_dir: str | Path) -> Path:
    """Where the tokenizer comes from: `tokenizer` (EngineConfig.tokenizer, vLLM's `tokenizer=`: a
    local directory or .gguf file) when given, else the model's own directory."""
    if tokenizer is None:
        return Path(model_dir)
    path = Path(tokenizer).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"tokenizer {tokenizer!r} is not a local directory or .gguf file; download it first "
            "(e.g. `huggingface-cli download ID --include 'tokenizer*'`) and pass that directory"
        )
    return path


def load_tokenizer(model_dir: str | Path, chat_template: str | None = None) -> Tokenizer:
    """The tokenizer of a local model directory (or .gguf file), without remote code."""
    from tinypaged.tokenizer.chatglm import ChatGLMTokenizer, is_chatglm_tokenizer

    path = Path(model_dir)
    chat_template = _read_chat_template(chat_template)
    if path.is_dir() and is_chatglm_tokenizer(path):
        return ChatGLMTokenizer.from_dir(path, chat_template)

    from transformers import AutoTokenizer

    is_gguf = path.suffix == ".gguf"
    try:
        if is_gguf:  # the tokenizer and chat template are embedded in the file
            hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        else:
            hf = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"cannot load a tokenizer from {str(path)!r} without remote code: {e}. "
            "Point the model (or tokenizer) argument at a directory with tokenizer.json or "
            "tokenizer_config.json files."
        ) from e
    eos = set() if is_gguf else read_eos_token_ids(path)
    if hf.eos_token_id is not None:
        eos.add(hf.eos_token_id)
    return HFTokenizer(hf, eos, chat_template)
