"""Which guide a call gets: forced tool calls become a grammar of the model's call format, JSON formats a JSON
guide; schemas that cannot compile are 400s naming the field; forced arguments keep to declared properties."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from rayturn.api.chat_request import parse_chat_request
from rayturn.api.errors import APIError
from rayturn.api.guides import GuideMaker, closed_schema
from rayturn.engine.presets import preset_dir
from rayturn.engine.sampling_params import SamplingParams
from rayturn.engine.tokenizer import Tokenizer

MODEL = "tiny"
TOOL = {
    "type": "function",
    "function": {
        "name": "open_file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(preset_dir("tiny"))


def chat(**fields: Any) -> Any:
    return parse_chat_request({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}, MODEL)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "open_file"}}])
def test_forced_choices_get_a_call_grammar(tokenizer: Tokenizer, choice: Any) -> None:
    maker = GuideMaker("hermes", tokenizer)
    guide = maker.guide(chat(tools=[TOOL], tool_choice=choice))
    assert guide is not None and guide.kind == "lark"
    assert "<tool_call>" in guide.spec and "open_file" in guide.spec
    # The same tools again: the same, already checked grammar.
    assert maker.guide(chat(tools=[TOOL], tool_choice=choice)) is guide


def test_auto_and_none_are_not_guided(tokenizer: Tokenizer) -> None:
    maker = GuideMaker("hermes", tokenizer)
    params = SamplingParams(max_tokens=4)
    for choice in ("auto", "none"):
        assert maker.guided(params, chat(tools=[TOOL], tool_choice=choice)) == params


def test_json_formats(tokenizer: Tokenizer) -> None:
    maker = GuideMaker("hermes", tokenizer)
    json_mode = maker.guide(chat(response_format={"type": "json_object"}))
    assert json_mode is not None and json_mode.kind == "json_object"
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    shaped = maker.guide(chat(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}))
    assert shaped is not None and shaped.kind == "json_schema" and json.loads(shaped.spec) == schema
    # A forced call wins over a response format.
    both = maker.guide(chat(tools=[TOOL], tool_choice="required", response_format={"type": "json_object"}))
    assert both is not None and both.kind == "lark"


def test_a_schema_that_does_not_compile_is_a_400(tokenizer: Tokenizer) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "no-such-type"}}}
    with pytest.raises(APIError) as caught:
        GuideMaker("hermes", tokenizer).guide(chat(response_format=bad))
    assert caught.value.status_code == 400 and caught.value.param == "response_format"


def test_closed_schema_closes_objects_by_keyword_never_by_property_name() -> None:
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "items": {"type": "array", "items": {"type": "object", "properties": {"y": {"type": "string"}}}},
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
        },
        "$defs": {"d": {"type": "object", "properties": {"z": {"type": "string"}}}},
    }
    closed: Any = closed_schema(schema)
    assert closed["additionalProperties"] is False
    inner = closed["properties"]
    assert set(inner) == {"properties", "items", "open"}  # property names untouched
    assert inner["properties"]["additionalProperties"] is False
    assert inner["items"]["items"]["additionalProperties"] is False
    assert inner["open"]["additionalProperties"] is True  # what the schema says stays
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in schema


def test_mistral_keeps_its_special_tags_in_the_text(tokenizer: Tokenizer) -> None:
    params = SamplingParams(max_tokens=4)
    with_tools = chat(tools=[TOOL])
    assert GuideMaker("mistral", tokenizer).guided(params, with_tools) == replace(params, skip_special_tokens=False)
    assert GuideMaker("hermes", tokenizer).guided(params, with_tools) == params
    assert GuideMaker("mistral", tokenizer).guided(params, chat()) == params


def test_harmony_keeps_its_channel_tags_with_or_without_tools(tokenizer: Tokenizer) -> None:
    params = SamplingParams(max_tokens=4)
    kept = replace(params, skip_special_tokens=False)
    maker = GuideMaker("harmony", tokenizer)
    assert maker.guided(params, chat()) == kept
    assert maker.guided(params, chat(tools=[TOOL])) == kept
    forced = maker.guided(params, chat(tools=[TOOL], tool_choice="required"))
    assert forced.guide is not None and forced.skip_special_tokens is False


def test_composed_schemas_stay_open(tokenizer: Tokenizer) -> None:
    """``allOf`` / ``anyOf`` branches add properties to each other: closing any of them would forbid the rest."""
    composed = {
        "type": "object",
        "properties": {"kind": {"type": "string", "enum": ["a"]}},
        "allOf": [
            {"properties": {"a": {"type": "string"}}, "required": ["a"]},
            {"properties": {"b": {"type": "string"}}, "required": ["b"]},
        ],
        "anyOf": [{"properties": {"x": {"type": "integer"}}, "required": ["x"]}],
        "required": ["kind"],
    }
    assert closed_schema(composed) == composed
    tool = {"type": "function", "function": {"name": "composed", "parameters": composed}}
    guide = GuideMaker("hermes", tokenizer).guide(chat(tools=[tool], tool_choice="required"))
    assert guide is not None and guide.kind == "lark"
