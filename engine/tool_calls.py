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


def parse_tool_calls(text: str, *, id_factory: Callable[[], str] = random_tool_call_id) -> ParsedToolCalls:
    """Split model output into prose and tool calls; malformed blocks stay in the prose."""
    blocks = _find_blocks(text)
    content_pieces: list[str] = []
    tool_calls: list[ToolCall] = []
    cursor_char = 0
    for block in blocks:
        content_pieces.append(text[cursor_char : block.start_char])
        tool_calls.append(_tool_call_from_payload(block.payload, id_factory()))
        cursor_char = block.end_char
    content_pieces.append(text[cursor_char:])
    content = "".join(content_pieces).strip()
    return ParsedToolCalls(content=content or None, tool_calls=tuple(tool_calls))


def _find_blocks(text: str) -> list[_Block]:
    blocks: list[_Block] = []
    search_from_char = 0
    while (start_char := text.find(TOOL_CALL_START, search_from_char)) != -1:
        block = _parse_block_at(text, start_char)
        if block is None:
            search_from_char = start_char + len(TOOL_CALL_START)
            continue
        blocks.append(block)
        search_from_char = block.end_char
    return blocks


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
