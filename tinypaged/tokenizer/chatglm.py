"""ChatGLM3's tokenizer without its remote code: sentencepiece plus nine appended special tokens.

ChatGLM checkpoints name a remote class (tokenizer_config.json `auto_map` ->
tokenization_chatglm.ChatGLMTokenizer) around a sentencepiece `tokenizer.model`. Its conventions:

- ids 0 .. n-1 are the sentencepiece pieces (n = sp.vocab_size(); <unk> 0, <s> 1, </s> 2);
- ids n, n+1, ... are, in this order: [MASK] [gMASK] [sMASK] sop eop <|system|> <|user|>
  <|assistant|> <|observation|>  (ChatGLM3-6B: n = 64789, so <|user|> = 64795);
- encode(text) = [gMASK] sop + sp.encode(text); plain text never turns into special tokens;
- a chat prompt is [gMASK] sop, then per message  <|role|> + sp.encode(metadata + "\\n") +
  sp.encode(content), then <|assistant|> to ask for a reply; as text that reads
  "[gMASK]sop<|user|>\\n Hello<|assistant|>";
- a reply ends with </s>, or with <|user|> / <|observation|> when the model hands the turn back,
  so all three are eos ids.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tinypaged.sampling.generation_config import read_eos_token_ids
from tinypaged.tokenizer.base import Messages, Tokenizer

SPECIAL_TOKENS = (
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "sop",
    "eop",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
)
ROLES = ("system", "user", "assistant", "observation")


def is_chatglm_tokenizer(model_dir: Path) -> bool:
    """Whether the directory's tokenizer is ChatGLM's remote-code class."""
    path = Path(model_dir) / "tokenizer_config.json"
    if not path.is_file():
        return False
    config = json.loads(path.read_text())
    auto = (config.get("auto_map") or {}).get("AutoTokenizer") or []
    names = [config.get("tokenizer_class")] + (auto if isinstance(auto, list) else [auto])
    return any(name and ("ChatGLM" in name or "tokenization_chatglm" in name) for name in names)


class ChatGLMTokenizer(Tokenizer):
    def __init__(
        self,
        model_file: str | Path,
        extra_eos_ids: set[int] = frozenset(),
        chat_template: str | None = None,
    ) -> None:
        import sentencepiece

        try:
            self.sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
        except (RuntimeError, OSError) as e:
            raise ValueError(
                f"{str(model_file)!r} is not a sentencepiece model ({e}). GLM-4's original "
                "checkpoints keep a tiktoken vocabulary there, which only their remote code "
                "reads; use the transformers-format checkpoint (e.g. THUDM/glm-4-9b-chat-hf)."
            ) from e
        n = self.sp.vocab_size()
        self.num_pieces = n
        self.special_ids = {token: n + i for i, token in enumerate(SPECIAL_TOKENS)}
        self.special_tokens = {i: token for token, i in self.special_ids.items()}
        self.vocab_size = n + len(SPECIAL_TOKENS)
        controls = [i for i in (self.sp.unk_id(), self.sp.bos_id(), self.sp.eos_id()) if i >= 0]
        self.all_special_ids = controls + sorted(self.special_tokens)
        self.eos_token_ids = {
            self.sp.eos_id(),
            self.special_ids["<|user|>"],
            self.special_ids["<|observation|>"],
        } | set(extra_eos_ids)
        self.chat_template = chat_template
        self._prefix = [self.special_ids["[gMASK]"], self.special_ids["sop"]]
        longest_first = sorted(SPECIAL_TOKENS, key=len, reverse=True)
        self._special_pattern = re.compile("|".join(re.escape(t) for t in longest_first))

    @classmethod
    def from_dir(cls, model_dir: Path, chat_template: str | None = None) -> ChatGLMTokenizer:
        model_file = Path(model_dir) / "tokenizer.model"
        if not model_file.is_file():
            raise ValueError(
                f"{str(model_dir)!r} names ChatGLM's remote tokenizer class but has no "
                "tokenizer.model to load it from without remote code"
            )
        return cls(model_file, read_eos_token_ids(Path(model_dir)), chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.sp.encode(text)
        return self._prefix + ids if add_special_tokens else ids

    def encode_with_special_tokens(self, text: str) -> list[int]:
        """Encode text in which the special tokens are written out (a rendered chat template)."""
        ids: list[int] = []
        start = 0
        for match in self._special_pattern.finditer(text):
            if match.start() > start:
                ids += self.sp.encode(text[start : match.start()])
            ids.append(self.special_ids[match.group()])
            start = match.end()
        if start < len(text):
            ids += self.sp.encode(text[start:])
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # Runs of pieces go through sentencepiece together (so bytes join into characters);
        # appended specials are spliced in by name. Ids past the vocabulary (the model pads
        # its embedding to 65024 rows) decode to nothing.
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if 0 <= i < self.num_pieces:
                run.append(i)
            elif i in self.special_tokens:
                if run:
                    parts.append(self.sp.decode(run))
                    run = []
                if not skip_special_tokens:
                    parts.append(self.special_tokens[i])
        if run:
            parts.append(self.sp.decode(run))
        return "".join(parts)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [
            self.special_tokens.get(i)
            or (self.sp.id_to_piece(i) if 0 <= i < self.num_pieces else "")
            for i in ids
        ]

    def render_chat(
        self,
        messages: Messages,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        template = chat_template or self.chat_template
        if template:
            return render_jinja(template, messages, add_generation_prompt, **template_kwargs)
        messages = _builtin_messages(messages, **template_kwargs)
        text = "[gMASK]sop" + "".join(
            f"<|{role}|>{metadata}\n {content}" for role, metadata, content in _turns(messages)
        )
        return text + ("<|assistant|>" if add_generation_prompt else "")

    def apply_chat_template(
        self,
        messages: Messages,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        template = chat_template or self.chat_template
        if template:
            text = render_jinja(template, messages, add_generation_prompt, **template_kwargs)
            return self.encode_with_special_tokens(text)
        messages = _builtin_messages(messages, **template_kwargs)
        ids = list(self._prefix)
        for role, metadata, content in _turns(messages):
            ids += [self.special_ids[f"<|{role}|>"]]
            ids += self.sp.encode(f"{metadata}\n") + self.sp.encode(content)
        if add_generation_prompt:
            ids.append(self.special_ids["<|assistant|>"])
        return ids


def _builtin_messages(
    messages: Messages, tools: list | None = None, continue_final_message: bool = False, **_: Any
) -> Messages:
    """The built-in ChatGLM3 format takes tools in the system message (added if missing)."""
    if continue_final_message:
        raise ValueError("continue_final_message needs a Jinja chat template for ChatGLM models")
    if not tools:
        return messages
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "tools": tools}, *messages[1:]]
    return [{"role": "system", "content": "", "tools": tools}, *messages]


def _turns(messages: Messages) -> list[tuple[str, str, str]]:
    turns = []
    for m in messages:
        if m.get("role") not in ROLES:
            raise ValueError(f"ChatGLM messages take a role in {ROLES}, got {m.get('role')!r}")
        content = m.get("content") or ""
        if m["role"] == "system" and m.get("tools"):
            content += "\n" + json.dumps(m["tools"], indent=4, ensure_ascii=False)
        turns.append((m["role"], m.get("metadata") or "", content))
    return turns


def render_jinja(
    template: str,
    messages: Messages,
    add_generation_prompt: bool,
    continue_final_message: bool = False,
    **variables: Any,
) -> str:
    """Render a chat template the way transformers does (sandboxed, trimmed blocks); with
    continue_final_message the text stops right after the final message's content."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template error: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    text = env.from_string(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **variables
    )
    if continue_final_message:
        final = (messages[-1].get("content") or "").strip()
        if not final or final not in text:
            raise ValueError("continue_final_message: the final message is not in the prompt")
        text = text[: text.rindex(final) + len(final)]
    return text
