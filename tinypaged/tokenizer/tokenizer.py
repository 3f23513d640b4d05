"""`load_tokenizer`: which tokenizer a model gets, and where it is read from.

A model directory (or .gguf file) gets its own Hugging Face tokenizer (hf.py), loaded without
remote code. ChatGLM checkpoints ship theirs only as remote code around a sentencepiece
`tokenizer.model`; for them the sentencepiece model is read directly (chatglm.py). Both give the
engine the same `Tokenizer` interface (base.py).
"""

from __future__ import annotations

from pathlib import Path

from tinypaged.tokenizer.base import Tokenizer
from tinypaged.tokenizer.chatglm import ChatGLMTokenizer, is_chatglm_tokenizer
from tinypaged.tokenizer.hf import HFTokenizer


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
            "(e.g. `hf download ID --include 'tokenizer*'`) and pass that directory"
        )
    return path


def load_tokenizer(model_dir: str | Path, chat_template: str | None = None) -> Tokenizer:
    """The tokenizer of a local model directory (or .gguf file), without remote code.
    `chat_template`: a Jinja template, or a file holding one, used instead of the model's."""
    path = Path(model_dir)
    chat_template = _read_chat_template(chat_template)
    if path.is_dir() and is_chatglm_tokenizer(path):
        return ChatGLMTokenizer.from_dir(path, chat_template)
    return HFTokenizer.from_path(path, chat_template)
