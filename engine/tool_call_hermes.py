"""Tool calls in the ``<tool_call>`` convention of Hermes and Qwen2.5 (``hermes``, the default format).

Models trained on it answer a tool-using turn with one or more blocks::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

possibly mixed with prose. The payload is read with a real JSON decoder
rather than a regex, so a ``</tool_call>`` inside an argument string does not
end the block early. A block whose payload is not a JSON object with a string
``name``, or one never closed (the generation was cut short), stays prose::

    <tool_call> + JSON call + </tool_call>   -> a call
    <tool_call> + anything else              -> the tag is prose, scanning goes on after it
    <tool_call> + JSON or closing tag incomplete -> held, waiting for more text
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from . import tool_call_grammar as grammar
from .tool_call_parser import (
    JSON_DECODER,
    Block,
    TaggedBlockParser,
    TokenId,
    ToolSpec,
    Undecided,
    call_from_payload,
    is_call_payload,
    skip_whitespace,
)

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class HermesParser(TaggedBlockParser):
    start_tag = TOOL_CALL_START

    def read_block(self, text: str, start_char: int, *, final: bool) -> Block | Undecided | None:
        json_start_char = skip_whitespace(text, start_char + len(TOOL_CALL_START))
        if json_start_char == len(text):
            return None if final else Undecided()
        if text[json_start_char] != "{":  # a call is a JSON object
            return None
        try:
            payload, json_end_char = JSON_DECODER.raw_decode(text, json_start_char)
        except json.JSONDecodeError:
            # Incomplete or malformed, which only the end of the text tells apart; only a "}" can complete it.
            return None if final else Undecided(wait_for="}")
        close_char = skip_whitespace(text, json_end_char)
        if text.startswith(TOOL_CALL_END, close_char):
            if not is_call_payload(payload):
                return None
            return Block(close_char + len(TOOL_CALL_END), (call_from_payload(payload),))
        return Undecided() if not final and TOOL_CALL_END.startswith(text[close_char:]) else None

    @classmethod
    def forced_call_grammar(cls, tools: Sequence[ToolSpec], *, parallel: bool, token_id: TokenId | None = None) -> str:
        start, end = grammar.tag(TOOL_CALL_START, token_id), grammar.tag(TOOL_CALL_END, token_id)
        bodies = [
            f'{start} "\\n" {grammar.json_call(name, "arguments", parameters)} "\\n" {end}'
            for name, parameters in grammar.forced_tools(tools)
        ]
        return grammar.assemble(bodies, parallel=parallel, separator='"\\n"')
