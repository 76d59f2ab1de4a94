"""Tool calls in model output, in the ``<tool_call>`` convention of Qwen and Hermes.

Models trained on this convention answer a tool-using turn with one or more
blocks of the form::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

possibly mixed with ordinary prose. ``parse_tool_calls`` splits such output
into the prose (``content``) and OpenAI-style tool calls, whose ``arguments``
is a JSON *string* as in the OpenAI chat completions API.

Models get this format wrong now and then, so parsing never raises: a block
whose payload is not a JSON object with a string ``name``, or a final
``<tool_call>`` that is never closed (the generation was cut short), stays in
``content`` verbatim. The JSON payload is read with a real JSON decoder rather
than a regex, so a ``</tool_call>`` inside an argument string does not end the
block early.

``ToolCallStream`` makes the same decisions on text that arrives in pieces
(a streamed completion): each ``push`` returns the prose that is safe to
emit now and the calls that closed, holding back text that may still turn
out to be part of a block::

               text without "<tool_call>"  -> prose out (a trailing partial tag is held)
    PROSE ----------------------------------------------------------+
      |  "<tool_call>" seen                                         |
      v                                                             |
    IN_BLOCK  -- JSON call + "</tool_call>"  -> tool call out -------> PROSE
      |       -- anything else               -> the tag is prose ----> PROSE
      |       -- JSON or closing tag incomplete -> wait for more text
      v finish()
    FINISHED (what is held is decided as final text)
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_CALL_ID_PREFIX = "call_"
TOOL_CALL_ID_RANDOM_HEX_CHARS = 24

_JSON_DECODER = json.JSONDecoder()


def random_tool_call_id() -> str:
    """``call_`` followed by 24 random hex characters."""
    return TOOL_CALL_ID_PREFIX + secrets.token_hex(TOOL_CALL_ID_RANDOM_HEX_CHARS // 2)


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """The ``tool_calls[i]`` entry of an OpenAI chat completion message."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class ParsedToolCalls:
    content: str | None
    tool_calls: tuple[ToolCall, ...]


@dataclass(frozen=True, slots=True)
class _Block:
    """One well-formed ``<tool_call>`` block: its call payload and the char span it covers."""

    start_char: int
    end_char: int
    payload: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """What one ``ToolCallStream.push`` or ``finish`` decided."""

    content: str  # prose to emit now ("" when none is safe yet)
    tool_calls: tuple[ToolCall, ...]  # calls whose block closed in this piece, in order


def parse_tool_calls(text: str, *, id_factory: Callable[[], str] = random_tool_call_id) -> ParsedToolCalls:
    """Split model output into prose and tool calls; malformed blocks stay in the prose (``ToolCallStream`` on
    the whole text at once)."""
    stream = ToolCallStream(id_factory=id_factory)
    content = stream.push(text).content + stream.finish().content
    return ParsedToolCalls(content=content or None, tool_calls=stream.tool_calls)


def _parse_block_at(text: str, start_char: int) -> _Block | None:
    """The block opening at ``start_char`` if it is complete and holds a valid call, else None."""
    json_start_char = _skip_whitespace(text, start_char + len(TOOL_CALL_START))
    try:
        payload, json_end_char = _JSON_DECODER.raw_decode(text, json_start_char)
    except json.JSONDecodeError:
        return None
    close_char = _skip_whitespace(text, json_end_char)
    if not text.startswith(TOOL_CALL_END, close_char) or not _is_valid_call(payload):
        return None
    return _Block(start_char=start_char, end_char=close_char + len(TOOL_CALL_END), payload=payload)


def _skip_whitespace(text: str, position_char: int) -> int:
    while position_char < len(text) and text[position_char].isspace():
        position_char += 1
    return position_char


def _is_valid_call(payload: object) -> bool:
    return isinstance(payload, dict) and isinstance(payload.get("name"), str) and bool(payload["name"])


def _tool_call_from_payload(payload: dict[str, Any], call_id: str) -> ToolCall:
    arguments = payload.get("arguments", payload.get("parameters", {}))
    return ToolCall(id=call_id, name=payload["name"], arguments=_arguments_json(arguments))


def _arguments_json(arguments: object) -> str:
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False)


_NOT_A_BLOCK = -1


class ToolCallStream:
    """``parse_tool_calls`` on text that arrives piece by piece.

    Over a whole stream, the ``content`` of every delta joined equals
    ``parse_tool_calls(text).content or ""`` and their ``tool_calls`` joined
    equal its ``tool_calls`` (ids drawn from ``id_factory`` in the same
    order). Content is stripped as ``parse_tool_calls`` strips it: leading
    whitespace is dropped, trailing whitespace waits for the next non-space
    prose (and is dropped by ``finish``).
    """

    __slots__ = ("_content_started", "_decode_failed_len", "_held", "_id_factory", "_tool_calls", "_trailing_space")

    def __init__(self, *, id_factory: Callable[[], str] = random_tool_call_id) -> None:
        self._id_factory = id_factory
        self._held = ""  # text not decided yet: a possible block, or a possible start of its tag
        self._trailing_space = ""
        self._content_started = False
        # Length of ``_held`` when its block's JSON last failed to decode: only a later "}" can complete it.
        self._decode_failed_len: int | None = None
        self._tool_calls: list[ToolCall] = []

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        """Every call found so far."""
        return tuple(self._tool_calls)

    def push(self, text: str) -> ToolCallDelta:
        """Take the next piece of text; returns what can be decided now."""
        self._held += text
        return self._scan(final=False)

    def finish(self) -> ToolCallDelta:
        """The stream ended: decide what is still held (an unclosed block is prose)."""
        return self._scan(final=True)

    def _scan(self, *, final: bool) -> ToolCallDelta:
        prose: list[str] = []
        calls: list[ToolCall] = []
        while (start_char := self._held.find(TOOL_CALL_START)) != -1:
            prose.append(self._take(start_char))
            end_char = self._block_end(final=final)
            if end_char is None:
                break
            block = None if end_char == _NOT_A_BLOCK else _parse_block_at(self._held[:end_char], 0)
            if block is None:
                # Not a block after all: the tag is prose and scanning resumes after it, as in parse_tool_calls.
                prose.append(self._take(len(TOOL_CALL_START)))
                continue
            self._take(end_char)
            calls.append(_tool_call_from_payload(block.payload, self._id_factory()))
        else:
            keep_chars = 0 if final else _partial_tag_len(self._held)
            prose.append(self._take(len(self._held) - keep_chars))
        self._tool_calls.extend(calls)
        return ToolCallDelta(content=self._strip("".join(prose), final=final), tool_calls=tuple(calls))

    def _take(self, num_chars: int) -> str:
        taken, self._held = self._held[:num_chars], self._held[num_chars:]
        if num_chars:
            self._decode_failed_len = None
        return taken

    def _block_end(self, *, final: bool) -> int | None:
        """Where the block opening the held text ends, ``_NOT_A_BLOCK``, or None while undecided."""
        held = self._held
        json_start_char = _skip_whitespace(held, len(TOOL_CALL_START))
        if json_start_char == len(held):
            return _NOT_A_BLOCK if final else None
        if held[json_start_char] != "{":  # a call is a JSON object
            return _NOT_A_BLOCK
        if not final and self._decode_failed_len is not None and "}" not in held[self._decode_failed_len :]:
            return None
        try:
            _, json_end_char = _JSON_DECODER.raw_decode(held, json_start_char)
        except json.JSONDecodeError:
            if final:
                return _NOT_A_BLOCK
            self._decode_failed_len = len(held)
            return None
        close_char = _skip_whitespace(held, json_end_char)
        if held.startswith(TOOL_CALL_END, close_char):
            return close_char + len(TOOL_CALL_END)
        return None if not final and TOOL_CALL_END.startswith(held[close_char:]) else _NOT_A_BLOCK

    def _strip(self, text: str, *, final: bool) -> str:
        if not self._content_started:
            text = text.lstrip()
        text = self._trailing_space + text
        body = text.rstrip()
        self._trailing_space = "" if final else text[len(body) :]
        self._content_started = self._content_started or bool(body)
        return body


def _partial_tag_len(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``."""
    for length in range(min(len(text), len(TOOL_CALL_START) - 1), 0, -1):
        if TOOL_CALL_START.startswith(text[-length:]):
            return length
    return 0
