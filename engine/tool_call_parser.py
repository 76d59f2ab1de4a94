"""The plug-in point for tool-call formats: what one format's parser decides about the text a stream holds.

A stream (``rayturn.engine.tool_calls.ToolCallStream``) keeps the text it has
not decided yet and, after each piece arrives, hands all of it to its
format's ``ToolCallParser.split``. ``split`` decides a prefix of that text --
prose, calls and (in formats that mark it) reasoning, in order -- and leaves the rest held. Two rules make every
format safe to stream, however the text is cut:

- a decision on a prefix is the decision on the whole text: ``split`` only
  decides what no continuation can change, and with ``final=True`` (the
  stream ended) it decides everything;
- model output is never an error: what does not parse as a call is prose.

A parser object serves one stream (it may keep state between calls, as the
Llama parser does) and knows the call's tools when given them, so formats
whose arguments are raw text can type them by the tool's JSON schema.
``TaggedBlockParser`` does the scanning for the formats whose calls are
blocks opening with a tag anywhere in the prose.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

JSON_DECODER = json.JSONDecoder()

ToolSpec = Mapping[str, Any]
"""An OpenAI function tool, ``{"type": "function", "function": {"name", "parameters"}}`` (or the bare function)."""

TokenId = Callable[[str], int | None]
"""The model tokenizer's id of a text when that text is one token (``Tokenizer.token_to_id``), else None."""


@dataclass(frozen=True, slots=True)
class FoundCall:
    """A call as its format spells it; the stream gives it an id."""

    name: str
    arguments: str  # a JSON object, as text


@dataclass(frozen=True, slots=True)
class Reasoning:
    """Text of the model's reasoning, which its format marks apart from the answer (harmony's analysis
    channel, ``<think>`` with a reasoning parser): shown to the client as reasoning, never as the answer's
    content."""

    text: str


Piece = str | FoundCall | Reasoning


@dataclass(frozen=True, slots=True)
class Split:
    """What ``split`` decided: ``pieces`` (prose and calls, in order) cover the first ``decided_chars`` of the
    held text; the rest stays held, undecided until one of ``wait_for``'s characters arrives ("": any text may
    decide it)."""

    pieces: tuple[Piece, ...]
    decided_chars: int
    wait_for: str = ""


@dataclass(frozen=True, slots=True)
class Block:
    """A tagged block that holds calls, ending at ``end_char``."""

    end_char: int
    calls: tuple[FoundCall, ...]


@dataclass(frozen=True, slots=True)
class Undecided:
    """A tagged block that more text may still complete (or break); see ``Split.wait_for``."""

    wait_for: str = ""


class ToolCallParser(ABC):
    """One tool-call format: finding its calls in streamed text, and the grammar that forces one."""

    def __init__(self, tools: Sequence[ToolSpec] | None = None) -> None:
        self.tools = function_tools(tools or ())

    @abstractmethod
    def split(self, held: str, *, final: bool) -> Split:
        """Decide what can be decided at the front of ``held`` (everything when ``final``)."""

    @classmethod
    @abstractmethod
    def forced_call_grammar(cls, tools: Sequence[ToolSpec], *, parallel: bool, token_id: TokenId | None = None) -> str:
        """A Lark grammar (llguidance's dialect) whose every string is one call (one or more with ``parallel``)
        of one of ``tools`` in this format, with arguments valid for that tool's schema, which ``split`` reads
        back as exactly those calls. ``token_id``: the format's tags the tokenizer holds as one token are
        constrained to that token (as the model was trained to write them), the others to their text; a tag
        forced as a *special* token reaches the parser only when detokenizing keeps special tokens.

        Arguments held to a JSON schema follow it in full (as far as llguidance does); Qwen3-Coder's raw
        text values follow a string's ``enum`` or ``const`` but not its ``pattern``, ``format`` or lengths."""


class TaggedBlockParser(ToolCallParser):
    """A format whose calls are blocks opening with ``start_tag``, anywhere in the prose.

    A block is read by ``read_block``; one that turns out malformed leaves its
    tag as prose and scanning goes on right after the tag. Prose ending in what
    may be the start of the tag holds that much back.
    """

    start_tag: ClassVar[str]

    def split(self, held: str, *, final: bool) -> Split:
        pieces: list[Piece] = []
        position = 0
        while (start_char := held.find(self.start_tag, position)) != -1:
            pieces.append(held[position:start_char])
            verdict = self.read_block(held, start_char, final=final)
            if isinstance(verdict, Undecided):
                return Split(tuple(pieces), start_char, verdict.wait_for)
            if verdict is None:
                pieces.append(self.start_tag)
                position = start_char + len(self.start_tag)
                continue
            pieces.extend(verdict.calls)
            position = verdict.end_char
        end_char = len(held) - (0 if final else partial_tag_len(held[position:], self.start_tag))
        pieces.append(held[position:end_char])
        return Split(tuple(pieces), end_char)

    @abstractmethod
    def read_block(self, text: str, start_char: int, *, final: bool) -> Block | Undecided | None:
        """The block whose tag opens at ``start_char``: complete, undecided (never when ``final``), or None
        when it is not a block."""


def function_tools(tools: Sequence[ToolSpec]) -> dict[str, Mapping[str, Any]]:
    """Each function tool's parameters schema by name (``{"type": "object"}`` when it has none); entries
    that are not function tools are skipped."""
    functions: dict[str, Mapping[str, Any]] = {}
    for tool in tools:
        function = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        functions[function["name"]] = parameters if isinstance(parameters, Mapping) else {"type": "object"}
    return functions


def skip_whitespace(text: str, position_char: int) -> int:
    while position_char < len(text) and text[position_char].isspace():
        position_char += 1
    return position_char


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


def is_call_payload(payload: object) -> bool:
    """A JSON call object: a dict with a non-empty string ``name``."""
    return isinstance(payload, dict) and isinstance(payload.get("name"), str) and bool(payload["name"])


def call_from_payload(payload: Mapping[str, Any]) -> FoundCall:
    """The call a JSON call object names; its arguments under ``arguments`` or ``parameters`` (none: ``{}``)."""
    return FoundCall(payload["name"], arguments_json(payload.get("arguments", payload.get("parameters", {}))))


def arguments_json(arguments: object) -> str:
    """Arguments as JSON text; a string is taken to be JSON text already."""
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False)
