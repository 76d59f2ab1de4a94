"""Which guide a call gets: forced tool calls become a grammar of the model's call format, JSON formats a JSON
guide; schemas that cannot compile are 400s naming the field; forced arguments keep to declared properties."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from rayturn.api.anthropic_request import parse_messages_request
from rayturn.api.chat_request import parse_chat_request
from rayturn.api.errors import APIError
from rayturn.api.guides import GuideMaker
from rayturn.api.responses_request import parse_responses_request
from rayturn.api.structured_outputs import closed_schema
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


def refusal(maker: GuideMaker, request: Any) -> APIError:
    with pytest.raises(APIError) as caught:
        maker.guide(request)
    assert caught.value.status_code == 400
    return caught.value


def test_a_schema_that_does_not_compile_is_a_400(tokenizer: Tokenizer) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "no-such-type"}}}
    error = refusal(GuideMaker("hermes", tokenizer), chat(response_format=bad))
    assert error.param == "response_format"
    assert error.message == "Invalid 'response_format.json_schema.schema': Invalid type: no-such-type"


def test_a_schema_error_names_the_field_of_the_api_that_sent_it(tokenizer: Tokenizer) -> None:
    maker = GuideMaker("hermes", tokenizer)
    bad = {"type": "banana"}
    form = {"type": "json_schema", "name": "x", "schema": bad}
    responses = parse_responses_request({"model": MODEL, "input": "hi", "text": {"format": form}}, MODEL).chat()
    error = refusal(maker, responses)
    assert error.param == "text.format.schema"
    assert error.message == "Invalid 'text.format.schema': Invalid type: banana"
    config = {"format": {"type": "json_schema", "schema": bad}}
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "output_config": config}
    error = refusal(maker, parse_messages_request(body, MODEL).chat)
    assert error.param == "output_config.format.schema"
    assert error.message == "Invalid 'output_config.format.schema': Invalid type: banana"


@pytest.mark.parametrize("parser", ["hermes", "mistral", "harmony"])
def test_a_forced_call_of_a_tool_with_a_bad_schema_names_the_tool_not_the_grammar(
    tokenizer: Tokenizer, parser: str
) -> None:
    bad_tool = {"type": "function", "function": {"name": "bad_tool", "parameters": {"type": "banana"}}}
    error = refusal(GuideMaker(parser, tokenizer), chat(tools=[TOOL, bad_tool], tool_choice="required"))
    assert error.param == "tools"
    assert (
        error.message
        == "Cannot force a call of tool 'bad_tool': its parameters schema is invalid: Invalid type: banana"
    )
    anthropic_tool = {"name": "bad_tool", "input_schema": {"type": "banana"}}
    body = {
        "model": MODEL,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [anthropic_tool],
        "tool_choice": {"type": "any"},
    }
    error = refusal(GuideMaker(parser, tokenizer), parse_messages_request(body, MODEL).chat)
    assert "'bad_tool'" in error.message and "%json" not in error.message and "\n" not in error.message


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
