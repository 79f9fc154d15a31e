"""Structured outputs in bench/soak.py: the grammars a share of the good requests carry (each with a check
of an answer against it), how each endpoint asks for one, and a grammar no compiler accepts (a bad
request that must get its 400).

Grammars are short enough for the soak's models to finish within GRAMMAR_MAX_TOKENS; an answer that
ends with finish_reason "stop" must match its grammar whole (one cut by its length limit cannot be
judged, and constrained requests carry no stop strings).
"""
from __future__ import annotations

import json
import random
import re
from typing import Callable

GRAMMAR_MAX_TOKENS = 40
RECORD = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "level": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "tag": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "level", "tag"]}
REGEX = r"(yes|no), [0-9]{1,3}!"
EBNF = 'root ::= "(" [0-9]+ (("+" | "*") [0-9]+)* ")"'
EBNF_AS_REGEX = r"\([0-9]+([+*][0-9]+)*\)"
UNCOMPILABLE_REGEX = "[unclosed"


def record_problem(text: str) -> str | None:
    try:
        value = json.loads(text)
    except ValueError:
        return "not JSON"
    if not isinstance(value, dict) or set(value) != {"ok", "level", "tag"}:
        return "not an object with exactly ok, level and tag"
    if not (isinstance(value["ok"], bool) and type(value["level"]) is int and 0 <= value["level"] <= 9
            and value["tag"] in ("red", "green", "blue")):
        return "a value of the wrong type or range"
    return None


def matches(pattern: str) -> Callable[[str], str | None]:
    return lambda text: None if re.fullmatch(pattern, text) else f"does not match {pattern}"


CHECKS: dict[str, Callable[[str], str | None]] = {
    "json_schema": record_problem, "regex": matches(REGEX), "ebnf": matches(EBNF_AS_REGEX),
}


def grammar_fields(endpoint: str, name: str, source: str | None = None) -> dict:
    """The request fields that ask for grammar `name` on `endpoint` (to merge where sampling fields go)."""
    if name == "json_schema":
        if endpoint == "generate":
            return {"json_schema": json.dumps(RECORD)}
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD}}}
    return {name: source or (REGEX if name == "regex" else EBNF)}


def pick_grammar(rng: random.Random) -> str:
    return rng.choice(list(CHECKS))


def grammar_problem(name: str, text: str) -> str | None:
    """Why `text` does not match grammar `name` (None: it does)."""
    problem = CHECKS[name](text)
    return None if problem is None else f"{text[:80]!r} {problem}"


def uncompilable(endpoint: str, body: dict, context_length: int) -> dict:
    """A bad request: a regex the grammar compiler refuses (the rank answers 400)."""
    fields = grammar_fields(endpoint, "regex", UNCOMPILABLE_REGEX)
    (body["sampling_params"] if endpoint == "generate" else body).update(fields)
    return body
