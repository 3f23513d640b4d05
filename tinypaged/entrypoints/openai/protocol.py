"""OpenAI request bodies: parsing and validation, free of HTTP and engine code.

Every parser takes the decoded JSON body and either returns a plain description of the request or
raises `APIError` (errors.py), a 400 whose `param` names the offending field. Chat's tool and
template fields are parsed in chat_protocol.py, the structured-output and logits fields in
structured_protocol.py; this module puts them together into one `GenerationRequest`. Sampling
fields keep their OpenAI names here and are handed to `SamplingParams` under vLLM's names (the
same, apart from chat's `top_logprobs` -> `logprobs`). The response bodies are built in
`response_bodies.py`.

Parsing checks JSON types and field names only. The valid range of every sampling value is
SamplingParams' to check, as vLLM's protocol does: each request builds its SamplingParams once
while it is parsed, so a value out of range is a 400 before any tokenizing, and its ValueError
becomes a 400 naming the body field that set the value (`GenerationRequest.to_sampling_params`).
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any

from tinypaged.entrypoints.openai.chat_protocol import (
    ChatOptions,
    message_extras,
    parse_chat_options,
)
from tinypaged.entrypoints.openai.errors import bad_request, field_error, show
from tinypaged.entrypoints.openai.structured_protocol import parse_logits_fields
from tinypaged.sampling.params import SamplingParams

_MISSING = object()
logger = logging.getLogger(__name__)


# A UTF-16 surrogate written as a JSON escape; paired ones are fine, a lone one is not text.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def parse_json_body(raw: bytes) -> Any:
    """Decode a request body: UTF-8 (RFC 8259), JSON, and text that is valid Unicode.

    Every way this can fail is a 400: bytes that are not UTF-8, malformed JSON, nesting deeper
    than the parser's recursion limit (RecursionError), integers longer than Python's
    int-string limit (ValueError), and lone surrogates (`"\\ud800"`) that the JSON parser accepts
    but no tokenizer or response encoder can handle."""
    try:
        text = raw.decode("utf-8")
        body = json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError too
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
        raise bad_request(
            "body", f"the request body is not valid JSON: {why}", code="invalid_json"
        ) from None
    if _SURROGATE_ESCAPE.search(text):
        where = _lone_surrogate(body)
        if where is not None:
            raise bad_request(
                where,
                f"'{where}' holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                "escape), which is not text; send valid Unicode",
                code="invalid_text",
            )
    return body


def _lone_surrogate(body: Any) -> str | None:
    """The top-level field holding a string that is not valid Unicode ("body" for the body
    itself or a bad key), or None. Iterative: bodies nest as deep as the parser allowed."""
    stack = [(body, "body")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return where
        elif isinstance(value, dict):
            for key, item in value.items():
                top = key if where == "body" else where
                stack += [(item, top), (key, where)]  # the key is looked at first
        elif isinstance(value, list):
            stack += [(item, where) for item in value]
    return None


# ---------------------------------------------------------------------------------- field checks

# The HTTP API's own ceilings (OpenAI's): a bound on what one request may cost the server, not a
# sampling rule (offline, LLM takes any n). Every other bound of a sampling value is
# SamplingParams'.
MAX_N = 128
MAX_LOGPROBS = 20  # logprobs, top_logprobs, prompt_logprobs (vLLM's default max_logprobs)

_TYPE_NAMES = {
    "int": "a 64-bit integer",
    "number": "a finite number",
    "bool": "a boolean",
    "str": "a string",
}


def _is(value: Any, kind: str) -> bool:
    if kind == "bool":
        return isinstance(value, bool)
    if isinstance(value, bool):  # JSON true is not the number 1
        return False
    if kind == "int":  # every integer field ends up in an int64 tensor or a C long
        return isinstance(value, int) and -(2**63) <= value < 2**63
    if kind == "number":
        if isinstance(value, int):  # beyond this, no float field has a meaning
            return -(2**63) <= value < 2**63
        return isinstance(value, float) and math.isfinite(value)
    return isinstance(value, str)


def field_value(
    body: dict, name: str, kind: str, *, at_most: int | None = None, required: bool = False
) -> Any:
    """The value of `body[name]` checked for its JSON type; None when absent (or null).
    `at_most`: one of the API's own ceilings above."""
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        if required:
            raise bad_request(name, f"'{name}' is a required field", code="missing_field")
        return None
    if not _is(value, kind):
        raise bad_request(
            name, f"'{name}' must be {_TYPE_NAMES[kind]}, got {show(value)}", code="invalid_type"
        )
    if at_most is not None and value > at_most:
        raise bad_request(
            name, f"'{name}' must be <= {at_most} (this API's limit), got {show(value)}"
        )
    return value


def _stop_list(body: dict) -> str | list[str] | None:
    stop = body.get("stop")
    if stop is None or isinstance(stop, str):
        return stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad_request(
            "stop",
            f"'stop' must be a string or a list of strings, got {show(stop)}",
            code="invalid_type",
        )
    return stop


def _int_list(body: dict, name: str) -> list[int] | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or not all(_is(v, "int") and v >= 0 for v in value):
        raise bad_request(
            name,
            f"'{name}' must be a list of token ids (integers >= 0), got {show(value)}",
            code="invalid_type",
        )
    return value


# --------------------------------------------------------------------------- generation requests


@dataclass
class GenerationRequest:
    """What the server needs of a /v1/completions or /v1/chat/completions body."""

    model: str | None
    prompts: list[str | list[int]] = field(default_factory=list)  # completions
    messages: list[dict] | None = None  # chat: [{"role", "content": str}]
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams kwargs (vLLM names)
    max_tokens: int | None = None  # None = default_max_tokens, else the rest of the context
    default_max_tokens: int | None = None  # completions: 16, as OpenAI and vLLM
    max_tokens_param: str = "max_tokens"  # the field name to blame when it does not fit
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # completions: top-k count; chat: top_logprobs (0 = sampled only)
    n: int = 1
    chat: ChatOptions | None = None  # chat: tools, tool_choice, template switches
    continuous_usage_stats: bool = False  # usage in every stream chunk
    return_token_ids: bool = False  # token ids beside the text (vLLM)
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:<id>" (vLLM)
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (-1: all
    # that fit the context)
    truncation_side: str = "left"  # vLLM: "left" keeps the last k tokens, "right" the first k
    echo: bool = False  # completions: the prompt's text leads the answer
    # SamplingParams field -> the body field that set it, for errors: chat's top_logprobs sets
    # logprobs, response_format or guided_json sets structured_outputs, and so on
    body_fields: dict[str, str] = field(default_factory=dict)

    def to_sampling_params(
        self, max_tokens: int | None, defaults: dict[str, Any] | None = None
    ) -> SamplingParams:
        """This request's SamplingParams; `defaults` (the model's generation_config) fill the
        fields the body left out. SamplingParams checks every value; its ValueError is a 400
        naming the body field that set the value."""
        kwargs = {**(defaults or {}), **self.sampling, "max_tokens": max_tokens}
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as exc:
            raise field_error(str(exc), self.body_fields, fallback="body") from None


def _common(body: dict, req: GenerationRequest) -> None:
    """Fields shared by completions and chat: sampling knobs, vLLM extras, streaming."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(
            "model", f"'model' must be a string, got {show(model)}", code="invalid_type"
        )
    req.model = model
    s = req.sampling
    n = field_value(body, "n", "int", at_most=MAX_N)
    s["n"] = req.n = 1 if n is None else n
    kinds = {  # their JSON types; SamplingParams checks their ranges
        "temperature": "number",
        "top_p": "number",
        "top_k": "int",
        "min_p": "number",
        "presence_penalty": "number",
        "frequency_penalty": "number",
        "repetition_penalty": "number",
        "seed": "int",
        "min_tokens": "int",
    }
    for name, kind in kinds.items():
        value = field_value(body, name, kind)
        if value is not None:
            s[name] = value
    for name in (
        "ignore_eos",
        "skip_special_tokens",
        "include_stop_str_in_output",
        "spaces_between_special_tokens",
    ):
        value = field_value(body, name, "bool")
        if value is not None:
            s[name] = value
    req.return_token_ids = bool(field_value(body, "return_token_ids", "bool"))
    req.return_tokens_as_token_ids = bool(field_value(body, "return_tokens_as_token_ids", "bool"))
    # Not a SamplingParams field here: the server truncates (api_server.py), -1 meaning the
    # model's context length, which only the server knows.
    req.truncate_prompt_tokens = field_value(body, "truncate_prompt_tokens", "int")
    side = field_value(body, "truncation_side", "str")
    if side not in (None, "left", "right"):
        raise bad_request("truncation_side", f"'truncation_side' must be 'left' or 'right', got "
                          f"{show(side)}")
    req.truncation_side = side or "left"
    prompt_logprobs = field_value(body, "prompt_logprobs", "int", at_most=MAX_LOGPROBS)
    if prompt_logprobs is not None:
        s["prompt_logprobs"] = prompt_logprobs
    if (stop := _stop_list(body)) is not None:
        s["stop"] = stop
    if (ids := _int_list(body, "stop_token_ids")) is not None:
        s["stop_token_ids"] = ids
    field_value(body, "user", "str")  # accepted and ignored, but it must be a string

    req.stream = bool(field_value(body, "stream", "bool"))
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request(
                "stream_options", "'stream_options' must be an object", code="invalid_type"
            )
        if not req.stream:
            raise bad_request(
                "stream_options", "'stream_options' is only allowed when 'stream' is true"
            )
        for name in ("include_usage", "continuous_usage_stats"):
            flag = options.get(name, False)
            if not isinstance(flag, bool):
                raise bad_request(
                    f"stream_options.{name}", f"'{name}' must be a boolean", code="invalid_type"
                )
            setattr(req, name, flag)
    kwargs, fields = parse_logits_fields(body)
    s.update(kwargs)
    req.body_fields.update(fields)
    for name in UNSUPPORTED:
        if body.get(name):
            hint = UNSUPPORTED.get(name, "")
            raise bad_request(
                name, f"'{name}' is not supported by this server{hint}", code="unsupported"
            )


# Fields of OpenAI's or vLLM's API that tinypaged does not implement: a request that sets one
# gets a 400 naming it rather than an answer that silently ignores it.
UNSUPPORTED = {
    "functions": "; send 'tools' instead (the deprecated 'functions' API is not served)",
    "function_call": "; send 'tool_choice' instead",
    "suffix": "",
    "audio": " (text only)",
    "prediction": "",
    "web_search_options": "",
    "use_beam_search": "; sample with 'n' instead",
    "prompt_embeds": "; send text or token ids",
    "mm_processor_kwargs": " (text-only models)",
    "priority": " (the scheduler serves requests first come, first served)",
    "kv_transfer_params": "",
    "cache_salt": " (the prefix cache is shared by all requests; it takes no salt)",
    "logits_processors": " (no custom logits processors are loaded)",
}

# The fields each endpoint reads (UNSUPPORTED's included: a falsy one is harmless). Any other
# field is logged and ignored, as vLLM does: "The following fields were present in the request
# but ignored". vLLM's length_penalty (beam search only) and vllm_xargs (arguments of custom
# logits processors, of which there are none) are among those.
COMMON_FIELDS = frozenset({
    "model", "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "seed", "min_tokens", "ignore_eos",
    "skip_special_tokens", "include_stop_str_in_output", "spaces_between_special_tokens",
    "return_token_ids", "return_tokens_as_token_ids", "truncate_prompt_tokens", "truncation_side",
    "prompt_logprobs", "stop", "stop_token_ids", "user", "stream", "stream_options",
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "logit_bias", "allowed_token_ids", "bad_words", "max_tokens", "logprobs",
    "logprob_token_ids", *UNSUPPORTED,
})  # fmt: skip
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
    "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "echo",
    "parallel_tool_calls", "modalities", "add_special_tokens", "chat_template", "documents",
}  # fmt: skip


def log_ignored(body: dict, known: set[str] | frozenset[str], api: str = "") -> set[str]:
    """Warn, in vLLM's words, about the fields of `body` not in `known`; returns them."""
    ignored = set(body) - set(known)
    if ignored:
        logger.warning(
            "The following fields were present in the request but ignored: %s%s",
            ignored,
            f" ({api})" if api else "",
        )
    return ignored


def _max_tokens(body: dict, req: GenerationRequest, names: tuple[str, ...]) -> None:
    for name in names:  # the first one given wins (chat: max_completion_tokens over max_tokens)
        value = field_value(body, name, "int")
        if value is not None:
            req.max_tokens, req.max_tokens_param = value, name
            break


def _check_sampling(req: GenerationRequest) -> None:
    """Build the request's SamplingParams once, now: a value out of range is a 400 before its
    prompts are tokenized. The server builds them again per prompt, with the model's defaults
    and the max_tokens that fits the context."""
    req.body_fields = {
        **{name: name for name in req.sampling},
        "max_tokens": req.max_tokens_param,
        **req.body_fields,
    }
    req.to_sampling_params(req.max_tokens)


def parse_completion_request(body: Any) -> GenerationRequest:
    if not isinstance(body, dict):
        raise bad_request("body", "the request body must be a JSON object", code="invalid_type")
    req = GenerationRequest(model=None, default_max_tokens=16)
    log_ignored(body, COMPLETION_FIELDS)
    _common(body, req)
    _max_tokens(body, req, ("max_tokens",))
    prompt = body.get("prompt", _MISSING)
    if prompt is _MISSING or prompt is None:
        raise bad_request("prompt", "'prompt' is a required field", code="missing_field")
    req.prompts = _prompts(prompt)
    req.echo = bool(field_value(body, "echo", "bool"))
    best_of = field_value(body, "best_of", "int")
    if best_of is not None and best_of != req.n:
        raise bad_request(
            "best_of", "'best_of' other than 'n' is not supported", code="unsupported"
        )
    req.logprobs = field_value(body, "logprobs", "int", at_most=MAX_LOGPROBS)
    if req.logprobs is not None:
        req.sampling["logprobs"] = req.logprobs
        if req.echo:  # the echoed prompt gets logprobs too (vLLM)
            wanted = req.sampling.get("prompt_logprobs") or 0
            req.sampling["prompt_logprobs"] = max(wanted, req.logprobs)
    _logprob_token_ids(body, req)
    _check_sampling(req)
    return req


def _prompts(prompt: Any) -> list[str | list[int]]:
    """`prompt` as a list: a string, list of strings, token ids, or a list of token-id lists."""
    wrong = bad_request(
        "prompt",
        "'prompt' must be a string, a list of strings, a list of token ids or a list of "
        f"token-id lists, got {str(prompt)[:80]!r}",
        code="invalid_type",
    )
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is(t, "int") for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    else:
        raise wrong
    for p in prompts:
        ok = isinstance(p, str) or (isinstance(p, list) and p and all(_is(t, "int") for t in p))
        if not ok:
            raise wrong
    if any(isinstance(p, list) and min(p) < 0 for p in prompts):
        raise bad_request("prompt", "token ids in 'prompt' must be >= 0")
    return prompts


def parse_chat_request(body: Any) -> GenerationRequest:
    if not isinstance(body, dict):
        raise bad_request("body", "the request body must be a JSON object", code="invalid_type")
    req = GenerationRequest(model=None)
    log_ignored(body, CHAT_FIELDS)
    _common(body, req)
    _max_tokens(body, req, ("max_completion_tokens", "max_tokens"))
    req.messages = parse_messages(body.get("messages", _MISSING))
    req.chat = parse_chat_options(body)
    want = field_value(body, "logprobs", "bool")
    top = field_value(body, "top_logprobs", "int", at_most=MAX_LOGPROBS)
    if top is not None and not want:
        raise bad_request("top_logprobs", "'top_logprobs' needs 'logprobs' set to true")
    if want:
        req.logprobs = 0 if top is None else top
        req.sampling["logprobs"] = req.logprobs
        req.body_fields["logprobs"] = "top_logprobs"
    if req.stream and req.sampling.get("prompt_logprobs"):  # as vLLM: no chunk carries them
        raise bad_request("prompt_logprobs", "`prompt_logprobs` are not available when "
                          "`stream=True`; send the request without streaming to get them")
    _logprob_token_ids(body, req)
    _check_sampling(req)
    return req


def _logprob_token_ids(body: dict, req: GenerationRequest) -> None:
    """vLLM's `logprob_token_ids`: the logprobs of these vocabulary ids take the place of the
    top ones at each position (the sampled token's stays); it needs logprobs asked for."""
    ids = _int_list(body, "logprob_token_ids")
    if ids is None:
        return
    if not ids:
        raise bad_request("logprob_token_ids", "`logprob_token_ids` must not be an empty list")
    if req.logprobs is None:
        raise bad_request("logprob_token_ids", "`logprobs` must be set when using "
                          "`logprob_token_ids`")
    req.sampling["logprob_token_ids"] = list(dict.fromkeys(ids))


def parse_messages(messages: Any) -> list[dict]:
    """Messages reduced to {"role", "content": str} plus their tool fields (`tool_calls`,
    `tool_call_id`, `name`); list-of-parts content is joined as text."""
    if messages is _MISSING or messages is None:
        raise bad_request("messages", "'messages' is a required field", code="missing_field")
    if not isinstance(messages, list) or not messages:
        raise bad_request(
            "messages",
            "'messages' must be a non-empty list of message objects",
            code="invalid_type",
        )
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(
                where, f"'{where}' must be an object with 'role' and 'content'", code="invalid_type"
            )
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise bad_request(
                f"{where}.role",
                f"'{where}.role' must be a non-empty string, got {show(role)}",
                code="invalid_type",
            )
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise bad_request(
                        f"{where}.content",
                        f"'{where}.content[{j}]' is a {show(kind)} part, which this text-only "
                        "model cannot take; parts must be {'type': 'text', 'text': str}: only text "
                        "is supported",
                        code="unsupported",
                    )
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise bad_request(
                f"{where}.content",
                f"'{where}.content' must be a string or a list of text parts, got "
                f"{show(content)}",
                code="invalid_type",
            )
        out.append({"role": role, "content": content, **message_extras(m, where)})
    return out


# ------------------------------------------------------------------------- tokenize / detokenize


def parse_tokenize_request(body: Any) -> tuple[str | None, str | None, list[dict] | None, bool]:
    """(model, prompt, messages, return_token_strs): vLLM's /tokenize takes a prompt or messages."""
    if not isinstance(body, dict):
        raise bad_request("body", "the request body must be a JSON object", code="invalid_type")
    model = field_value(body, "model", "str")
    strs = bool(field_value(body, "return_token_strs", "bool"))
    if "messages" in body:
        return model, None, parse_messages(body["messages"]), strs
    return model, field_value(body, "prompt", "str", required=True), None, strs


def parse_detokenize_request(body: Any) -> tuple[str | None, list[int]]:
    if not isinstance(body, dict):
        raise bad_request("body", "the request body must be a JSON object", code="invalid_type")
    model = field_value(body, "model", "str")
    tokens = _int_list(body, "tokens")
    if tokens is None:
        raise bad_request("tokens", "'tokens' is a required field", code="missing_field")
    return model, tokens
