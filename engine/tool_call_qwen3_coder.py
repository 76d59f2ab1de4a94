"""Tool calls in the XML-like format of Qwen3-Coder (``qwen3_coder``).

Each call is one block; parameter values are raw text, not JSON::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A value is the text between ``<parameter=P>`` and ``</parameter>``, less one
leading and one trailing newline. The arguments are a JSON object: with the
tool's schema known, a parameter the schema types as a string keeps its text
and any other is read as JSON (the text when it is not JSON); without it,
each value is read as JSON and falls back to its text. A value read as JSON
may hold ``</parameter>`` inside a JSON string; a text value ends at the
first ``</parameter>``. A block out of this shape, or never closed, is prose.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from . import tool_call_grammar as grammar
from .tool_call_hermes import TOOL_CALL_END, TOOL_CALL_START
from .tool_call_parser import (
    Block,
    FoundCall,
    TaggedBlockParser,
    TokenId,
    ToolSpec,
    Undecided,
    skip_whitespace,
)

FUNCTION_START = "<function="
FUNCTION_END = "</function>"
PARAMETER_START = "<parameter="
PARAMETER_END = "</parameter>"

# Keywords that constrain a schema beyond its "type": a schema without "type" and without these takes any value.
_CONSTRAINING_KEYWORDS = ("anyOf", "oneOf", "allOf", "not", "enum", "const", "$ref", "if")
_NOT_IN_NAMES = ("<", ">", "\n")
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
# A text value: anything without "</parameter>", then the newline and the closing tag.
_TEXT_VALUE_RULE = r'TEXT_VALUE: (/(.|\n)*/ & ~/(.|\n)*<\/parameter>(.|\n)*/) "\n</parameter>\n"'


class Qwen3CoderParser(TaggedBlockParser):
    start_tag = TOOL_CALL_START

    def read_block(self, text: str, start_char: int, *, final: bool) -> Block | Undecided | None:
        verdict = self._read(text, start_char)
        return None if final and isinstance(verdict, Undecided) else verdict

    def _read(self, text: str, start_char: int) -> Block | Undecided | None:
        function = _read_tag(text, skip_whitespace(text, start_char + len(TOOL_CALL_START)), FUNCTION_START)
        if not isinstance(function, tuple):
            return function
        name, position = function
        arguments: dict[str, Any] = {}
        while True:
            position = skip_whitespace(text, position)
            if text.startswith(FUNCTION_END, position):
                position += len(FUNCTION_END)
                break
            if not text.startswith(PARAMETER_START, position):
                rest = text[position:]
                return Undecided() if PARAMETER_START.startswith(rest) or FUNCTION_END.startswith(rest) else None
            parameter = _read_tag(text, position, PARAMETER_START)
            if not isinstance(parameter, tuple):
                return parameter
            parameter_name, value_char = parameter
            schema = self._parameter_schema(name, parameter_name)
            end_char = _value_end(text, value_char, json_value=schema is not None and not is_text_parameter(schema))
            if end_char is None:
                return Undecided(wait_for=">")  # a value ends only with the ">" of its closing tag
            arguments[parameter_name] = parameter_value(_without_edge_newlines(text[value_char:end_char]), schema)
            position = end_char + len(PARAMETER_END)
        close_char = skip_whitespace(text, position)
        if text.startswith(TOOL_CALL_END, close_char):
            call = FoundCall(name, json.dumps(arguments, ensure_ascii=False))
            return Block(close_char + len(TOOL_CALL_END), (call,))
        return Undecided() if TOOL_CALL_END.startswith(text[close_char:]) else None

    def _parameter_schema(self, function: str, parameter: str) -> Mapping[str, Any] | None:
        properties = self.tools.get(function, {}).get("properties")
        schema = properties.get(parameter) if isinstance(properties, Mapping) else None
        return schema if isinstance(schema, Mapping) else None

    @classmethod
    def forced_call_grammar(cls, tools: Sequence[ToolSpec], *, parallel: bool, token_id: TokenId | None = None) -> str:
        start, end = grammar.tag(TOOL_CALL_START, token_id), grammar.tag(TOOL_CALL_END, token_id)
        bodies = []
        for name, parameters in grammar.forced_tools(tools):
            head = grammar.literal(f"\n{FUNCTION_START}{_checked_name(name)}>\n")
            items = (start, head, _parameters_grammar(parameters), '"</function>\\n"', end)
            bodies.append(" ".join(item for item in items if item))
        return grammar.assemble(bodies, parallel=parallel, separator='"\\n"', extra_rules=[_TEXT_VALUE_RULE])


def is_text_parameter(schema: Mapping[str, Any]) -> bool:
    """Whether a parameter's value is written as raw text: a string type, or a schema that takes any value."""
    types = _types(schema)
    if not types:
        return not any(keyword in schema for keyword in _CONSTRAINING_KEYWORDS)
    return "string" in types


def parameter_value(text: str, schema: Mapping[str, Any] | None) -> object:
    """A raw parameter value as its JSON value: a string parameter's text as is, anything else read as JSON
    when it is JSON."""
    if schema is not None and "string" in _types(schema):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _read_tag(text: str, position: int, opening: str) -> tuple[str, int] | Undecided | None:
    """``<opening>NAME>`` at ``position``: (name, where the text after it starts), undecided or malformed."""
    if not text.startswith(opening, position):
        return Undecided() if opening.startswith(text[position:]) else None
    name_char = position + len(opening)
    close_char = text.find(">", name_char)
    name = text[name_char:] if close_char == -1 else text[name_char:close_char]
    if any(char in name for char in _NOT_IN_NAMES):
        return None
    if close_char == -1:
        return Undecided()
    name = name.strip()
    return (name, close_char + 1) if name else None


def _value_end(text: str, value_char: int, *, json_value: bool) -> int | None:
    """Where the closing ``</parameter>`` of the value at ``value_char`` starts, None while it is missing;
    for a JSON value, one inside a JSON string does not count."""
    if not json_value:
        end_char = text.find(PARAMETER_END, value_char)
        return None if end_char == -1 else end_char
    position = value_char
    while True:
        end_char = text.find(PARAMETER_END, position)
        quote_char = text.find('"', position, None if end_char == -1 else end_char)
        if quote_char == -1:
            return None if end_char == -1 else end_char
        string = _JSON_STRING.match(text, quote_char)
        if string is None:  # the string is still open
            return None
        position = string.end()


def _types(schema: Mapping[str, Any]) -> list[object]:
    types = schema.get("type")
    return [types] if isinstance(types, str) else types if isinstance(types, list) else []


def _without_edge_newlines(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _checked_name(name: str) -> str:
    if name != name.strip() or not name or any(char in name for char in _NOT_IN_NAMES):
        raise ValueError(f"the name {name!r} cannot be written in the qwen3_coder tool-call format")
    return name


def _parameters_grammar(parameters: Mapping[str, Any]) -> str:
    """The Lark items for a call's parameters: the schema's properties in order, the required ones always."""
    properties = parameters.get("properties")
    properties = properties if isinstance(properties, Mapping) else {}
    required = parameters.get("required")
    required = [name for name in required if isinstance(name, str)] if isinstance(required, list) else []
    defs = {key: parameters[key] for key in ("$defs", "definitions") if key in parameters}
    items = []
    for name in [*properties, *(name for name in required if name not in properties)]:
        schema = properties.get(name)
        schema = schema if isinstance(schema, Mapping) else {}
        head = grammar.literal(f"{PARAMETER_START}{_checked_name(name)}>\n")
        item = f"{head} {_value_grammar(schema, defs)}"
        items.append(f"({item})" if name in required else f"({item})?")
    if not properties and parameters.get("additionalProperties", True) is True:
        items.append(r'("<parameter=" /[A-Za-z_][A-Za-z0-9_.\-]*/ ">\n" TEXT_VALUE)*')
    return " ".join(items)


def _value_grammar(schema: Mapping[str, Any], defs: Mapping[str, Any]) -> str:
    """A value and its closing tag: raw text for a text parameter (one of its strings when it lists them),
    JSON for any other."""
    if not is_text_parameter(schema):
        return f'{grammar.json_schema({**schema, **defs})} "\\n</parameter>\\n"'
    choices = schema["enum"] if isinstance(schema.get("enum"), list) else [schema.get("const")]
    strings = [value for value in choices if isinstance(value, str) and PARAMETER_END not in value]
    if "string" not in _types(schema) or not strings:
        return "TEXT_VALUE"
    return "(" + " | ".join(grammar.literal(value) for value in strings) + ') "\\n</parameter>\\n"'
