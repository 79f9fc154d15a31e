"""Grammars for the structured-output tests, each with a check of an output against it: JSON schemas
(nested objects, arrays with bounds, enums, patterns, integer ranges), a regex and an EBNF grammar."""
from __future__ import annotations

import json
import re

import jsonschema

from bench.soak_grammar import EBNF, EBNF_AS_REGEX, REGEX    # the soak's regex and EBNF, checked the same way
from engine.messages import GrammarSpec

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                                  "age": {"type": "integer", "minimum": 18, "maximum": 99}},
                 "required": ["name", "age"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
    "bounded-enum-array": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 4}},
        "required": ["colors"]},
    "pattern-and-range": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "count": {"type": "integer", "minimum": -5, "maximum": 5}}, "required": ["code", "count"]},
    "array-of-objects": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "ok": {"type": "boolean"}}, "required": ["id", "ok"]}},
}

GRAMMARS: dict[str, GrammarSpec] = {
    **{name: GrammarSpec("json_schema", json.dumps(schema)) for name, schema in SCHEMAS.items()},
    "json-object": GrammarSpec("json_object", strict=False),
    "regex": GrammarSpec("regex", REGEX),
    "ebnf": GrammarSpec("ebnf", EBNF),
}


def problem(name: str, text: str) -> str | None:
    """Why `text` does not match grammar `name` (None: it does)."""
    if name == "regex":
        return None if re.fullmatch(REGEX, text) else f"{text!r} does not match {REGEX}"
    if name == "ebnf":
        return None if re.fullmatch(EBNF_AS_REGEX, text) else f"{text!r} is not a sum/product in parentheses"
    try:
        value = json.loads(text)
    except ValueError as exc:
        return f"{text!r} is not JSON: {exc}"
    if name == "json-object":
        return None if isinstance(value, dict) else f"{text!r} is not an object"
    try:
        jsonschema.validate(value, SCHEMAS[name])
    except jsonschema.ValidationError as exc:
        return f"{text!r} does not validate: {exc.message}"
    return None
