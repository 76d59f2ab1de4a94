"""The harmony format of GPT-OSS: channels to prose, calls and reasoning, however the text is cut."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from rayturn.engine.tool_calls import (
    ParsedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    forced_call_grammar,
    parse_tool_calls,
    parser_for_chat_template,
    splits_every_answer,
)

ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather in Paris; call get_weather.<|end|>"
WEATHER_ARGUMENTS = '{"city": "Paris", "unit": "celsius"}'
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

# content, (name, arguments) per call, reasoning
Expected = tuple[str | None, list[tuple[str, dict[str, Any]]], str | None]
WEATHER_REASONING = "The user wants the weather in Paris; call get_weather."

# (answer as the model writes it after the prompt's "<|start|>assistant", expected parse)
ANSWERS: list[tuple[str, Expected]] = [
    (  # reasoning, then the answer
        "<|channel|>analysis<|message|>Just a greeting.<|end|><|start|>assistant<|channel|>final<|message|>Hello!",
        ("Hello!", [], "Just a greeting."),
    ),
    (  # the recipient after the channel, with <|constrain|>json
        ANALYSIS
        + "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        + WEATHER_ARGUMENTS,
        (None, [("get_weather", {"city": "Paris", "unit": "celsius"})], WEATHER_REASONING),
    ),
    (  # the recipient after the role, a bare content type, and the <|call|> kept in the text
        ANALYSIS
        + "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        + WEATHER_ARGUMENTS
        + "<|call|>",
        (None, [("get_weather", {"city": "Paris", "unit": "celsius"})], WEATHER_REASONING),
    ),
    (  # no content type at all, and the first message carries the recipient
        '<|channel|>commentary to=functions.get_weather<|message|>{"city": "Oslo"}',
        (None, [("get_weather", {"city": "Oslo"})], None),
    ),
    (  # a preamble, then several calls
        "<|channel|>commentary<|message|>Checking both cities.<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.get_weather json<|message|>{"city": "Paris"}<|end|>'
        '<|start|>assistant<|channel|>commentary to=functions.get_weather json<|message|>{"city": "Zürich 🌧"}<|end|>'
        "<|start|>assistant to=functions.now<|channel|>commentary json<|message|>{}",
        (
            "Checking both cities.",
            [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Zürich 🌧"}), ("now", {})],
            None,
        ),
    ),
    (  # a preamble and an answer are joined by a blank line; the reasoning between them goes apart
        "<|channel|>commentary<|message|>One moment.<|end|>"
        + ANALYSIS
        + "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>",
        ("One moment.\n\nIt is sunny.", [], WEATHER_REASONING),
    ),
    (  # arguments that are not JSON: not a call, the text is prose
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{city: Paris}",
        ("{city: Paris}", [], None),
    ),
    (  # JSON, but not an object; then JSON with text after it
        "<|channel|>commentary to=functions.now json<|message|>[1, 2]<|call|>"
        "<|start|>assistant<|channel|>commentary to=functions.now json<|message|>{} and more",
        ("[1, 2]\n\n{} and more", [], None),
    ),
    (  # a built-in tool's namespace: a call named by the whole recipient
        '<|channel|>analysis to=browser.search code<|message|>{"query": "weather Paris"}<|call|>',
        (None, [("browser.search", {"query": "weather Paris"})], None),
    ),
    (  # a turn the model wrote for the tool is not its answer
        "<|channel|>commentary to=functions.now json<|message|>{}<|call|><|start|>functions.now to=assistant"
        '<|channel|>commentary<|message|>"12:00"<|end|><|start|>assistant<|channel|>final<|message|>Noon.',
        ("Noon.", [("now", {})], None),
    ),
    (  # a header broken by the next message is dropped; a stray end tag too
        "<|start|>assistant<|channel|>fin<|end|><|start|>assistant<|channel|>final<|message|>Hi.<|end|><|end|>",
        ("Hi.", [], None),
    ),
    (  # text outside any message is prose; a header never finished is dropped
        "Plain words, no channels.<|start|>assistant<|channel|>fin",
        ("Plain words, no channels.", [], None),
    ),
    (  # cut off while reasoning: the reasoning so far, a partial tag and all
        "<|channel|>analysis<|message|>Let me think about <|en",
        (None, [], "Let me think about <|en"),
    ),
    (  # cut off inside a call's arguments: the text is prose
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Pa',
        ('{"city": "Pa', [], None),
    ),
    (  # "<|" in prose that starts no tag
        "<|channel|>final<|message|>Use a <|pipe|> or <|end",
        ("Use a <|pipe|> or <|end", [], None),
    ),
    (  # two reasoning messages are joined by a blank line, as prose messages are
        "<|channel|>analysis<|message|> First thought. <|end|><|start|>assistant<|channel|>analysis<|message|>"
        "Second.<|end|><|start|>assistant<|channel|>final<|message|>Done.",
        ("Done.", [], "First thought. \n\nSecond."),  # whitespace inside is kept, as in prose
    ),
]


def _sequential_ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _parse(text: str, tools: Sequence[dict[str, Any]] | None = None) -> ParsedToolCalls:
    return parse_tool_calls(text, parser="harmony", tools=tools, id_factory=_sequential_ids())


def _calls(parsed: ParsedToolCalls) -> list[tuple[str, dict[str, Any]]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]


def _stream(text: str, cuts: Sequence[int]) -> ParsedToolCalls:
    stream = ToolCallStream("harmony", id_factory=_sequential_ids())
    bounds = [0, *cuts, len(text)]
    deltas = [stream.push(text[start:end]) for start, end in itertools.pairwise(bounds)]
    deltas.append(stream.finish())
    calls = tuple(call for delta in deltas for call in delta.tool_calls)
    content = "".join(delta.content for delta in deltas)
    reasoning = "".join(delta.reasoning for delta in deltas)
    return ParsedToolCalls(content=content or None, tool_calls=calls, reasoning=reasoning or None)


@pytest.mark.parametrize(("text", "expected"), ANSWERS, ids=[str(i) for i in range(len(ANSWERS))])
def test_answers_parse_as_expected(text: str, expected: Expected) -> None:
    parsed = _parse(text)
    assert (parsed.content, _calls(parsed), parsed.reasoning) == expected
    assert [call.id for call in parsed.tool_calls] == [f"call_{i}" for i in range(len(parsed.tool_calls))]
    assert _parse(text, [WEATHER_TOOL]) == parsed  # the tools change nothing in this format


@pytest.mark.parametrize(("text", "expected"), ANSWERS, ids=[str(i) for i in range(len(ANSWERS))])
def test_a_cut_at_every_position_streams_to_the_whole_parse(text: str, expected: Expected) -> None:
    whole = _parse(text)
    for cut in range(1, len(text)):
        assert _stream(text, [cut]) == whole, cut
    assert _stream(text, range(1, len(text))) == whole


def test_prose_and_reasoning_stream_as_they_come_and_reasoning_never_shows_as_content() -> None:
    stream = ToolCallStream("harmony")
    assert stream.push("<|channel|>analysis<|message|>Hmm, the user") == ToolCallDelta("", (), "Hmm, the user")
    assert stream.push(" says hi.<|end|><|start|>assistant<|chan") == ToolCallDelta("", (), " says hi.")
    assert stream.push("nel|>final<|message|>Hel") == ToolCallDelta(content="Hel", tool_calls=())
    assert stream.push("lo <|") == ToolCallDelta(content="lo", tool_calls=())
    assert stream.push("return|>") == ToolCallDelta(content="", tool_calls=())
    assert stream.finish() == ToolCallDelta(content="", tool_calls=())


def test_a_call_waits_for_its_end_or_the_end_of_the_text() -> None:
    stream = ToolCallStream("harmony", id_factory=_sequential_ids())
    assert stream.push("<|channel|>commentary to=functions.now json<|message|>{") == ToolCallDelta("", ())
    assert stream.push("}") == ToolCallDelta("", ())
    assert stream.push("<|call|>") == ToolCallDelta("", (ToolCall("call_0", "now", "{}"),))
    # The engine stops at <|call|> before it reaches the text: the end of the text ends the call.
    stopped = ToolCallStream("harmony", id_factory=_sequential_ids())
    assert (
        stopped.push('<|channel|>commentary to=functions.get_weather json<|message|>{"city": "Rome"}').tool_calls == ()
    )
    assert stopped.finish() == ToolCallDelta("", (ToolCall("call_0", "get_weather", '{"city": "Rome"}'),))


def test_every_gpt_oss_answer_is_split() -> None:
    assert splits_every_answer("harmony")
    assert not any(splits_every_answer(name) for name in ("hermes", "qwen3_coder", "llama3_json", "mistral"))


def test_a_gpt_oss_chat_template_selects_harmony() -> None:
    template = (
        "{%- for message in messages %}{{- '<|start|>' + message.role + '<|message|>' + message.content + '<|end|>' }}"
        "{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
        "{#- tool calls: <|start|>assistant to=functions.NAME<|channel|>commentary json<|message|> #}"
    )
    assert parser_for_chat_template(template) == "harmony"


def test_forced_call_grammar_writes_harmony_tags_as_their_tokens() -> None:
    tokens = {"<|channel|>": 200005, "<|constrain|>": 200003, "<|message|>": 200008}
    grammar = forced_call_grammar("harmony", [WEATHER_TOOL], parallel=True, token_id=tokens.get)
    first_rule = next(line for line in grammar.splitlines() if line.startswith("call_0:"))
    assert first_rule.startswith(
        'call_0: <[200005]> "commentary to=functions.get_weather " <[200003]> "json" <[200008]>'
    )
    assert "start: call\n" in grammar  # one call: the turn ends at its <|call|>
    with pytest.raises(ValueError, match="cannot be written in the harmony"):
        forced_call_grammar("harmony", [{"type": "function", "function": {"name": "two words"}}], parallel=False)
