"""Parsing ``<tool_call>`` blocks out of model output."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable

from rayturn.engine.tool_calls import ParsedToolCalls, ToolCall, ToolCallDelta, ToolCallStream, parse_tool_calls


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


# -- the streaming parser --------------------------------------------------------------------

STREAM_CASES = [
    "",
    "  just an answer \n",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "Let me check both.\n"
    '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
    '<tool_call>\n  {"name": "b", "arguments": {}}  \n</tool_call>\n'
    "Done.",
    '<tool_call>{"name": "echo", "arguments": {"s": "</tool_call>"}}</tool_call>',
    '<tool_call>{"name": "a", "arguments": {</tool_call>\n<tool_call>{"name": "b", "arguments": {}}</tool_call>',
    '<tool_call>{"arguments": {}}</tool_call>',
    "<tool_call>[1, 2]</tool_call> and <tool_call>",
    'ok <tool_call>{"name": "a"}</tool_call> then <tool_call>{"name": "b", "argu',
    '<tool_call>{"name": "a", "arguments": {}}',
    '<tool_call>{"name": "a"} </tool_cal',
    '<tool_call>{"name": "a"} </tool_x> after',
    '<tool_call><tool_call>{"name": "n"}</tool_call>',
    "a < b, <tool_ca is not a tag, and x <tool_call",
    '  \n <tool_call>{"name": "say", "arguments": {"text": "héllo 🙂"}}</tool_call>  spaced  \n  out  ',
]


def _stream(text: str, chunk_sizes: list[int]) -> tuple[list[str], list[ToolCall], list[tuple[ToolCall, ...]]]:
    """Push ``text`` in chunks of the given sizes (cycled); returns the contents, the calls, and each delta's calls."""
    stream = ToolCallStream(id_factory=_sequential_ids())
    contents: list[str] = []
    per_delta: list[tuple[ToolCall, ...]] = []
    position, sizes = 0, itertools.cycle(chunk_sizes)
    while position < len(text):
        size = next(sizes)
        delta = stream.push(text[position : position + size])
        contents.append(delta.content)
        per_delta.append(delta.tool_calls)
        position += size
    final = stream.finish()
    contents.append(final.content)
    per_delta.append(final.tool_calls)
    assert [call for calls in per_delta for call in calls] == list(stream.tool_calls)
    return contents, list(stream.tool_calls), per_delta


def test_stream_decides_as_the_whole_text_parse_for_every_chunking() -> None:
    for text in STREAM_CASES:
        whole = _parse(text)
        for sizes in ([1], [2], [3], [5, 1], [7, 2, 11], [len(text) or 1]):
            contents, calls, _ = _stream(text, sizes)
            assert "".join(contents) == (whole.content or ""), (text, sizes)
            assert tuple(calls) == whole.tool_calls, (text, sizes)


def test_stream_emits_prose_at_once_and_holds_only_a_possible_tag() -> None:
    stream = ToolCallStream(id_factory=_sequential_ids())
    assert stream.push("Hello there <tool") == ToolCallDelta(content="Hello there", tool_calls=())
    assert stream.push("ing it>") == ToolCallDelta(content=" <tooling it>", tool_calls=())
    assert stream.push(' <tool_call>{"name": "f", "arguments": {"a": 1}') == ToolCallDelta(content="", tool_calls=())
    delta = stream.push("}</tool_call> after")
    # The space before the block was held as trailing whitespace; prose after the block brings it out.
    assert delta == ToolCallDelta(content="  after", tool_calls=(ToolCall("call_0", "f", '{"a": 1}'),))
    assert stream.push("  ") == ToolCallDelta(content="", tool_calls=())  # trailing space waits
    assert stream.finish() == ToolCallDelta(content="", tool_calls=())  # and is stripped at the end


def test_stream_gives_each_call_in_the_piece_where_its_block_closes() -> None:
    text = '<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b"}</tool_call>'
    _, calls, per_delta = _stream(text, [len('<tool_call>{"name": "a"}</tool_call>'), 5])
    assert [call.name for call in calls] == ["a", "b"]
    assert [call.name for call in per_delta[0]] == ["a"] and all(not calls for calls in per_delta[1:-2])


def test_stream_unclosed_block_is_prose_at_finish() -> None:
    stream = ToolCallStream(id_factory=_sequential_ids())
    assert stream.push('x <tool_call>{"name": "a"}') == ToolCallDelta(content="x", tool_calls=())
    assert stream.finish() == ToolCallDelta(content=' <tool_call>{"name": "a"}', tool_calls=())
