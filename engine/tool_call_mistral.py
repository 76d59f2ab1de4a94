"""Tool calls in the formats of Mistral models (``mistral``).

Calls follow the ``[TOOL_CALLS]`` token, in one of two spellings::

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]   (tokenizers up to v3)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}             (v11 and later)

Prose may come before. A ``[TOOL_CALLS]`` followed by neither (or by an array
holding anything but calls) is prose, as is one never completed. The JSON is
read with a real decoder, so brackets inside argument strings do no harm.

The tags are control tokens, which detokenizing drops unless it keeps
special tokens: the parser sees calls only in text that kept them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from . import tool_call_grammar as grammar
from .tool_call_parser import (
    JSON_DECODER,
    Block,
    FoundCall,
    TaggedBlockParser,
    TokenId,
    ToolSpec,
    Undecided,
    arguments_json,
    call_from_payload,
    is_call_payload,
    skip_whitespace,
)

TOOL_CALLS_TAG = "[TOOL_CALLS]"
ARGS_TAG = "[ARGS]"

_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MistralParser(TaggedBlockParser):
    start_tag = TOOL_CALLS_TAG

    def read_block(self, text: str, start_char: int, *, final: bool) -> Block | Undecided | None:
        position = skip_whitespace(text, start_char + len(TOOL_CALLS_TAG))
        if position == len(text):
            verdict: Block | Undecided | None = Undecided()
        elif text[position] == "[":
            verdict = _read_array(text, position)
        else:
            verdict = _read_named(text, position)
        return None if final and isinstance(verdict, Undecided) else verdict

    @classmethod
    def forced_call_grammar(cls, tools: Sequence[ToolSpec], *, parallel: bool, token_id: TokenId | None = None) -> str:
        """The ``NAME[ARGS]{json}`` spelling when the tokenizer has an ``[ARGS]`` token, else the JSON array."""
        functions = grammar.forced_tools(tools)
        calls_tag = grammar.tag(TOOL_CALLS_TAG, token_id)
        if token_id is not None and token_id(ARGS_TAG) is not None:
            args_tag = grammar.tag(ARGS_TAG, token_id)
            bodies = [
                f"{calls_tag} {grammar.literal(_checked_name(name))} {args_tag} {grammar.json_schema(parameters)}"
                for name, parameters in functions
            ]
            return grammar.assemble(bodies, parallel=parallel)
        bodies = [grammar.json_call(name, "arguments", parameters) for name, parameters in functions]
        return grammar.assemble(bodies, parallel=parallel, separator='", "', prefix=f'{calls_tag} "["', suffix='"]"')


def _read_array(text: str, position: int) -> Block | Undecided | None:
    try:
        payload, end_char = JSON_DECODER.raw_decode(text, position)
    except json.JSONDecodeError:
        return Undecided(wait_for="]")  # incomplete or malformed: only a "]" can complete it
    if not isinstance(payload, list) or not payload or not all(is_call_payload(call) for call in payload):
        return None
    return Block(end_char, tuple(call_from_payload(call) for call in payload))


def _read_named(text: str, position: int) -> Block | Undecided | None:
    name = _FUNCTION_NAME.match(text, position)
    if name is None:
        return None
    args_char = name.end()
    if not text.startswith(ARGS_TAG, args_char):
        return Undecided() if ARGS_TAG.startswith(text[args_char:]) else None
    object_char = skip_whitespace(text, args_char + len(ARGS_TAG))
    if object_char == len(text):
        return Undecided()
    if text[object_char] != "{":
        return None
    try:
        arguments, end_char = JSON_DECODER.raw_decode(text, object_char)
    except json.JSONDecodeError:
        return Undecided(wait_for="}")
    return Block(end_char, (FoundCall(name.group(), arguments_json(arguments)),))


def _checked_name(name: str) -> str:
    if _FUNCTION_NAME.fullmatch(name) is None:
        raise ValueError(f"the name {name!r} cannot be written in the mistral [ARGS] tool-call format")
    return name
