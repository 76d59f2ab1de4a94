"""Answers in the harmony format of GPT-OSS (``harmony``): channels of reasoning, tool calls and prose.

A harmony answer is a sequence of messages, each a header and its content::

    <|start|>assistant<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>CONTENT<|end|>

The recipient may also follow the role (``<|start|>assistant to=functions.NAME<|channel|>commentary json``).
The answer's first ``<|start|>assistant`` is the end of the prompt, so an answer begins at ``<|channel|>``. A
message ends with ``<|end|>``, ``<|call|>`` (after a tool call) or ``<|return|>`` (after the last one); the
engine stops at the last two, the model's end-of-turn tokens, before they reach the text, so the end of the
text ends a message too. What a message becomes:

    a recipient (to=functions.NAME), content a JSON object   -> a call of NAME
    a recipient of another namespace (to=browser.search)      -> a call named by the whole recipient
    a recipient, content anything else (or cut short)         -> prose: its content, as a malformed call's text
    the analysis channel (the chain of thought)               -> reasoning (the APIs' reasoning fields)
    the final channel, commentary (a preamble), any other     -> prose
    from a role other than the assistant                      -> dropped (the model wrote a turn not its own)

Prose messages are joined by a blank line, and so are reasoning messages; text outside any message is prose
and the tags are not::

    BETWEEN -- <|start|> or <|channel|>, header, <|message|>     --> IN_MESSAGE (what it becomes, from the header)
            -- a header broken by another tag, or never finished --> dropped, BETWEEN
            -- <|end|>, <|call|>, <|return|>                       --> dropped, BETWEEN
            -- other text                                          --> prose, BETWEEN
    IN_MESSAGE -- content, then <|end|>, <|call|>, <|return|> or the end of the text --> BETWEEN

Prose, reasoning and dropped content are decided as they arrive; a call waits for its end. The tags are special tokens,
which detokenizing drops unless it keeps special tokens: the ingress keeps them for this format.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from . import tool_call_grammar as grammar
from .tool_call_parser import (
    JSON_DECODER,
    FoundCall,
    Piece,
    Reasoning,
    Split,
    TokenId,
    ToolCallParser,
    ToolSpec,
    arguments_json,
    partial_tag_len,
    skip_whitespace,
)

START_TAG = "<|start|>"
CHANNEL_TAG = "<|channel|>"
CONSTRAIN_TAG = "<|constrain|>"
MESSAGE_TAG = "<|message|>"
END_TAGS = ("<|end|>", "<|call|>", "<|return|>")
HEADER_TAGS = (START_TAG, CHANNEL_TAG)
ASSISTANT_ROLE = "assistant"
ANALYSIS_CHANNEL = "analysis"
COMMENTARY_CHANNEL = "commentary"
FUNCTIONS_NAMESPACE = "functions."
PROSE_SEPARATOR = "\n\n"

_WORD = re.compile(r"[^\s<]+")
_RECIPIENT = re.compile(r"(?:^|(?<=\s)|(?<=\|>))to=([^\s<]+)")
_NOT_IN_NAMES = ("<", " ", "\t", "\n")


class _Kind(enum.Enum):
    PROSE = "prose"
    REASONING = "reasoning"
    CALL = "call"
    DROPPED = "dropped"


@dataclass(frozen=True, slots=True)
class _Message:
    """What the content of the message now open becomes; ``name``: the called tool's, for a call."""

    kind: _Kind
    name: str = ""


class HarmonyParser(ToolCallParser):
    def __init__(self, tools: Sequence[ToolSpec] | None = None) -> None:
        super().__init__(tools)
        self._message: _Message | None = None  # the message whose content comes next; None: between messages

    def split(self, held: str, *, final: bool) -> Split:
        pieces: list[Piece] = []
        position = 0
        while True:
            if self._message is None:
                verdict = self._between(held, position, pieces, final=final)
                if isinstance(verdict, Split):
                    return verdict
                position = verdict
                continue
            found = _first_tag(held, END_TAGS, position)
            if found is None and not final:
                return self._open_content(held, position, pieces)
            content_end_char = len(held) if found is None else found[0]
            pieces.extend(_message_pieces(self._message, held[position:content_end_char]))
            self._message = None
            if found is None:
                return Split(tuple(pieces), len(held))
            position = content_end_char + len(found[1])

    def _between(self, held: str, position: int, pieces: list[Piece], *, final: bool) -> Split | int:
        """Text outside messages from ``position``: where scanning goes on, or the split when it cannot."""
        found = _first_tag(held, (*HEADER_TAGS, *END_TAGS), position)
        if found is None:
            end_char = len(held) if final else len(held) - _partial_len(held[position:], (*HEADER_TAGS, *END_TAGS))
            pieces.append(held[position:end_char])
            return Split(tuple(pieces), end_char)
        tag_char, tag = found
        pieces.append(held[position:tag_char])
        if tag in END_TAGS:
            return tag_char + len(tag)
        header_char = tag_char + len(tag) if tag == START_TAG else tag_char
        stop = _first_tag(held, (MESSAGE_TAG, START_TAG, *END_TAGS), tag_char + len(tag))
        if stop is None:  # the header goes on, or was cut short: markup either way
            return Split(tuple(pieces), len(held)) if final else Split(tuple(pieces), tag_char, wait_for=">")
        stop_char, stop_tag = stop
        if stop_tag != MESSAGE_TAG:
            return stop_char
        self._message = _message_of(held[header_char:stop_char], has_role=tag == START_TAG)
        if self._message.kind is _Kind.PROSE:
            pieces.append(PROSE_SEPARATOR)
        elif self._message.kind is _Kind.REASONING:
            pieces.append(Reasoning(PROSE_SEPARATOR))
        return stop_char + len(MESSAGE_TAG)

    def _open_content(self, held: str, position: int, pieces: list[Piece]) -> Split:
        """The content of a message still open: a call waits for its end, the rest is decided as it comes."""
        assert self._message is not None
        if self._message.kind is _Kind.CALL:
            return Split(tuple(pieces), position, wait_for=">")
        end_char = len(held) - _partial_len(held[position:], END_TAGS)
        if self._message.kind is _Kind.PROSE:
            pieces.append(held[position:end_char])
        elif self._message.kind is _Kind.REASONING and end_char > position:
            pieces.append(Reasoning(held[position:end_char]))
        return Split(tuple(pieces), end_char)

    @classmethod
    def forced_call_grammar(cls, tools: Sequence[ToolSpec], *, parallel: bool, token_id: TokenId | None = None) -> str:
        """One call, parallel or not: a harmony turn ends at its call's ``<|call|>``."""
        channel, constrain, message = (grammar.tag(tag, token_id) for tag in (CHANNEL_TAG, CONSTRAIN_TAG, MESSAGE_TAG))
        bodies = [
            f"{channel} {grammar.literal(f'{COMMENTARY_CHANNEL} to={FUNCTIONS_NAMESPACE}{_checked_name(name)} ')} "
            f'{constrain} "json" {message} {grammar.json_schema(parameters)}'
            for name, parameters in grammar.forced_tools(tools)
        ]
        return grammar.assemble(bodies, parallel=False)


def _message_of(header: str, *, has_role: bool) -> _Message:
    """What a message becomes, from its header (the text between ``<|start|>`` or, for the answer's first
    message, ``<|channel|>`` and ``<|message|>``)."""
    role = _WORD.match(header) if has_role else None
    if has_role and (role is None or role.group() != ASSISTANT_ROLE):
        return _Message(_Kind.DROPPED)
    recipient = _RECIPIENT.search(header)
    if recipient is not None:
        return _Message(_Kind.CALL, recipient.group(1).removeprefix(FUNCTIONS_NAMESPACE))
    channel_char = header.find(CHANNEL_TAG)
    channel = _WORD.match(header, channel_char + len(CHANNEL_TAG)) if channel_char != -1 else None
    if channel is not None and channel.group() == ANALYSIS_CHANNEL:
        return _Message(_Kind.REASONING)
    return _Message(_Kind.PROSE)


def _message_pieces(message: _Message, content: str) -> list[Piece]:
    """A whole message's content as pieces: a call whose content is one JSON object, else prose, reasoning (or
    none)."""
    if message.kind is _Kind.DROPPED:
        return []
    if message.kind is _Kind.REASONING:
        return [Reasoning(content)] if content else []
    if message.kind is _Kind.CALL:
        try:
            arguments, end_char = JSON_DECODER.raw_decode(content, skip_whitespace(content, 0))
        except json.JSONDecodeError:
            arguments, end_char = None, 0
        if isinstance(arguments, dict) and skip_whitespace(content, end_char) == len(content):
            return [FoundCall(message.name, arguments_json(arguments))]
        return [PROSE_SEPARATOR, content]
    return [content]


def _first_tag(text: str, tags: Sequence[str], position: int) -> tuple[int, str] | None:
    """The earliest of ``tags`` in ``text`` from ``position``: where it starts, and which."""
    found = [(tag_char, tag) for tag in tags if (tag_char := text.find(tag, position)) != -1]
    return min(found) if found else None


def _partial_len(text: str, tags: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that may still grow into one of ``tags``."""
    return max(partial_tag_len(text, tag) for tag in tags)


def _checked_name(name: str) -> str:
    if not name or any(char in name for char in _NOT_IN_NAMES):
        raise ValueError(f"the name {name!r} cannot be written in the harmony tool-call format")
    return name
