"""vLLM's structured outputs on chat completions, completions and gRPC, as decoding guides.

A body asks for at most one constraint, in vLLM's current form or in its
earlier top-level spelling::

    structured_outputs.json         guided_json      a JSON schema (an object, or a string holding one)
    structured_outputs.regex        guided_regex     the whole answer matches the pattern (Rust regex syntax)
    structured_outputs.choice       guided_choice    the answer is exactly one of the strings
    structured_outputs.grammar      guided_grammar   a grammar in Lark or in GBNF (llama.cpp's EBNF)
    structured_outputs.json_object                   any JSON object

``structured_outputs`` may also say ``disable_additional_properties`` (an
object schema that lists ``properties`` and says nothing of
``additionalProperties`` takes no others), ``disable_any_whitespace``
(rayturn's JSON is always compact, so either value is kept) and vLLM's older
``disable_fallback`` (one compiler here, nothing to fall back to). What this server
cannot honour is a 400 naming it: ``whitespace_pattern``, ``structural_tag``
and any key it does not know; so is a constraint that does not compile
(naming where it sits: ``structured_outputs.regex``, ``guided_choice``, ...),
and a body that asks two.

gRPC's ``SamplingOptions.structured_output`` is the same object
(``structured_output_form``; errors name ``sampling.structured_output.regex``, ...).
The guide rides in ``SamplingSpec.guide`` to the engine, which holds every
token to it (``rayturn.engine.guided``). A chat call that also asks a
``response_format`` or forces a tool call is refused: one guide per call.
"""

from __future__ import annotations

import json
import re
from typing import Any

from llguidance.gbnf_to_lark import any_to_lark

from rayturn.engine.guided import Guide, check_guide

from .errors import invalid_request, unsupported
from .json_fields import Fields, json_object, type_error

STRUCTURED_OUTPUTS = "structured_outputs"
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's earlier top-level fields, each the constraint of the same name.
LEGACY_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# Options ``structured_outputs`` may carry beside its constraint: kept (booleans), or refused unless null.
KEPT_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback")
REFUSED_OPTIONS = ("whitespace_pattern", "structural_tag")
MAX_CHOICES = 1024
COMPOSITION_KEYWORDS = ("allOf", "anyOf", "oneOf", "not")
# ``check_guide``'s prefix, and the place in the guide's grammar it names: neither is in the caller's terms.
_GUIDE_ERROR_PREFIX = re.compile(r"^bad \w+ guide: (at \d+\(\d+\): )?")


def structured_output(fields: Fields) -> tuple[Guide, str] | None:
    """The guide the body's structured-output fields ask for, with the field that holds it; None when they ask
    none. A 400 naming the field for anything this server cannot honour."""
    asked: list[tuple[str, str, Any]] = []  # (param, constraint, value)
    closed = False
    form = fields.nested(STRUCTURED_OUTPUTS)
    if form is not None:
        closed = _options(form)
        asked.extend(_constraints(form))
    for legacy, constraint in LEGACY_FIELDS.items():
        value = fields.raw(legacy)
        if value is not None:
            asked.append((legacy, constraint, value))
    return _one(asked, closed=closed) if asked else None


def structured_output_form(form: Fields) -> tuple[Guide, str]:
    """The guide one ``structured_outputs``-shaped object asks for (gRPC's ``sampling.structured_output``)."""
    closed = _options(form)
    return _one(_constraints(form), closed=closed)


def _constraints(form: Fields) -> list[tuple[str, str, Any]]:
    asked = []
    for constraint in CONSTRAINTS:
        value = form.raw(constraint)
        if value is not None and value is not False:  # vLLM's ``json_object: false`` asks nothing
            asked.append((form.path(constraint), constraint, value))
    if not asked:
        message = f"Invalid '{form.where}': expected one of {', '.join(CONSTRAINTS)}."
        raise invalid_request(message, param=form.where)
    return asked


def _one(asked: list[tuple[str, str, Any]], *, closed: bool) -> tuple[Guide, str]:
    if len(asked) > 1:
        names = " and ".join(f"'{param}'" for param, _, _ in asked)
        message = f"Invalid structured output: {names} each ask for a constraint; ask for one."
        raise invalid_request(message, param=asked[1][0])
    param, constraint, value = asked[0]
    try:
        guide = _guide(param, constraint, value, closed=closed)
        check_guide(guide)
    except (ValueError, RecursionError) as err:  # a schema nested past Python's stack is bad too
        raise invalid_request(f"Invalid '{param}': {guide_error_reason(err)}", param=param) from err
    return guide, param


def _options(form: Fields) -> bool:
    """Checks the options beside the constraint; whether object schemas are closed."""
    known = (*CONSTRAINTS, *KEPT_OPTIONS, *REFUSED_OPTIONS)
    for key in form.names():
        if key not in known:
            message = f"Unsupported '{form.path(key)}': expected keys among {', '.join(known)}."
            raise unsupported(message, param=form.path(key))
    for option in REFUSED_OPTIONS:
        if form.raw(option) is not None:
            message = f"Unsupported '{form.path(option)}': this server does not support it."
            raise unsupported(message, param=form.path(option))
    for option in KEPT_OPTIONS:
        form.boolean(option)
    return form.boolean("disable_additional_properties") or False


def _guide(param: str, constraint: str, value: Any, *, closed: bool) -> Guide:
    if constraint == "json_object":
        if value is not True:
            raise type_error(param, "a boolean", value)
        return Guide.json_object()
    if constraint == "json":
        schema = json_object(param, value, "a JSON schema object")
        return Guide.json_schema(json.dumps(closed_schema(schema)) if closed else schema)
    if constraint == "choice":
        return Guide.lark("start: " + " | ".join(json.dumps(choice) for choice in _choices(param, value)))
    if not isinstance(value, str):
        raise type_error(param, "a string", value)
    if constraint == "regex":
        if not value:
            raise invalid_request(f"Invalid '{param}': expected a non-empty pattern.", param=param)
        return Guide.regex(value)
    if not value.strip():
        raise invalid_request(f"Invalid '{param}': expected a grammar, got only whitespace.", param=param)
    try:  # Lark passes through; GBNF (``root ::= ...``) is rewritten as Lark
        return Guide.lark(any_to_lark(value))
    except Exception as err:  # the converter raises whatever its parser meets
        message = f"Invalid '{param}': not a Lark or GBNF grammar: {str(err).strip()[:200]}"
        raise invalid_request(message, param=param) from err


def _choices(param: str, value: Any) -> list[str]:
    if not isinstance(value, list):
        raise type_error(param, "an array of strings", value)
    if not 1 <= len(value) <= MAX_CHOICES:
        message = f"Invalid '{param}': expected 1 to {MAX_CHOICES} strings, got {len(value)}."
        raise invalid_request(message, param=param)
    for i, choice in enumerate(value):
        if not isinstance(choice, str):
            raise type_error(f"{param}[{i}]", "a string", choice)
    return value


def guide_error_reason(err: BaseException) -> str:
    """The guide compiler's reason, on one line and in the caller's terms (a regex error's own ``error:`` line,
    which says what the pattern broke, joins the first)."""
    lines = str(err).strip().splitlines()
    if not lines:
        return type(err).__name__
    detail = next((line.strip() for line in lines[1:] if line.strip().startswith("error:")), None)
    first = _GUIDE_ERROR_PREFIX.sub("", lines[0])
    return f"{first} {detail}" if detail else first


def closed_schema(schema: object) -> object:
    """``schema`` with ``additionalProperties: false`` on every object schema that lists ``properties`` and
    leaves ``additionalProperties`` unsaid (walking subschemas by their keywords, never property names); a
    composed schema (``allOf``, ``anyOf``, ``oneOf``, ``not``) and its branches are left as they are."""
    if not isinstance(schema, dict):
        return schema
    closed: dict[str, Any] = dict(schema)
    for keyword in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(schema.get(keyword), dict):
            closed[keyword] = {name: closed_schema(sub) for name, sub in schema[keyword].items()}
    if isinstance(schema.get("prefixItems"), list):
        closed["prefixItems"] = [closed_schema(sub) for sub in schema["prefixItems"]]
    for keyword in ("items", "additionalProperties"):
        if isinstance(schema.get(keyword), dict):
            closed[keyword] = closed_schema(schema[keyword])
    # A composed schema's properties come from its branches too: closing it, or a branch, would forbid them.
    composed = any(keyword in schema for keyword in COMPOSITION_KEYWORDS)
    for keyword in COMPOSITION_KEYWORDS:
        if keyword in schema:
            closed[keyword] = schema[keyword]
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema and not composed:
        closed["additionalProperties"] = False
    return closed
