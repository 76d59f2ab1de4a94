"""Reasoning split off answers that think in ``<think>...</think>`` (``--reasoning-parser qwen3`` / ``deepseek_r1``):
recorded answers as vLLM's parsers read them (whitespace around each part stripped, as rayturn strips it), calls
found only after the reasoning, and a streamed answer split as the whole one however it is cut."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from rayturn.engine import Guide, SamplingParams
from rayturn.engine.reasoning import REASONING_PARSERS, answer_reasoning, reasoning_params
from rayturn.engine.settings import ModelSettings
from rayturn.engine.thinking import ThinkingBudget
from rayturn.engine.tool_calls import ParsedToolCalls, ToolCallStream, parse_tool_calls
from rayturn.settings import FieldError

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
HERMES_CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
CODER_CALL = "<tool_call>\n<function=weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
OSLO = [("weather", {"city": "Oslo"})]

# (reasoning parser, tool-call parser, answer) -> (reasoning, content, calls)
Expected = tuple[str | None, str | None, list[tuple[str, dict[str, Any]]]]
RECORDED: list[tuple[str, str, str, Expected]] = [
    # The model opens its reasoning itself.
    ("qwen3", "hermes", "<think>\nThe user greets me.\n</think>\n\nHello!", ("The user greets me.", "Hello!", [])),
    # The template opened it (QwQ, Qwen3 thinking models, DeepSeek-R1-0528): only the end is written.
    ("qwen3", "hermes", "The user greets me.\n</think>\n\nHello!", ("The user greets me.", "Hello!", [])),
    ("deepseek_r1", "hermes", "The user greets me.\n</think>\n\nHello!", ("The user greets me.", "Hello!", [])),
    ("deepseek_r1", "hermes", "<think>\nPlan.\n</think>\n\nDone.", ("Plan.", "Done.", [])),
    # Never ended (cut by max_tokens): all reasoning.
    ("qwen3", "hermes", "<think>\nStill weighing it", ("Still weighing it", None, [])),
    ("deepseek_r1", "hermes", "Still weighing it", ("Still weighing it", None, [])),
    # Ended with nothing after it.
    ("deepseek_r1", "hermes", "<think>\nPlan.\n</think>\n\n", ("Plan.", None, [])),
    # An empty reasoning (Qwen3 told not to think writes an empty one when the template did not).
    ("qwen3", "hermes", "<think>\n\n</think>\n\nHi.", (None, "Hi.", [])),
    # A call after the reasoning is a call; the same text inside the reasoning is reasoning.
    (
        "qwen3",
        "hermes",
        f"<think>\nAsk for the weather.\n</think>\n\n{HERMES_CALL}",
        ("Ask for the weather.", None, OSLO),
    ),
    (
        "deepseek_r1",
        "hermes",
        f"<think>\nI could write {HERMES_CALL} here.\n</think>\nNo.",
        (
            f"I could write {HERMES_CALL} here.",
            "No.",
            [],
        ),
    ),
    ("qwen3", "qwen3_coder", f"<think>\nLook it up.\n</think>\n\n{CODER_CALL}", ("Look it up.", None, OSLO)),
    # Qwen3: a call ends the reasoning even without </think> (vLLM's implicit end).
    ("qwen3", "hermes", f"<think>\nLook it up.\n{HERMES_CALL}", ("Look it up.", None, OSLO)),
    ("qwen3", "qwen3_coder", f"Look it up.\n{CODER_CALL}", ("Look it up.", None, OSLO)),
    # DeepSeek-R1 has no such end: the call stays in the unfinished reasoning.
    ("deepseek_r1", "hermes", f"Look it up.\n{HERMES_CALL}", (f"Look it up.\n{HERMES_CALL}", None, [])),
    # Prose and a call after the reasoning, and a second </think> left to the answer.
    ("qwen3", "hermes", f"<think>a</think>Sure. {HERMES_CALL}", ("a", "Sure.", OSLO)),
    ("deepseek_r1", "hermes", "<think>a</think>b</think>c", ("a", "b</think>c", [])),
    # Qwen3 drops every <think> inside the reasoning, DeepSeek-R1 only the first.
    ("qwen3", "hermes", "<think>x <think>y</think>z", ("x y", "z", [])),
    ("deepseek_r1", "hermes", "<think>x <think>y</think>z", ("x <think>y", "z", [])),
]


def _ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _parse(text: str, reasoning: str, parser: str) -> ParsedToolCalls:
    return parse_tool_calls(text, parser=parser, tools=[WEATHER], id_factory=_ids(), reasoning=reasoning)


def _stream(text: str, reasoning: str, parser: str, cuts: Sequence[int]) -> ParsedToolCalls:
    stream = ToolCallStream(parser, [WEATHER], id_factory=_ids(), reasoning=reasoning)
    bounds = [0, *cuts, len(text)]
    deltas = [stream.push(text[start:end]) for start, end in itertools.pairwise(bounds)]
    deltas.append(stream.finish())
    content = "".join(delta.content for delta in deltas)
    thought = "".join(delta.reasoning for delta in deltas)
    calls = tuple(call for delta in deltas for call in delta.tool_calls)
    return ParsedToolCalls(content=content or None, tool_calls=calls, reasoning=thought or None)


def _calls(parsed: ParsedToolCalls) -> list[tuple[str, dict[str, Any]]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]


IDS = [f"{reasoning}-{parser}-{i}" for i, (reasoning, parser, _, _) in enumerate(RECORDED)]


@pytest.mark.parametrize(("reasoning", "parser", "text", "expected"), RECORDED, ids=IDS)
def test_recorded_answers_split_as_vllm_reads_them(reasoning: str, parser: str, text: str, expected: Expected) -> None:
    parsed = _parse(text, reasoning, parser)
    assert (parsed.reasoning, parsed.content, _calls(parsed)) == expected


@pytest.mark.parametrize(("reasoning", "parser", "text", "expected"), RECORDED, ids=IDS)
def test_every_cut_streams_to_the_whole_split(reasoning: str, parser: str, text: str, expected: Expected) -> None:
    whole = _parse(text, reasoning, parser)
    cuts: list[list[int]] = [[cut] for cut in range(1, len(text))] + [list(range(1, len(text)))]
    rng = random.Random(len(text))
    cuts += [sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) // 4))) for _ in range(10)]
    for each in cuts:
        assert _stream(text, reasoning, parser, each) == whole, each


FRAGMENTS = ["<think>", "</think>", "<thi", "</th", "<", ">", "\n", "a b", HERMES_CALL, "<tool_call>", "</tool_call>"]


@pytest.mark.parametrize("reasoning", ["qwen3", "deepseek_r1"])
def test_spliced_fragments_stream_to_the_whole_split(reasoning: str) -> None:
    """Near misses (tags cut short, doubled, out of order) split the same however they arrive."""
    rng = random.Random(reasoning)
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 8)))
        whole = _parse(text, reasoning, "hermes")
        joined = (whole.reasoning or "") + (whole.content or "")
        assert "</think>" not in (whole.reasoning or ""), text
        assert len(joined) <= len(text)
        for _ in range(4):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) if len(text) > 1 else []
            assert _stream(text, reasoning, "hermes", cuts) == whole, (text, cuts)


def test_without_a_reasoning_parser_think_tags_are_prose() -> None:
    parsed = parse_tool_calls("<think>a</think>b", parser="hermes", tools=[WEATHER])
    assert (parsed.reasoning, parsed.content) == (None, "<think>a</think>b")


@pytest.mark.parametrize(
    ("parser", "kwargs", "expected"),
    [
        (None, None, None),
        ("qwen3", None, "qwen3"),
        ("qwen3", {"enable_thinking": True}, "qwen3"),
        ("qwen3", {"enable_thinking": False}, None),  # the template closed the reasoning: all content
        ("deepseek_r1", {"enable_thinking": False}, "deepseek_r1"),  # R1 always thinks, as vLLM reads it
    ],
)
def test_which_answers_are_split(parser: str | None, kwargs: dict[str, Any] | None, expected: str | None) -> None:
    assert answer_reasoning(parser, kwargs) == expected


def test_a_guide_waits_for_the_end_of_the_reasoning_and_a_budget_ends_it() -> None:
    guided = SamplingParams(guide=Guide.json_object())
    assert reasoning_params(guided, "qwen3").guide == Guide("json_object", after="</think>")
    assert reasoning_params(guided, None, 5) is guided  # no reasoning: the guide holds from the first token
    free = SamplingParams()
    assert reasoning_params(free, "deepseek_r1") is free
    bounded = reasoning_params(free, "deepseek_r1", 0)
    assert bounded.thinking_budget == ThinkingBudget(0, "</think>") and bounded.guide is None


def test_the_parsers_are_named_as_vllm_names_them() -> None:
    assert list(REASONING_PARSERS) == ["qwen3", "deepseek_r1"]
    assert ModelSettings(reasoning_parser="qwen3").reasoning_parser == "qwen3"
    with pytest.raises(FieldError, match=r"reasoning_parser must be one of qwen3, deepseek_r1, got 'granite'"):
        ModelSettings(reasoning_parser="granite")
