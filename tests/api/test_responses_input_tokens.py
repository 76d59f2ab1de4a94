"""``POST /v1/responses/input_tokens``: a Responses body's prompt counted as the call would send it (the
conversation ``previous_response_id`` names, item references, instructions, tools, ``truncation``), nothing sent
to the decode pool; the answer is the ``openai`` SDK's ``InputTokenCountResponse``; bad bodies are 400s naming
the field, other tenants' responses are not found, and the published schema agrees with the parser."""

from __future__ import annotations

import asyncio
from typing import Any

import jsonschema
import pytest
from openai.types.responses.input_token_count_response import InputTokenCountResponse
from test_background_responses import BOB, ScriptedDecode, body_of, request, serving
from test_responses_items import answered

from rayturn.api.openapi import openapi_document
from rayturn.api.responses_request import INPUT_TOKEN_FIELDS, parse_input_tokens_request
from rayturn.api.serving_responses import ServingResponses

MODEL = "tiny"
TOOL = {"type": "function", "name": "ls", "description": "List a folder.", "parameters": {"type": "object"}}
DOCUMENT = openapi_document(MODEL, 256)
SCHEMA = DOCUMENT["paths"]["/v1/responses/input_tokens"]["post"]["requestBody"]["content"]["application/json"]
COUNT_SCHEMA = jsonschema.Draft202012Validator(SCHEMA["schema"])


def counted(api: ServingResponses, body: dict[str, Any], key: str = "alice-key") -> Any:
    return asyncio.run(api.input_tokens(request("POST", body, key=key), "r"))


def count_of(api: ServingResponses, body: dict[str, Any]) -> int:
    response = counted(api, body)
    assert response.status_code == 200, body_of(response)
    answer = InputTokenCountResponse.model_validate(body_of(response))
    assert answer.object == "response.input_tokens"
    return answer.input_tokens


def sent_prompt(api: ServingResponses, decode: ScriptedDecode, body: dict[str, Any]) -> tuple[Any, int]:
    """The response to ``body`` and how many prompt tokens its call sent."""
    answer = body_of(answered(api, decode, body))
    return answer, len(decode.streams[-1].call.prompt_token_ids)


def test_the_count_is_the_prompt_the_call_sends() -> None:
    api, decode = serving()
    first_body = {"model": MODEL, "input": "List the files.", "instructions": "Be terse.", "tools": [TOOL]}
    assert count_of(api, first_body) == sent_prompt(api, decode, first_body)[1]
    assert len(decode.streams) == 1  # counting sent nothing
    first, _ = sent_prompt(api, decode, first_body)
    call_turn = [
        {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "a.py b.py"},
    ]
    second_body = {"model": MODEL, "input": call_turn, "previous_response_id": first["id"], "tools": [TOOL]}
    continued = count_of(api, second_body)
    assert continued == sent_prompt(api, decode, second_body)[1] > count_of(api, first_body)
    # Item references count as the items they name; the fields that make no prompt are left out.
    question_id = body_of(asyncio.run(api.input_items(request("GET", query="order=asc"), first["id"], "r")))
    reference = {"type": "item_reference", "id": question_id["data"][0]["id"]}
    by_reference = {"model": MODEL, "input": [reference], "instructions": "Be terse.", "tools": [TOOL]}
    extras = {"max_output_tokens": 0, "store": "maybe", "stream": True, "background": True, "temperature": 9}
    assert count_of(api, by_reference | extras) == count_of(api, first_body)
    assert len(decode.streams) == 3  # the three calls above: counting sent none


def test_truncation_auto_counts_the_turns_that_fit() -> None:
    api, decode = serving()
    long_turns = [{"role": "user", "content": f"Turn {i}: " + "word " * 150} for i in range(12)]
    whole = count_of(api, {"model": MODEL, "input": long_turns})
    cut = count_of(api, {"model": MODEL, "input": long_turns, "truncation": "auto"})
    assert cut < whole and cut <= api.pipeline.max_model_len
    assert cut == sent_prompt(api, decode, {"model": MODEL, "input": long_turns, "truncation": "auto"})[1]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": MODEL}, 400, "input"),
        ({"model": MODEL, "input": []}, 400, "input"),
        ({"model": MODEL, "input": "hi", "tool_choice": "required"}, 400, "tool_choice"),
        ({"model": MODEL, "input": "hi", "truncation": "sometimes"}, 400, "truncation"),
        ({"model": MODEL, "input": "hi", "conversation": "conv_1"}, 400, "conversation"),
        ({"model": MODEL, "input": [{"type": "item_reference", "id": "msg_nope"}]}, 400, "input[0].id"),
        ({"model": MODEL, "input": "hi", "previous_response_id": "resp_nope"}, 400, "previous_response_id"),
        ({"model": "gpt-9", "input": "hi"}, 404, "model"),
    ],
)
def test_bad_bodies_are_refused_naming_the_field(body: dict[str, Any], status: int, param: str) -> None:
    api, decode = serving()
    refused = counted(api, body)
    assert (refused.status_code, body_of(refused)["error"]["param"]) == (status, param)
    assert not decode.streams
    if status == 400 and "_nope" not in str(body):  # unknown ids are state, not shape: the schema cannot see them
        assert not COUNT_SCHEMA.is_valid(body)


def test_a_key_is_needed_and_another_tenant_s_response_is_not_found() -> None:
    api, decode = serving()
    first, _ = sent_prompt(api, decode, {"model": MODEL, "input": "Hi."})
    assert counted(api, {"model": MODEL, "input": "Hi."}, key="wrong").status_code == 401
    stranger = counted(api, {"model": MODEL, "input": "And?", "previous_response_id": first["id"]}, key=BOB)
    assert (stranger.status_code, body_of(stranger)["error"]["code"]) == (400, "previous_response_not_found")
    assert count_of(api, {"model": MODEL, "input": "And?", "previous_response_id": first["id"]}) > 0


def test_the_schema_lists_the_counted_fields_and_the_parser_takes_what_it_accepts() -> None:
    properties = set(SCHEMA["schema"]["properties"])
    assert properties == set(INPUT_TOKEN_FIELDS) - {"conversation"}  # conversations are refused
    good = {
        "model": "",
        "input": [{"role": "user", "content": "hi"}],
        "instructions": "Be terse.",
        "tools": [TOOL],
        "tool_choice": {"type": "function", "name": "ls"},
        "parallel_tool_calls": False,
        "reasoning": {"effort": "low"},
        "text": {"format": {"type": "text"}},
        "truncation": "auto",
        "chat_template_kwargs": {"enable_thinking": False},
    }
    COUNT_SCHEMA.validate(good)
    parsed = parse_input_tokens_request(good, MODEL)
    assert parsed.chat(()).messages[-1]["content"] == "hi"
    assert not COUNT_SCHEMA.is_valid(good | {"max_output_tokens": 4})  # not a field of this route
