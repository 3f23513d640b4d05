"""OpenAI response bodies: whole responses, stream chunks and the two logprobs formats.

`ResponseBuilder` turns the cumulative `RequestOutput`s of one HTTP request into what the client
reads. Completions and chat differ in a few names:

    completion  {"object": "text_completion", "choices": [{"index", "text", "logprobs",
                 "finish_reason", "stop_reason"}], "usage": {...}}
    chat        {"object": "chat.completion", "choices": [{"index", "message": {"role",
                 "content"}, "logprobs", "finish_reason"}], "usage": {...}}

A stream sends one chunk per choice and step with only what is new for that choice (chat:
object "chat.completion.chunk", a `delta` in place of `message`, opened by a chunk carrying the
role), then, when asked, a last chunk with the usage and no choices. Logprobs come in two shapes:
completions' parallel lists (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) and
chat's list of per-token entries with their UTF-8 bytes. This file only builds dicts; SSE framing
and HTTP live in `request_handler.py` and `api_server.py`.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from typing import Any

from tinypaged.entrypoints.openai.chat_output import ChatOutput
from tinypaged.entrypoints.openai.protocol import GenerationRequest


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage; with `cached_tokens`, also the prompt tokens the prefix cache served."""
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def finite(logprob: float) -> float:
    """JSON has no -inf: impossible tokens get OpenAI's floor of -9999.0."""
    return max(float(logprob), -9999.0)


def completion_logprobs(
    token_strs: list[str],
    logprobs: list[dict[int, float]],
    token_ids: list[int],
    decode_one,
    text_offset: int,
) -> dict:
    """Completions format: parallel lists of tokens, their logprobs, top alternatives, offsets."""
    offsets, pos = [], text_offset
    for s in token_strs:
        offsets.append(pos)
        pos += len(s)
    return {
        "tokens": token_strs,
        "token_logprobs": [finite(lp.get(t, -math.inf)) for t, lp in zip(token_ids, logprobs)],
        # vLLM's order: the token itself first, then the top ones
        "top_logprobs": [{decode_one(k): finite(v) for k, v in lp.items()} for lp in logprobs],
        "text_offset": offsets,
    }


def echoed_logprobs(
    prompt_ids: list[int], entries: list[dict[int, float] | None], decode_one
) -> dict:
    """Completions' logprobs of an echoed prompt: the first token has none (null)."""
    strs = [decode_one(t) for t in prompt_ids]
    offsets, pos = [], 0
    for s in strs:
        offsets.append(pos)
        pos += len(s)
    return {
        "tokens": strs,
        "token_logprobs": [
            None if e is None else finite(e.get(t, -math.inf)) for t, e in zip(prompt_ids, entries)
        ],
        "top_logprobs": [
            None if e is None
            else {decode_one(k): finite(v) for k, v in e.items()}  # the prompt token first
            for e in entries
        ],
        "text_offset": offsets,
    }


def prompt_logprobs_body(
    entries: list[dict[int, float] | None], decode_one, prompt_ids: list[int],
    ranks: list[int | None] | None = None,
) -> list:
    """vLLM's `prompt_logprobs`: per prompt token null or {token id: {logprob, rank,
    decoded_token}}. The prompt token's rank is the engine's (`ranks`); the top-k ones rank by
    their order (1 = most likely), as vLLM's."""

    def rank(e: dict[int, float], k: int, i: int) -> int:
        if ranks is not None and i < len(prompt_ids) and k == prompt_ids[i] and ranks[i]:
            return ranks[i]
        return 1 + sum(v > e[k] for v in e.values())

    return [
        None if e is None
        else {str(k): {"logprob": finite(v), "rank": rank(e, k, i), "decoded_token": decode_one(k)}
              for k, v in e.items()}
        for i, e in enumerate(entries)
    ]


def chat_logprobs(
    token_ids: list[int], logprobs: list[dict[int, float]], decode_one, top: int
) -> dict:
    """Chat format: one entry per token with its bytes and its `top` best alternatives."""

    def entry(tid: int, lp: float) -> dict:
        s = decode_one(tid)
        return {"token": s, "logprob": finite(lp), "bytes": list(s.encode("utf-8"))}

    content = []
    for tid, lp in zip(token_ids, logprobs):
        best = sorted(lp.items(), key=lambda kv: -kv[1])[:top]
        top_entries = [entry(k, v) for k, v in best]
        content.append({**entry(tid, lp.get(tid, -math.inf)), "top_logprobs": top_entries})
    return {"content": content}


class ResponseBuilder:
    """Turns a request's cumulative RequestOutputs into OpenAI bodies and stream chunks.

    Choice `i * n + j` is sample j of prompt i. For streaming it remembers, per choice, how much
    text and how many tokens it already sent, so each chunk carries only the new part.
    """

    def __init__(
        self,
        kind: str,
        request_id: str,
        model: str,
        req: GenerationRequest,
        prompts: list[list[int]],
        tokenizer: Any,
        chat_output: Callable[[], ChatOutput] | None = None,
        echo: str = "",
        prompt_tokens_details: bool = False,
        echo_prompts: list[str] | None = None,
    ):
        self.kind = kind  # "completion" | "chat"
        self.request_id = request_id
        self.model = model
        self.n = req.n
        self.num_prompts = len(prompts)
        self.top_logprobs = req.logprobs
        self.include_usage = req.include_usage
        self.continuous_usage = req.include_usage and req.continuous_usage_stats
        self.return_token_ids = req.return_token_ids
        self.tokens_as_ids = req.return_tokens_as_token_ids
        self.prompts = prompts
        self.prompt_tokens = sum(len(p) for p in prompts)
        # prompt index -> prompt tokens served from the prefix cache (with prompt_tokens_details)
        self.cached_tokens: dict[int, int] | None = {} if prompt_tokens_details else None
        self.tokenizer = tokenizer
        self.created = now()
        self.sent_text: dict[int, int] = {}  # choice index -> characters sent
        self.sent_tokens: dict[int, int] = {}  # choice index -> tokens sent
        self.done: set[int] = set()
        # chat: each choice's text -> message / deltas (reasoning, content, tool calls)
        self.new_chat_output = chat_output or ChatOutput
        self.chat_outputs: dict[int, ChatOutput] = {}
        self.echo = echo  # chat `echo`: the final assistant message, repeated before the answer
        self.echo_prompts = echo_prompts  # completions `echo`: each prompt's text
        self.prompt_logprobs: dict[int, list] = {}  # prompt index -> RequestOutput.prompt_logprobs

    def chat_output(self, index: int) -> ChatOutput:
        if index not in self.chat_outputs:
            self.chat_outputs[index] = self.new_chat_output()
        return self.chat_outputs[index]

    def decode_one(self, token_id: int) -> str:
        if self.tokens_as_ids:  # vLLM's return_tokens_as_token_ids: no undecodable bytes
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _usage(self, completion_tokens: int) -> dict:
        cached = None if self.cached_tokens is None else sum(self.cached_tokens.values())
        return usage(self.prompt_tokens, completion_tokens, cached)

    def _head(self, obj: str) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, c: Any, first_token: int, text_offset: int, prompt: int) -> dict | None:
        if self.top_logprobs is None or c.logprobs is None:
            return None
        ids, lps = c.token_ids[first_token:], c.logprobs[first_token:]
        if self.kind == "chat":
            return chat_logprobs(ids, lps, self.decode_one, self.top_logprobs)
        strs = [self.decode_one(t) for t in ids]
        if self.echo_prompts is None:
            return completion_logprobs(strs, lps, ids, self.decode_one, text_offset)
        echo_len = len(self.echo_prompts[prompt])
        body = completion_logprobs(strs, lps, ids, self.decode_one, echo_len + text_offset)
        entries = self.prompt_logprobs.get(prompt)
        if first_token == 0 and entries is not None:  # the echoed prompt leads the lists
            head = echoed_logprobs(self.prompts[prompt], entries, self.decode_one)
            body = {key: head[key] + body[key] for key in body}
        return body

    def _prompt_fields(self, choice_or_body: dict, prompt: int, out: Any, null=False) -> None:
        """vLLM's `prompt_logprobs` (when asked) beside a choice (completions) or the body; in
        a whole response (`null`) it is there as null when not asked, as vLLM's."""
        if null:
            choice_or_body["prompt_logprobs"] = None
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[prompt] = out.prompt_logprobs
            choice_or_body["prompt_logprobs"] = prompt_logprobs_body(
                out.prompt_logprobs, self.decode_one, self.prompts[prompt],
                getattr(out, "prompt_logprob_ranks", None),
            )

    # ------------------------------------------------------------------------------ streaming

    def _chunk(self, choices: list[dict]) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        chunk = {**self._head(obj), "choices": choices}
        if self.continuous_usage:
            chunk["usage"] = self._usage(sum(self.sent_tokens.values()))
        elif self.include_usage:
            chunk["usage"] = None
        return chunk

    def start_chunks(self) -> list[dict]:
        """Chat streams open with one chunk per choice carrying the assistant role."""
        if self.kind != "chat":
            return []
        chunks = []
        for i in range(self.num_prompts * self.n):
            delta = {"role": "assistant", "content": self.echo}
            chunk = self._chunk(
                [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}]
            )
            if self.return_token_ids:
                chunk["prompt_token_ids"] = self.prompts[0]
            chunks.append(chunk)
        return chunks

    def delta_chunks(self, prompt_index: int, out: Any) -> list[dict]:
        """One chunk per choice that has new text, new logprobs or has just finished."""
        chunks = []
        if self.cached_tokens is not None:
            self.cached_tokens[prompt_index] = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_index] = out.prompt_logprobs
        for c in out.outputs:
            index = prompt_index * self.n + c.index
            if index in self.done:
                continue
            t0, k0 = self.sent_text.get(index, 0), self.sent_tokens.get(index, 0)
            text, new_tokens = c.text[t0:], len(c.token_ids) - k0
            finish_reason, news = c.finish_reason, bool(text)
            if self.kind == "chat":
                output = self.chat_output(index)
                delta = output.delta(c.text, c.finish_reason is not None)
                finish_reason, news = output.finish_reason(c.finish_reason), bool(delta)
            wants_logprobs = self.top_logprobs is not None and new_tokens > 0
            if not news and not c.finish_reason and not wants_logprobs:
                continue
            logprobs = self._logprobs(c, k0, t0, prompt_index)
            self.sent_text[index], self.sent_tokens[index] = len(c.text), len(c.token_ids)
            if c.finish_reason:
                self.done.add(index)
            choice: dict = {"index": index}
            if self.kind == "chat":
                choice["delta"] = delta
            else:
                echo = self.echo_prompts[prompt_index] if self.echo_prompts and k0 == 0 else ""
                choice["text"] = echo + text
            choice.update(logprobs=logprobs, finish_reason=finish_reason)
            choice["stop_reason"] = c.stop_reason  # vLLM: chat choices carry it too
            if self.return_token_ids:
                if self.kind == "completion" and k0 == 0:
                    choice["prompt_token_ids"] = self.prompts[prompt_index]
                choice["token_ids"] = c.token_ids[k0:]
            if self.kind == "completion" and k0 == 0:
                self._prompt_fields(choice, prompt_index, out)
            chunks.append(self._chunk([choice]))
        return chunks

    def usage_chunk(self) -> dict:
        completion_tokens = sum(self.sent_tokens.values())
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {
            **self._head(obj),
            "choices": [],
            "usage": self._usage(completion_tokens),
        }

    # ------------------------------------------------------------------------------ whole response

    def response(self, outs: list[Any]) -> dict:
        """The non-streaming body from each prompt's final RequestOutput."""
        choices, completion_tokens = [], 0
        for i, out in enumerate(outs):
            for c in sorted(out.outputs, key=lambda c: c.index):
                completion_tokens += len(c.token_ids)
                choice: dict = {"index": i * self.n + c.index}
                finish_reason = c.finish_reason
                if self.kind == "chat":
                    output = self.chat_output(choice["index"])
                    choice["message"] = message = output.message(c.text)
                    if self.echo:
                        message["content"] = self.echo + (message["content"] or "")
                    finish_reason = output.finish_reason(c.finish_reason)
                else:
                    echo = self.echo_prompts[i] if self.echo_prompts else ""
                    choice["text"] = echo + c.text
                    self._prompt_fields(choice, i, out, null=True)
                choice.update(logprobs=self._logprobs(c, 0, 0, i), finish_reason=finish_reason)
                choice["stop_reason"] = c.stop_reason  # vLLM: chat choices carry it too
                if self.return_token_ids:
                    if self.kind == "completion":
                        choice["prompt_token_ids"] = self.prompts[i]
                    choice["token_ids"] = list(c.token_ids)
                choices.append(choice)
            if self.cached_tokens is not None:
                self.cached_tokens[i] = out.num_cached_tokens
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        body = {**self._head(obj), "choices": choices, "usage": self._usage(completion_tokens)}
        body["system_fingerprint"] = None  # vLLM's (and OpenAI's) full shape
        if self.kind == "chat":
            body["service_tier"] = None
        if self.return_token_ids and self.kind == "chat":
            body["prompt_token_ids"] = self.prompts[0]
        if self.kind == "chat":
            self._prompt_fields(body, 0, outs[0], null=True)
        return body
