"""Tool calls in the JSON format of Llama 3.x (``llama3_json``).

A tool-using answer *is* the calls: a JSON object per call, several joined
by ``;``, optionally after the ``<|python_tag|>`` token::

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

The arguments may also sit under ``arguments``. The answer is read from its
start, one call at a time::

    START      -- "{" or <|python_tag|> "{" (after whitespace) -> read a call
               -- anything else                               -> PROSE (the whole answer)
    a call     -- a JSON object with "name" and "parameters"  -> call out, AFTER_CALL
               -- anything else (the first call)              -> PROSE (the whole answer)
    AFTER_CALL -- ";" then "{"                                -> read a call
               -- anything else                               -> PROSE (from there on)
    PROSE      -- everything is prose to the end
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence

from . import tool_call_grammar as grammar
from .tool_call_parser import (
    JSON_DECODER,
    FoundCall,
    Piece,
    Split,
    TokenId,
    ToolCallParser,
    ToolSpec,
    call_from_payload,
    is_call_payload,
    skip_whitespace,
)

PYTHON_TAG = "<|python_tag|>"
CALL_SEPARATOR = ";"


class _Mode(enum.Enum):
    START = "start"
    AFTER_CALL = "after_call"
    PROSE = "prose"


class _Wait(enum.Enum):
    """Not decided yet: what the held text needs (any text; or a "}" that may close the JSON object)."""

    MORE = ""
    CLOSING_BRACE = "}"


class Llama3JsonParser(ToolCallParser):
    def __init__(self, tools: Sequence[ToolSpec] | None = None) -> None:
        super().__init__(tools)
        self._mode = _Mode.START

    def split(self, held: str, *, final: bool) -> Split:
        pieces: list[Piece] = []
        position = 0
        while self._mode is not _Mode.PROSE:
            verdict = self._next_call(held, position)
            if isinstance(verdict, _Wait):
                if not final:
                    return Split(tuple(pieces), position, verdict.value)
                break
            if verdict is None:
                break
            call, position = verdict
            pieces.append(call)
            self._mode = _Mode.AFTER_CALL
        self._mode = _Mode.PROSE
        pieces.append(held[position:])
        return Split(tuple(pieces), len(held))

    def _next_call(self, held: str, position: int) -> tuple[FoundCall, int] | _Wait | None:
        """The call that comes next and where it ends, what it waits for, or None when prose comes next."""
        object_char = self._call_start(held, skip_whitespace(held, position))
        if object_char is None or isinstance(object_char, _Wait):
            return object_char
        try:
            payload, end_char = JSON_DECODER.raw_decode(held, object_char)
        except json.JSONDecodeError:
            return _Wait.CLOSING_BRACE
        if not is_call_payload(payload) or not isinstance(payload.get("parameters", payload.get("arguments")), dict):
            return None
        return call_from_payload(payload), end_char

    def _call_start(self, held: str, position: int) -> int | _Wait | None:
        """Where the next call's JSON object opens, what it waits for, or None when no call comes next."""
        if position == len(held):
            return _Wait.MORE
        if self._mode is _Mode.START:
            if held.startswith(PYTHON_TAG, position):
                return _opening_brace(held, skip_whitespace(held, position + len(PYTHON_TAG)))
            if PYTHON_TAG.startswith(held[position:]):
                return _Wait.MORE
            return _opening_brace(held, position)
        if held[position] != CALL_SEPARATOR:
            return None
        return _opening_brace(held, skip_whitespace(held, position + len(CALL_SEPARATOR)))

    @classmethod
    def forced_call_grammar(cls, tools: Sequence[ToolSpec], *, parallel: bool, token_id: TokenId | None = None) -> str:
        bodies = [grammar.json_call(name, "parameters", parameters) for name, parameters in grammar.forced_tools(tools)]
        return grammar.assemble(bodies, parallel=parallel, separator=grammar.literal(f"{CALL_SEPARATOR} "))


def _opening_brace(held: str, position: int) -> int | _Wait | None:
    if position == len(held):
        return _Wait.MORE
    return position if held[position] == "{" else None
