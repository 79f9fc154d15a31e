"""Structured outputs on the API: OpenAI's `response_format` (json_object; json_schema with `strict`)
and SGLang's `regex`, `ebnf` and (in /generate's sampling_params) `json_schema`, read into the one
GrammarSpec a request may carry.

The front checks their shape only: it never imports xgrammar (which brings torch into a process that
runs no model). The rank compiles them (engine/grammar.py) and answers a grammar xgrammar refuses
with a 400 that names the problem, before any output: the first event of a stream is awaited before
its headers go out.
"""
from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

from engine.messages import GrammarSpec
from server.errors import bad_request

GRAMMAR_FIELDS = ("response_format", "json_schema", "regex", "ebnf")


class JsonSchemaFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str | None = None
    description: str | None = None
    schema: Any = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def grammar_spec(req: Any, prefix: str = "") -> GrammarSpec | None:
    """The request's constraint (None: free text); a 400 for a malformed one, or for two at once."""
    given = [name for name in GRAMMAR_FIELDS if constrains(getattr(req, name, None))]
    if len(given) > 1:
        raise bad_request(f"Send one of {', '.join('`' + prefix + n + '`' for n in given)}, not several: a request "
                          "follows one grammar.", param=prefix + given[1], code="invalid_value")
    if not given:
        return None
    name = given[0]
    value, param = getattr(req, name), prefix + name
    if name == "response_format":
        return from_response_format(value, param)
    if name == "json_schema":
        return GrammarSpec("json_schema", schema_text(value, param))
    if not isinstance(value, str) or not value.strip():
        raise bad_request(f"`{param}` must be a non-empty string.", param=param, code="invalid_value")
    return GrammarSpec(name, value)


def constrains(value: Any) -> bool:
    """A field that asks for a grammar (`response_format: {"type": "text"}` asks for none)."""
    if isinstance(value, ResponseFormat):
        return value.type != "text"
    return value is not None


def from_response_format(value: ResponseFormat, param: str) -> GrammarSpec:
    if value.type == "json_object":
        return GrammarSpec("json_object", strict=False)
    form = value.json_schema
    if form is None or form.schema is None:
        raise bad_request(f"`{param}.json_schema.schema` is required with type json_schema.",
                          param=f"{param}.json_schema.schema", code="invalid_value")
    strict = form.strict is not False
    return GrammarSpec("json_schema", schema_text(form.schema, f"{param}.json_schema.schema"), strict=strict)


def schema_text(value: Any, param: str) -> str:
    """A JSON schema as JSON text: an object, or a string that holds one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise bad_request(f"`{param}` is not valid JSON.", param=param, code="invalid_value") from None
    if not isinstance(value, dict):
        raise bad_request(f"`{param}` must be a JSON schema object.", param=param, code="invalid_value")
    return json.dumps(value)
