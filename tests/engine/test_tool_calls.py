"""Parsing ``<tool_call>`` blocks out of model output."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable

from rayturn.engine.tool_calls import ParsedToolCalls, ToolCall, parse_tool_calls


def _sequential_ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _parse(text: str) -> ParsedToolCalls:
    return parse_tool_calls(text, id_factory=_sequential_ids())


def test_single_call_without_content() -> None:
    parsed = _parse('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert parsed == ParsedToolCalls(
        content=None,
        tool_calls=(ToolCall(id="call_0", name="get_weather", arguments='{"city": "Paris"}'),),
    )


def test_multiple_calls_with_surrounding_content() -> None:
    text = (
        "Let me check both.\n"
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
        '<tool_call>\n  {"name": "b", "arguments": {}}  \n</tool_call>\n'
        "Done."
    )
    parsed = _parse(text)
    assert [call.name for call in parsed.tool_calls] == ["a", "b"]
    assert [call.arguments for call in parsed.tool_calls] == ['{"x": 1}', "{}"]
    assert [call.id for call in parsed.tool_calls] == ["call_0", "call_1"]
    assert parsed.content == "Let me check both.\n\n\nDone."


def test_plain_text_has_no_calls() -> None:
    assert _parse("  just an answer \n") == ParsedToolCalls(content="just an answer", tool_calls=())
    assert _parse("") == ParsedToolCalls(content=None, tool_calls=())


def test_non_ascii_arguments_are_kept_unescaped() -> None:
    parsed = _parse('<tool_call>{"name": "say", "arguments": {"text": "héllo 🙂 中文"}}</tool_call>')
    assert parsed.tool_calls[0].arguments == '{"text": "héllo 🙂 中文"}'
    assert json.loads(parsed.tool_calls[0].arguments) == {"text": "héllo 🙂 中文"}


def test_string_arguments_are_kept_verbatim() -> None:
    parsed = _parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert parsed.tool_calls[0].arguments == '{"x": 1}'


def test_missing_arguments_become_empty_object() -> None:
    assert _parse('<tool_call>{"name": "now"}</tool_call>').tool_calls[0].arguments == "{}"


def test_closing_tag_inside_an_argument_string_does_not_end_the_block() -> None:
    parsed = _parse('<tool_call>{"name": "echo", "arguments": {"s": "</tool_call>"}}</tool_call>')
    assert parsed.content is None
    assert json.loads(parsed.tool_calls[0].arguments) == {"s": "</tool_call>"}


def test_malformed_json_block_stays_in_content() -> None:
    bad_block = '<tool_call>{"name": "a", "arguments": {</tool_call>'
    good_block = '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    parsed = _parse(f"{bad_block}\n{good_block}")
    assert parsed.content == bad_block
    assert [call.name for call in parsed.tool_calls] == ["b"]


def test_block_without_name_stays_in_content() -> None:
    for block in (
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": 3}</tool_call>',
        "<tool_call>[1, 2]</tool_call>",
    ):
        assert _parse(block) == ParsedToolCalls(content=block, tool_calls=())


def test_unterminated_final_block_is_content() -> None:
    text = 'ok <tool_call>{"name": "a"}</tool_call> then <tool_call>{"name": "b", "argu'
    parsed = _parse(text)
    assert [call.name for call in parsed.tool_calls] == ["a"]
    assert parsed.content == 'ok  then <tool_call>{"name": "b", "argu'


def test_complete_json_without_closing_tag_is_content() -> None:
    text = '<tool_call>{"name": "a", "arguments": {}}'
    assert _parse(text) == ParsedToolCalls(content=text, tool_calls=())


def test_to_openai_shape() -> None:
    call = ToolCall(id="call_x", name="f", arguments='{"a": 1}')
    assert call.to_openai() == {"id": "call_x", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}


def test_default_ids_are_unique_call_prefixed() -> None:
    text = '<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "a"}</tool_call>'
    ids = [call.id for call in parse_tool_calls(text).tool_calls]
    assert all(re.fullmatch(r"call_[0-9a-zA-Z]{24}", call_id) for call_id in ids)
    assert len(set(ids)) == 2
