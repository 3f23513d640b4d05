"""The structured-output and logits fields of /v1/completions and /v1/chat/completions bodies,
turned into SamplingParams keyword arguments (vLLM's names).

    response_format      {"type": "text"} (no constraint), {"type": "json_object"}, or
                         {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    structured_outputs   vLLM: {"json" | "regex" | "choice" | "grammar" | "json_object": ...,
                         "disable_any_whitespace": bool}
    guided_json, guided_regex, guided_choice, guided_grammar
                         vLLM's older spellings of the same
    logit_bias           {"<token id>": bias}, bias clamped to [-100, 100] (OpenAI)
    allowed_token_ids    [token id, ...];  bad_words  ["word", ...]   (vLLM)

At most one structured-output field may be set. A malformed field is a 400 naming it here; a
schema, regex or grammar that does not compile is a 400 when the engine takes the request,
naming the field the client sent (`parse_logits_fields` says which: errors.field_error).
"""

from __future__ import annotations

from typing import Any

from tinypaged.entrypoints.openai.errors import bad_request, show
from tinypaged.sampling.structured_output import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def _response_format(value: Any) -> dict | None:
    """StructuredOutputsParams kwargs of `response_format`, or None for text."""
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request(
            "response_format",
            "'response_format' must be an object with a 'type': 'text', 'json_object' or "
            f"'json_schema', got {value!r:.100}",
            code="invalid_type",
        )
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise bad_request(
            "response_format.type",
            "'response_format.type' must be 'text', 'json_object' or 'json_schema', "
            f"got {show(kind)}",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request(
            "response_format.json_schema",
            "'response_format.json_schema' must be an object with 'name' and 'schema'",
            code="invalid_type",
        )
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise bad_request("response_format.json_schema.strict", "'strict' must be a boolean",
                          code="invalid_type")
    schema = spec.get("schema")
    if schema is None:  # no schema: any JSON object
        return {"json_object": True}
    if not isinstance(schema, dict):
        raise bad_request(
            "response_format.json_schema.schema",
            f"'response_format.json_schema.schema' must be a JSON schema object, got "
            f"{schema!r:.100}",
            code="invalid_type",
        )
    # Strict or not, the schema is enforced: the output always validates.
    return {"json": schema}


def _structured(body: dict) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the request's structured-output params, the field that gave them) or (None, None)."""
    given: list[tuple[str, dict]] = []
    if body.get("response_format") is not None:
        kwargs = _response_format(body["response_format"])
        if kwargs is not None:
            given.append(("response_format", kwargs))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("structured_outputs", "'structured_outputs' must be an object",
                              code="invalid_type")
        given.append(("structured_outputs", so))
    for name, key in _GUIDED.items():
        if body.get(name) is not None:
            given.append((name, {key: body[name]}))
    if not given:
        return None, None
    if len(given) > 1:
        names = ", ".join(f"'{n}'" for n, _ in given)
        raise bad_request(given[1][0], f"give one structured-output field at most, got {names}")
    name, kwargs = given[0]
    try:
        return StructuredOutputsParams(**kwargs), name
    except TypeError:
        known = "json, regex, choice, grammar, json_object, disable_any_whitespace"
        raise bad_request(name, f"'{name}' takes the keys {known}; got {sorted(kwargs)}",
                          code="invalid_type") from None
    except ValueError as exc:
        raise bad_request(name, f"'{name}': {exc}") from None


def _logit_bias(value: Any) -> dict[int, float]:
    wrong = bad_request(
        "logit_bias",
        "'logit_bias' must map token ids (as strings, e.g. \"50256\") to numbers, got "
        f"{value!r:.100}",
        code="invalid_type",
    )
    if not isinstance(value, dict):
        raise wrong
    out = {}
    for token, bias in value.items():
        try:
            token_id = int(token)
        except ValueError:
            raise wrong from None
        if token_id < 0 or isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise wrong
        out[token_id] = bias
    return out


def parse_logits_fields(body: dict) -> tuple[dict[str, Any], dict[str, str]]:
    """(SamplingParams kwargs, {SamplingParams field: the body field it came from})."""
    kwargs: dict[str, Any] = {}
    params, name = _structured(body)
    if params is not None:
        kwargs["structured_outputs"] = params
    if body.get("logit_bias"):
        kwargs["logit_bias"] = _logit_bias(body["logit_bias"])
    for field in ("allowed_token_ids", "bad_words"):
        value = body.get(field)
        if value is not None:
            kind = int if field == "allowed_token_ids" else str
            if not isinstance(value, list) or not all(
                isinstance(v, kind) and not isinstance(v, bool) for v in value
            ):
                what = "token ids" if kind is int else "strings"
                raise bad_request(field, f"'{field}' must be a list of {what}, got {value!r:.100}",
                                  code="invalid_type")
            kwargs[field] = value
    fields = {k: k for k in kwargs}
    if name is not None:
        fields["structured_outputs"] = name
    return kwargs, fields

