"""Incremental detokenization and stop strings, one `IncrementalDetokenizer` per sequence.

Text per token, cheaply and never half a character. Decoding one token alone is wrong twice:
a multi-byte character can span tokens (each piece alone decodes to U+FFFD), and sentencepiece
drops the leading space of the first token it decodes. So, like vLLM, keep two offsets into the
token ids:

    ids:  ... | prefix_offset ... read_offset | new tokens
    prefix_text = decode(ids[prefix_offset:read_offset])   # a few tokens already emitted
    new_text    = decode(ids[prefix_offset:])
    emit new_text[len(prefix_text):] unless it ends in U+FFFD (a character still incomplete),
    then move prefix_offset <- read_offset, read_offset <- len(ids).

Each step decodes only that small window. The window starts inside the prompt so the first
output token gets its leading space right. At the end the held tail is flushed, so the output
equals decode(output ids) (for byte-level BPE exactly; with sentencepiece, up to the leading
space, which the prompt context supplies).

A Hugging Face fast tokenizer does the same in Rust: `tokenizers.decoders.DecodeStream`, primed
with the prompt context, returns each new piece of text (None while a character is incomplete)
incrementally, instead of the two Python-level decodes per token above, which run on the
engine's step path. As vLLM, that fast path is taken whenever it exists (and the tokenizer does
not ask for clean_up_tokenization_spaces, which only a whole-text decode applies); the window is
kept beside it for the final flush, and the slow path takes over if the stream ever fails.

Stop strings: after each step the earliest stop string in the text is searched for, only in the
new characters plus len(stop) - 1 characters before them (a stop string can span tokens). The
text is cut right before it (or right after it with include_stop_str_in_output). As in vLLM,
the last max(len(stop)) - 1 characters are held back from streaming until the sequence ends,
so a streamed delta never shows part of a stop string that the final text leaves out.
"""

from __future__ import annotations

from tinypaged.sampling.params import SamplingParams
from tinypaged.tokenizer.base import Tokenizer

PROMPT_CONTEXT = 5  # prompt tokens decoded ahead of the output (vLLM uses 5 too)
WINDOW_TRIM = 64  # the fast path trims its emitted ids only past this many (not every token)


def rust_decode_stream(tokenizer: Tokenizer, context_ids: list[int], skip_special_tokens: bool):
    """A `tokenizers` DecodeStream primed with `context_ids`, or None where there is none (a
    slow or non-HF tokenizer, old `tokenizers`, clean_up_tokenization_spaces)."""
    hf = getattr(tokenizer, "hf", None)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None or getattr(hf, "clean_up_tokenization_spaces", False):
        return None
    try:
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        for token_id in context_ids:  # the context's own text is not output
            stream.step(backend, token_id)
    except Exception:  # noqa: BLE001 - no stream (or ids it rejects): the Python path serves
        return None
    return lambda token_id: stream.step(backend, token_id)


def find_stop_string(
    text: str, num_new_chars: int, stop: list[str], include_stop_str: bool
) -> tuple[str, int] | None:
    """The stop string that starts earliest and ends in the last num_new_chars of text.

    Returns (stop string, length to cut the text to) or None."""
    best: tuple[int, str] | None = None
    for s in stop:
        start = max(0, len(text) - num_new_chars - len(s) + 1)
        at = text.find(s, start)
        if at != -1 and (best is None or at < best[0]):
            best = (at, s)
    if best is None:
        return None
    at, s = best
    return s, at + len(s) if include_stop_str else at


class IncrementalDetokenizer:
    """One sequence's streaming text. Per sampled token (engine side):

    stop_str = detok.update(token, skip=token_ends_sequence, check_stop=past_min_tokens)
    text = detok.get_next_output_text(finished, delta=False)  # what the client may see
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = list(params.stop or [])
        self.include_stop_str = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        hold = max((len(s) for s in self.stop), default=1) - 1
        self.stop_buffer = 0 if self.include_stop_str else hold

        # ids[prefix_offset:read_offset] were emitted (or are prompt context); the rest is not.
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT:])
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        # token id -> new text or None (the fast path), or None: the window decodes below
        self._step = rust_decode_stream(tokenizer, self._ids, self.skip_special_tokens)
        self.output_text = ""  # cumulative text of the output (cut at a stop string)
        self.num_output_tokens = 0
        self.stop_reason: str | None = None  # the stop string that ended the text
        self._streamed = 0  # characters of output_text already handed out as deltas
        self._flushed = False
        # spaces_between_special_tokens=False (with special tokens in the text): a special token
        # right after another is written bare, without the space a decoder (WordPiece,
        # Metaspace) puts before it, as vLLM's fast detokenizer does
        self._specials: dict[int, str] | None = None
        self._last_special = False
        if not params.skip_special_tokens and not params.spaces_between_special_tokens:
            ids = list(getattr(tokenizer, "all_special_ids", []))
            self._specials = dict(zip(ids, tokenizer.convert_ids_to_tokens(ids)))

    def update(
        self, new_token_ids: int | list[int], skip: bool = False, check_stop: bool = True
    ) -> str | None:
        """Append sampled token(s); return the stop string if one now appears in the text.

        skip: the last token is an eos / stop_token_id that ends the sequence; its text is left
        out unless include_stop_str_in_output. check_stop=False keeps stop strings from firing
        (the engine passes False while fewer than min_tokens tokens are out; so does the
        detokenizer itself, as vLLM: stop strings count only past min_tokens)."""
        if isinstance(new_token_ids, int):
            new_token_ids = [new_token_ids]
        if self.stop_reason is not None:
            return self.stop_reason  # the text is final; later tokens add nothing
        self.num_output_tokens += len(new_token_ids)
        if skip and not self.include_stop_str:
            new_token_ids = new_token_ids[:-1]
        old_len = len(self.output_text)
        for token_id in new_token_ids:
            self._ids.append(token_id)
            piece = (
                self._decode_window(final=False) if self._step is None else self._stream(token_id)
            )
            if self._specials is not None:
                special = self._specials.get(token_id)
                if special is not None and self._last_special and piece:
                    piece = special
                self._last_special = special is not None
            self.output_text += piece
        return self._check_stop(old_len) if check_stop else None

    def _stream(self, token_id: int) -> str:
        """The fast path's text for one token; the window only tracks what was emitted."""
        try:
            piece = self._step(token_id)
        except Exception:  # noqa: BLE001 - e.g. an id past the tokenizer's vocabulary
            self._step = None  # from now on the window decodes, starting where the stream was
            return self._decode_window(final=False)
        if piece is None:
            return ""  # a character still waits for its next bytes
        if len(self._ids) > WINDOW_TRIM:
            del self._ids[: -PROMPT_CONTEXT]
        self._prefix_offset = max(0, len(self._ids) - PROMPT_CONTEXT)
        self._read_offset = len(self._ids)
        return piece

    def _decode_window(self, final: bool) -> str:
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], skip)
        new_text = decode(self._ids[self._prefix_offset :], skip)
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd")):
            return ""  # nothing yet, or a character still waits for its next bytes
        # Emitted: the window slides; drop ids before it so the list stays short.
        del self._ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        return new_text[len(prefix_text) :]

    def _check_stop(self, old_len: int) -> str | None:
        if not self.stop or self.num_output_tokens <= self.min_tokens:
            return None
        hit = find_stop_string(
            self.output_text, len(self.output_text) - old_len, self.stop, self.include_stop_str
        )
        if hit is None:
            return None
        self.stop_reason, cut = hit
        self.output_text = self.output_text[:cut]
        return self.stop_reason

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to hand out now: cumulative, or (delta=True) what is new since last call.

        While running, the last stop_buffer characters stay back (they may begin a stop
        string); once finished, everything is given, including a held incomplete character."""
        if finished and not self._flushed and self.stop_reason is None:
            self._flushed = True
            old_len = len(self.output_text)
            if self._read_offset < len(self._ids):
                self.output_text += self._decode_window(final=True)
            self._check_stop(old_len)
        end = len(self.output_text) - (0 if finished else self.stop_buffer)
        if not delta:
            return self.output_text[: max(end, 0)]
        if end <= self._streamed:
            return ""
        start, self._streamed = self._streamed, end
        return self.output_text[start:end]
