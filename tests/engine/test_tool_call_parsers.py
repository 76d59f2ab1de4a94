"""Every tool-call format: recorded answers parsed whole and streamed in any chunking, and the forced-call grammars."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable, Sequence
from typing import Any

import llguidance
import pytest

from rayturn.engine.byte_tokenizer import CHATML_TOOLS_TEMPLATE, build_byte_tokenizer
from rayturn.engine.tool_calls import (
    DEFAULT_TOOL_CALL_PARSER,
    TOOL_CALL_PARSERS,
    ParsedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    forced_call_grammar,
    parse_tool_calls,
    parser_for_chat_template,
)

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "hourly": {"type": "boolean"},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
NOW: dict[str, Any] = {"type": "function", "function": {"name": "now"}}
PLOT: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "plot",
        "parameters": {
            "type": "object",
            "properties": {"at": {"$ref": "#/$defs/point"}, "label": {"type": "string"}},
            "required": ["at"],
            "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
        },
    },
}
TOOLS = [WEATHER, NOW, PLOT]

Expected = tuple[str | None, list[tuple[str, dict[str, Any]]]]  # content, then (name, arguments) per call

# (text, expected parse with TOOLS given), per format: realistic answers, good and bad.
RECORDED: dict[str, list[tuple[str, Expected]]] = {
    "hermes": [
        (
            'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            ("Let me look.", [("get_weather", {"city": "Paris"})]),
        ),
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich 🌧", "days": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
            (None, [("get_weather", {"city": "Zürich 🌧", "days": 2}), ("now", {})]),
        ),
        (
            '<tool_call>{"name": "echo", "arguments": {"s": "</tool_call> done"}}</tool_call>',
            (None, [("echo", {"s": "</tool_call> done"})]),
        ),
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call> sorry',
            ('<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call> sorry', []),
        ),
        (
            'Checking <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
            ('Checking <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', []),
        ),
    ],
    "qwen3_coder": [
        (
            "I'll check the forecast.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n"
            "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=hourly>\ntrue\n</parameter>\n"
            "</function>\n</tool_call>",
            ("I'll check the forecast.", [("get_weather", {"city": "San Francisco", "days": 3, "hourly": True})]),
        ),
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\n1984\n</parameter>\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=now>\n</function>\n</tool_call>",
            (None, [("get_weather", {"city": "1984"}), ("now", {})]),
        ),
        (
            '<tool_call>\n<function=plot>\n<parameter=at>\n{"x": 1.5, "note": "</parameter>"}\n</parameter>\n'
            "<parameter=label>\nprint('</tool_call>')  # ✓\n\n</parameter>\n</function>\n</tool_call>",
            (None, [("plot", {"at": {"x": 1.5, "note": "</parameter>"}, "label": "print('</tool_call>')  # ✓\n"})]),
        ),
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\n東京\n</parameter>\n</tool_call> (oops)",
            ("<tool_call>\n<function=get_weather>\n<parameter=city>\n東京\n</parameter>\n</tool_call> (oops)", []),
        ),
        (
            "<tool_call>\n<get_weather city='Paris'/>\n</tool_call>",
            ("<tool_call>\n<get_weather city='Paris'/>\n</tool_call>", []),
        ),
        (
            "Sure <tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
            ("Sure <tool_call>\n<function=get_weather>\n<parameter=city>\nPar", []),
        ),
    ],
    "llama3_json": [
        (
            '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
            (None, [("get_weather", {"city": "Paris", "days": 2})]),
        ),
        (
            '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Köln; {really}"}}; '
            '{"name": "now", "parameters": {}}',
            (None, [("get_weather", {"city": "Köln; {really}"}), ("now", {})]),
        ),
        (
            '\n\n{"name": "now", "parameters": {}}\nThat is all I need.',
            ("That is all I need.", [("now", {})]),
        ),
        (
            'The call would be {"name": "now", "parameters": {}}.',
            ('The call would be {"name": "now", "parameters": {}}.', []),
        ),
        ('{"name": "Ada", "born": 1815}', ('{"name": "Ada", "born": 1815}', [])),
        (
            '{"name": "get_weather", "parameters": {"city": "Pa',
            ('{"name": "get_weather", "parameters": {"city": "Pa', []),
        ),
        (
            '{"name": "now", "parameters": {}}; {"name": 7}',
            ('; {"name": 7}', [("now", {})]),
        ),
    ],
    "mistral": [
        (
            'Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris [FR]"}}, '
            '{"name": "now", "arguments": {}}]',
            ("Let me check.", [("get_weather", {"city": "Paris [FR]"}), ("now", {})]),
        ),
        (
            '[TOOL_CALLS]get_weather[ARGS]{"city": "São Paulo", "days": 1}[TOOL_CALLS]now[ARGS]{}',
            (None, [("get_weather", {"city": "São Paulo", "days": 1}), ("now", {})]),
        ),
        (
            'The [TOOL_CALLS] token starts calls: [TOOL_CALLS] [{"name": 3}]',
            ('The [TOOL_CALLS] token starts calls: [TOOL_CALLS] [{"name": 3}]', []),
        ),
        (
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Par',
            ('[TOOL_CALLS]get_weather[ARGS]{"city": "Par', []),
        ),
    ],
    "harmony": [
        (
            "<|channel|>analysis<|message|>The user wants Paris weather. Use get_weather.<|end|>"
            "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
            '{"city":"Paris"}',
            (None, [("get_weather", {"city": "Paris"})]),
        ),
        (
            "<|channel|>analysis<|message|>Simple greeting.<|end|><|start|>assistant<|channel|>final<|message|>"
            "Hi! How can I help?<|return|>",
            ("Hi! How can I help?", []),
        ),
        (
            "<|channel|>commentary<|message|>Let me check both.<|end|>"
            "<|start|>assistant to=functions.now<|channel|>commentary json<|message|>{}<|call|>"
            '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "東京 🌧"}',
            ("Let me check both.", [("now", {}), ("get_weather", {"city": "東京 🌧"})]),
        ),
        (
            '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Par',
            ('{"city": "Par', []),
        ),
        (
            "<|channel|>analysis<|message|>Thinking about it and getting cut o",
            (None, []),
        ),
    ],
}

# Raw Qwen3-Coder values without the tools: read as JSON where they are JSON.
UNTYPED_QWEN3_CODER = (
    "<tool_call>\n<function=f>\n<parameter=n>\n1984\n</parameter>\n<parameter=xs>\n[1, 2]\n</parameter>\n"
    "<parameter=s>\nhello world\n</parameter>\n</function>\n</tool_call>"
)


def _sequential_ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _parse(text: str, parser: str, tools: Sequence[dict[str, Any]] | None = TOOLS) -> ParsedToolCalls:
    return parse_tool_calls(text, parser=parser, tools=tools, id_factory=_sequential_ids())


def _stream(text: str, parser: str, cuts: Sequence[int], tools: Sequence[dict[str, Any]] | None) -> ParsedToolCalls:
    """``text`` pushed in pieces cut at ``cuts``; the joined deltas as one parse."""
    stream = ToolCallStream(parser, tools, id_factory=_sequential_ids())
    bounds = [0, *cuts, len(text)]
    deltas = [stream.push(text[start:end]) for start, end in itertools.pairwise(bounds)]
    deltas.append(stream.finish())
    calls = tuple(call for delta in deltas for call in delta.tool_calls)
    assert calls == stream.tool_calls
    content = "".join(delta.content for delta in deltas)
    reasoning = "".join(delta.reasoning for delta in deltas)
    return ParsedToolCalls(content=content or None, tool_calls=calls, reasoning=reasoning or None)


def _chunkings(text: str, seed: int) -> list[list[int]]:
    """Cut points: every single cut, every char, and random chunkings."""
    return [[cut] for cut in range(1, len(text))] + [list(range(1, len(text)))] + _random_chunkings(text, seed, 20)


def _random_chunkings(text: str, seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    cuts = range(1, len(text))
    return [sorted(rng.sample(cuts, rng.randint(0, max(0, len(cuts) // 4)))) for _ in range(count)]


def _calls(parsed: ParsedToolCalls) -> list[tuple[str, dict[str, Any]]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]


CASES = [(parser, text, expected) for parser, samples in RECORDED.items() for text, expected in samples]


@pytest.mark.parametrize(("parser", "text", "expected"), CASES, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(CASES)])
def test_recorded_answers_parse_as_expected(parser: str, text: str, expected: Expected) -> None:
    parsed = _parse(text, parser)
    assert (parsed.content, _calls(parsed)) == expected
    assert [call.id for call in parsed.tool_calls] == [f"call_{i}" for i in range(len(parsed.tool_calls))]


@pytest.mark.parametrize(("parser", "text", "expected"), CASES, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(CASES)])
def test_every_chunking_streams_to_the_whole_parse(parser: str, text: str, expected: Expected) -> None:
    for tools in (TOOLS, None):
        whole = _parse(text, parser, tools)
        for cuts in _chunkings(text, seed=len(text)):
            assert _stream(text, parser, cuts, tools) == whole, (parser, cuts)


# Pieces of each format, spliced into the recorded answers to make near misses.
FRAGMENTS = {
    "hermes": ["<tool_call>", "</tool_call>", "<tool_", "{", "}", '"name": ', '"now"', '"arguments"', '"', "\\", "\n"],
    "qwen3_coder": ["<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>", ">"]
    + ["at", "city", "\n", '{"x": 1', "}", '"', "\\", "<"],
    "llama3_json": ["<|python_tag|>", "<|py", "{", "}", '"name": ', '"now"', '"parameters": ', "{}", ";", '"', "\\"],
    "mistral": ["[TOOL_CALLS]", "[TOOL_", "[ARGS]", "[", "]", "{", "}", '"name": ', '"now"', '"arguments": ', "now"],
    "harmony": ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"]
    + ["<|", "|>", "assistant", "analysis", "final", "commentary", " to=functions.now", "{}", "{", "}", " "],
}


@pytest.mark.parametrize("parser", list(FRAGMENTS))
def test_near_misses_stream_to_the_whole_parse(parser: str) -> None:
    rng = random.Random(parser)
    fragments, samples = FRAGMENTS[parser], [text for text, _ in RECORDED[parser]]
    for _ in range(150):
        if rng.random() < 0.5:
            text = "".join(rng.choice(fragments) for _ in range(rng.randint(1, 20)))
        else:
            sample, at = rng.choice(samples), rng.randint(0, 200)
            text = sample[:at] + "".join(rng.choices(fragments, k=rng.randint(0, 3))) + sample[at + rng.randint(0, 5) :]
        for tools in (TOOLS, None):
            whole = _parse(text, parser, tools)
            for cuts in _random_chunkings(text, seed=rng.randint(0, 1 << 30), count=3):
                assert _stream(text, parser, cuts, tools) == whole, (text, cuts)


def test_untyped_qwen3_coder_values_are_read_as_json_where_they_are() -> None:
    parsed = _parse(UNTYPED_QWEN3_CODER, "qwen3_coder", tools=None)
    assert _calls(parsed) == [("f", {"n": 1984, "xs": [1, 2], "s": "hello world"})]
    for cuts in _chunkings(UNTYPED_QWEN3_CODER, seed=1):
        assert _stream(UNTYPED_QWEN3_CODER, "qwen3_coder", cuts, None) == parsed


def test_untyped_qwen3_coder_value_ends_at_the_first_closing_tag() -> None:
    # Without the schema nothing says the value is JSON, so its closing tag is the first one.
    text = RECORDED["qwen3_coder"][2][0]
    assert _parse(text, "qwen3_coder", tools=None) == ParsedToolCalls(content=text, tool_calls=())


def test_prose_streams_out_at_once() -> None:
    expectations = {
        "hermes": ("Hello <tool", "Hello"),
        "qwen3_coder": ("Hello <tool_call>\n<function=f>", "Hello"),
        "llama3_json": ("Hello {", "Hello {"),
        "mistral": ("Hello [TOOL_C", "Hello"),
        "harmony": ("<|channel|>final<|message|>Hello <|e", "Hello"),
    }
    for parser, (text, content) in expectations.items():
        assert ToolCallStream(parser).push(text) == ToolCallDelta(content=content, tool_calls=()), parser
    stream = ToolCallStream("llama3_json", id_factory=_sequential_ids())
    assert stream.push(' {"name": "now", "parameters": {}') == ToolCallDelta(content="", tool_calls=())
    assert stream.push("}") == ToolCallDelta(content="", tool_calls=(ToolCall("call_0", "now", "{}"),))


def test_registry_names_and_default() -> None:
    assert list(TOOL_CALL_PARSERS) == ["hermes", "qwen3_coder", "llama3_json", "mistral", "harmony"]
    assert DEFAULT_TOOL_CALL_PARSER == "hermes"
    text = RECORDED["hermes"][0][0]
    assert ToolCallStream(id_factory=_sequential_ids()).push(text) == ToolCallStream(
        "hermes", id_factory=_sequential_ids()
    ).push(text)
    with pytest.raises(ValueError, match="unknown tool-call parser 'pythonic'; known: harmony, hermes, llama3_json"):
        ToolCallStream("pythonic")


def test_parser_for_chat_template() -> None:
    qwen3_coder = "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}{%- for tool in tools %}"
    llama31 = "<|start_header_id|>ipython<|end_header_id|>{{- '<|python_tag|>' + tool_call.name }}"
    llama32 = "{{- '<|start_header_id|>assistant<|end_header_id|>' }}{%- if tools is not none %}{{- tools }}"
    mistral = "{%- if message.tool_calls %}{{- '[TOOL_CALLS]' }}{%- for tool in tools %}"
    harmony = "{{- '<|start|>assistant to=functions.' + tool_call.name + '<|channel|>commentary json<|message|>' }}"
    assert parser_for_chat_template(qwen3_coder) == "qwen3_coder"
    assert parser_for_chat_template(llama31) == "llama3_json"
    assert parser_for_chat_template(llama32) == "llama3_json"
    assert parser_for_chat_template(mistral) == "mistral"
    assert parser_for_chat_template(harmony) == "harmony"
    assert parser_for_chat_template(CHATML_TOOLS_TEMPLATE) == "hermes"
    assert parser_for_chat_template("<|start_header_id|>user<|end_header_id|>{{ content }}") == "hermes"


# -- forced-call grammars -------------------------------------------------------------------------------------------

# The byte-level tokenizer of the presets: ids 0-255 are the bytes, so any text is its bytes; 258 and 259 stand in
# for a format's tag tokens, 260 and 261 are <tool_call> and </tool_call>.
TAG_TOKENS = {"<tool_call>": 260, "</tool_call>": 261, "[TOOL_CALLS]": 258, "[ARGS]": 259}


@pytest.fixture(scope="module")
def byte_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(build_byte_tokenizer().to_str())


def _token_ids(text: str, tags: Sequence[str]) -> list[int]:
    """``text`` as bytes, each of ``tags`` as its one token."""
    ids: list[int] = []
    position = 0
    while position < len(text):
        tag = next((tag for tag in tags if text.startswith(tag, position)), None)
        if tag is not None:
            ids.append(TAG_TOKENS[tag])
            position += len(tag)
        else:
            ids.extend(text[position].encode())
            position += 1
    return ids


def _accepts(tokenizer: llguidance.LLTokenizer, grammar: str, text: str, tags: Sequence[str] = ()) -> bool:
    matcher = llguidance.LLMatcher(tokenizer, llguidance.grammar_from("lark", grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = _token_ids(text, tags)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def _hermes(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def _qwen3_coder(name: str, parameters: str) -> str:
    return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


def _qwen3_parameter(name: str, value: str) -> str:
    return f"<parameter={name}>\n{value}\n</parameter>\n"


def _llama(name: str, arguments: str) -> str:
    return f'{{"name": "{name}", "parameters": {arguments}}}'


def _mistral(calls: Sequence[tuple[str, str]]) -> str:
    return "[TOOL_CALLS][" + ", ".join(f'{{"name": "{n}", "arguments": {a}}}' for n, a in calls) + "]"


def _harmony(name: str, arguments: str) -> str:
    return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{arguments}"


PARIS = ("get_weather", {"city": "Paris", "days": 3})
ACCEPTED: dict[str, list[tuple[str, list[tuple[str, dict[str, Any]]]]]] = {
    "hermes": [
        (_hermes("get_weather", '{"city": "Paris", "days": 3}'), [PARIS]),
        (_hermes("now", "{}"), [("now", {})]),
        (_hermes("plot", '{"at": {"x": 2}, "label": "a\\"b"}'), [("plot", {"at": {"x": 2}, "label": 'a"b'})]),
    ],
    "qwen3_coder": [
        (
            _qwen3_coder("get_weather", _qwen3_parameter("city", "Paris") + _qwen3_parameter("days", "3")),
            [PARIS],
        ),
        (
            _qwen3_coder(
                "get_weather", _qwen3_parameter("city", "\n42 </tool_call>\n") + _qwen3_parameter("unit", "celsius")
            ),
            [("get_weather", {"city": "\n42 </tool_call>\n", "unit": "celsius"})],
        ),
        (_qwen3_coder("now", ""), [("now", {})]),
        (_qwen3_coder("now", _qwen3_parameter("anything", "[1]")), [("now", {"anything": [1]})]),
        (
            _qwen3_coder("plot", _qwen3_parameter("at", '{"x": 0.5, "y": "</parameter>"}')),
            [("plot", {"at": {"x": 0.5, "y": "</parameter>"}})],
        ),
    ],
    "llama3_json": [
        (_llama("get_weather", '{"city": "Paris", "days": 3}'), [PARIS]),
        (_llama("now", "{}"), [("now", {})]),
    ],
    "mistral": [
        (_mistral([("get_weather", '{"city": "Paris", "days": 3}')]), [PARIS]),
        (_mistral([("now", "{}")]), [("now", {})]),
    ],
    "harmony": [
        (_harmony("get_weather", '{"city": "Paris", "days": 3}'), [PARIS]),
        (_harmony("now", "{}"), [("now", {})]),
    ],
}
PARALLEL = {  # two calls, as each format joins them
    "hermes": _hermes("now", "{}") + "\n" + _hermes("get_weather", '{"city": "Paris"}'),
    "qwen3_coder": _qwen3_coder("now", "") + "\n" + _qwen3_coder("get_weather", _qwen3_parameter("city", "x")),
    "llama3_json": _llama("now", "{}") + "; " + _llama("get_weather", '{"city": "Paris"}'),
    "mistral": _mistral([("now", "{}"), ("get_weather", '{"city": "Paris"}')]),
    # A harmony turn ends at its call's <|call|>: a forced answer is one call, parallel or not.
    "harmony": _harmony("now", "{}") + "<|end|><|start|>assistant" + _harmony("get_weather", '{"city": "Paris"}'),
}
ONE_CALL_PER_ANSWER = ("harmony",)
REJECTED: dict[str, list[str]] = {
    "hermes": [
        _hermes("get_wether", '{"city": "Paris"}'),
        _hermes("get_weather", '{"city": 3}'),
        _hermes("get_weather", '{"days": 3}'),
        _hermes("get_weather", '{"city": "Paris", "country": "FR"}'),
        _hermes("get_weather", '{"city":"Paris"}'),
        _hermes("get_weather", '{"city": "Paris"} '),
        "Sure. " + _hermes("now", "{}"),
    ],
    "qwen3_coder": [
        _qwen3_coder("get_wether", _qwen3_parameter("city", "Paris")),
        _qwen3_coder("get_weather", _qwen3_parameter("days", "3")),
        _qwen3_coder("get_weather", _qwen3_parameter("city", "Paris") + _qwen3_parameter("days", "three")),
        _qwen3_coder("get_weather", _qwen3_parameter("city", "Paris") + _qwen3_parameter("unit", "kelvin")),
        _qwen3_coder("get_weather", _qwen3_parameter("city", "a</parameter>b")),
        _qwen3_coder("plot", _qwen3_parameter("at", '{"y": 1}')),
    ],
    "llama3_json": [
        _llama("get_wether", '{"city": "Paris"}'),
        _llama("get_weather", '{"city": "Paris", "days": 1.5}'),
        "<|python_tag|>" + _llama("now", "{}"),
    ],
    "mistral": [
        _mistral([("get_wether", '{"city": "Paris"}')]),
        _mistral([("get_weather", '{"city": null}')]),
        _mistral([]),
    ],
    "harmony": [
        _harmony("get_wether", '{"city": "Paris"}'),
        _harmony("get_weather", '{"city": "Paris", "days": "3"}'),
        "<|channel|>final<|message|>Paris",
        "<|channel|>commentary<|message|>" + '{"city": "Paris"}',
    ],
}


@pytest.mark.parametrize("parser", list(TOOL_CALL_PARSERS))
def test_forced_call_grammar_accepts_only_valid_calls(byte_tokenizer: llguidance.LLTokenizer, parser: str) -> None:
    for parallel in (False, True):
        grammar = forced_call_grammar(parser, TOOLS, parallel=parallel)
        assert llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("lark", grammar), byte_tokenizer) == ""
        for text, calls in ACCEPTED[parser]:
            assert _accepts(byte_tokenizer, grammar, text), (parser, text)
            parsed = _parse(text, parser)
            assert (parsed.content, _calls(parsed)) == (None, calls), (parser, text)
        for text in REJECTED[parser]:
            assert not _accepts(byte_tokenizer, grammar, text), (parser, text)
        two_calls = PARALLEL[parser]
        many = parallel and parser not in ONE_CALL_PER_ANSWER
        assert _accepts(byte_tokenizer, grammar, two_calls) is many, (parser, parallel)
        if many:
            assert [name for name, _ in _calls(_parse(two_calls, parser))] == ["now", "get_weather"]


def test_forced_call_grammar_writes_known_tags_as_their_tokens(byte_tokenizer: llguidance.LLTokenizer) -> None:
    hermes = forced_call_grammar("hermes", [NOW], parallel=False, token_id=TAG_TOKENS.get)
    text = _hermes("now", "{}")
    assert _accepts(byte_tokenizer, hermes, text, tags=["<tool_call>", "</tool_call>"])
    assert not _accepts(byte_tokenizer, hermes, text)  # spelt out as bytes

    # With an [ARGS] token, Mistral calls take the NAME[ARGS]{json} spelling.
    mistral = forced_call_grammar("mistral", TOOLS, parallel=True, token_id=TAG_TOKENS.get)
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]now[ARGS]{}'
    assert _accepts(byte_tokenizer, mistral, text, tags=["[TOOL_CALLS]", "[ARGS]"])
    assert _calls(_parse(text, "mistral")) == [PARIS, ("now", {})]
    assert not _accepts(
        byte_tokenizer, mistral, text.replace("get_weather", "get_wether"), tags=["[TOOL_CALLS]", "[ARGS]"]
    )


def test_forced_call_grammar_needs_a_function_tool() -> None:
    for parser in TOOL_CALL_PARSERS:
        with pytest.raises(ValueError, match="at least one function tool"):
            forced_call_grammar(parser, [], parallel=True)


def _random_answer(tokenizer: llguidance.LLTokenizer, grammar: str, rng: random.Random) -> str | None:
    """A random string of ``grammar`` (a random allowed token at each step, structural bytes preferred and now
    and then a closing tag tried, so that free text ends), None when the walk runs long; tag tokens come back
    as their tags' text."""
    matcher = llguidance.LLMatcher(tokenizer, llguidance.grammar_from("lark", grammar), log_level=0)
    tags = {token: tag for tag, token in TAG_TOKENS.items()}
    closing = set(b'"}]>\n<0123456789,:') | set(tags)
    pieces: list[bytes] = []
    for _ in range(400):
        if matcher.is_accepting() and (matcher.is_stopped() or rng.random() < 0.3):
            return b"".join(pieces).decode(errors="replace")
        if rng.random() < 0.1:
            closing_tag = list(b"\n</parameter>\n")
            consumed = matcher.try_consume_tokens(closing_tag)
            pieces.append(bytes(closing_tag[:consumed]))
            continue
        mask = matcher.compute_bitmask()
        allowed = [token for token in range(tokenizer.vocab_size) if mask[token // 8] >> (token % 8) & 1]
        allowed = [token for token in allowed if token != tokenizer.eos_token]
        preferred = [token for token in allowed if token in closing]
        token = rng.choice(preferred if preferred and rng.random() < 0.6 else allowed)
        assert matcher.consume_token(token), matcher.get_error()
        pieces.append(tags[token].encode() if token in tags else tokenizer.decode_bytes([token]))
    return None


@pytest.mark.parametrize("parser", list(TOOL_CALL_PARSERS))
def test_random_strings_of_the_grammar_parse_as_valid_calls(
    byte_tokenizer: llguidance.LLTokenizer, parser: str
) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schemas = {tool["function"]["name"]: tool["function"].get("parameters", {"type": "object"}) for tool in TOOLS}
    rng = random.Random(parser)
    for parallel in (False, True):
        grammar = forced_call_grammar(parser, TOOLS, parallel=parallel, token_id=TAG_TOKENS.get)
        answers = [answer for _ in range(25) if (answer := _random_answer(byte_tokenizer, grammar, rng)) is not None]
        assert len(answers) >= 10
        for answer in answers:
            parsed = _parse(answer, parser)
            assert parsed.content is None and parsed.tool_calls, answer
            assert (parallel and parser not in ONE_CALL_PER_ANSWER) or len(parsed.tool_calls) == 1
            for call in parsed.tool_calls:
                jsonschema.validate(json.loads(call.arguments), schemas[call.name])
