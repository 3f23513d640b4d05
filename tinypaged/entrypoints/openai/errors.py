"""OpenAI-style errors: `APIError` ends one HTTP request with OpenAI's error body.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens",
               "code": "invalid_value"}}

`param` names the offending field (dotted / indexed for nested ones, e.g. `messages[1].content`),
so a client can point at it. Every request parser and handler raises these; this module imports
nothing of tinypaged, so each of them can.
"""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error that ends one HTTP request with an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def show(value: Any, limit: int = 100) -> str:
    """repr(value) cut to `limit` characters: an error message never echoes a huge field."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def field_error(message: str, body_fields: dict[str, str], fallback: str) -> APIError:
    """A ValueError of SamplingParams or of the engine as a 400 naming the body field it is about.

    Their messages start with the SamplingParams field ("top_p must be > 0 and <= 1, got 0",
    "structured_outputs.json is not valid JSON: ..."); `body_fields` maps it to the body field
    that set it (chat's top_logprobs sets logprobs), which the message then names as the client
    wrote it. A message about no field of the body blames `fallback`."""
    head = message.split(maxsplit=1)[0] if message else ""
    name = head.split(".")[0].rstrip(":")
    param = body_fields.get(name)
    if param is None:
        return bad_request(fallback, message)
    if head == name:  # "top_p must be ..." -> "'top_p' must be ...", as the parsers write it
        message = f"'{param}'{message[len(name):]}"
    return bad_request(param, message)
