"""A Hugging Face tokenizer (`transformers.AutoTokenizer`, never remote code) behind the
engine's `Tokenizer` interface: a model directory's tokenizer files, or the tokenizer and chat
template a .gguf file embeds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tinypaged.sampling.generation_config import read_eos_token_ids
from tinypaged.tokenizer.base import Messages, Tokenizer


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

    @classmethod
    def from_path(cls, path: Path, chat_template: str | None = None) -> HFTokenizer:
        """The tokenizer of a model directory or .gguf file; its eos ids joined with the
        generation config's (see base.py)."""
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
        return cls(hf, eos, chat_template)

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
