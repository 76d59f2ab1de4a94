"""vLLM's sampling extensions on the Responses API (``top_k``, ``seed``, ``stop``, ``repetition_penalty``,
``logit_bias``, ``ignore_eos``, ``skip_special_tokens``, ``include_stop_str_in_output``, as vLLM's Responses API
takes them, and the rest the chat API reads): through the ingress's real Responses and chat paths, the same
fields make the same engine ``SamplingParams`` as the chat API's for the same conversation; bad values, ``n``
other than 1 and vLLM's fields this server cannot honour are 400s naming the field, which the published schema
refuses too."""

from __future__ import annotations

from typing import Any

import pytest
from ingress_recorder import RecordingPipeline, assert_refused, request_schema, send_http

from rayturn.api.openapi import openapi_document

DOCUMENT = openapi_document("tiny", vocab_size=263, max_model_len=4096)

SAMPLING: list[dict[str, Any]] = [
    {"top_k": 5},
    {"seed": 1234, "temperature": 0.7},
    {"stop": ["\n\n", "END"]},
    {"stop": "END", "include_stop_str_in_output": True},
    {"repetition_penalty": 1.3},
    {"logit_bias": {"72": 2.5, "10": -100}},
    {"ignore_eos": True},
    {"skip_special_tokens": False},
    {"frequency_penalty": 0.5, "presence_penalty": -0.25},
    {"min_p": 0.1, "min_tokens": 1},
    {"allowed_token_ids": [72, 105], "bad_words": ["no"], "stop_token_ids": [10]},
    {"n": 1},
]


@pytest.mark.parametrize("fields", SAMPLING, ids=[",".join(fields) for fields in SAMPLING])
def test_the_fields_make_the_chat_api_s_engine_parameters(fields: dict[str, Any]) -> None:
    pipeline = RecordingPipeline()
    status, body, responses_call = send_http(pipeline, "responses", fields)
    assert status == 200 and responses_call is not None, body
    status, body, chat_call = send_http(pipeline, "chat", fields)
    assert status == 200 and chat_call is not None, body
    assert responses_call.prompt_token_ids == chat_call.prompt_token_ids
    assert responses_call.params == chat_call.params
    if fields != {"n": 1}:  # the default; any other field changes what the engine is asked
        unset = send_http(pipeline, "responses", {})[2]
        assert unset is not None and unset.params != responses_call.params
    assert request_schema(DOCUMENT, "responses").is_valid({"input": "hi", "max_output_tokens": 2, **fields})


@pytest.mark.parametrize(
    ("extra", "param", "said"),
    [
        ({"top_k": -2}, "top_k", "top_k"),
        ({"seed": "7"}, "seed", "an integer"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty"),
        ({"logit_bias": {"abc": 1}}, "logit_bias", "logit_bias"),
        ({"ignore_eos": "yes"}, "ignore_eos", "a boolean"),
        ({"n": 2}, "n", "one answer"),
        ({"vllm_xargs": {"a": 1}}, "vllm_xargs", "vllm_xargs"),
        ({"kv_transfer_params": {"do_remote_prefill": True}}, "kv_transfer_params", "kv_transfer_params"),
    ],
)
def test_bad_values_are_400s_naming_the_field(extra: dict[str, Any], param: str, said: str) -> None:
    assert_refused(RecordingPipeline(), "responses", extra, param, said, DOCUMENT)


def test_min_tokens_past_max_output_tokens_is_refused_by_a_documented_rule() -> None:
    status, body, call = send_http(RecordingPipeline(), "responses", {"min_tokens": 3})
    assert (status, call) == (400, None) and body["error"]["param"] == "min_tokens", body
    assert "at most max_output_tokens (2), got 3" in body["error"]["message"]
    assert any("'min_tokens'" in rule for rule in DOCUMENT["paths"]["/v1/responses"]["post"]["x-rayturn-rules"])


TOOL = {"type": "function", "name": "ls", "parameters": {"type": "object"}}


@pytest.mark.parametrize(
    ("extra", "param", "said"),
    [
        ({"allowed_token_ids": [72], "text": {"format": {"type": "json_object"}}}, "allowed_token_ids", "text.format"),
        ({"bad_words": ["no"], "structured_outputs": {"regex": "a+"}}, "bad_words", "structured_outputs.regex"),
        ({"bad_words": ["no"], "tools": [TOOL], "tool_choice": "required"}, "bad_words", "tool_choice"),
    ],
)
def test_token_filters_go_with_no_guide_as_in_the_chat_api(extra: dict[str, Any], param: str, said: str) -> None:
    status, body, call = send_http(RecordingPipeline(), "responses", extra)
    assert (status, call) == (400, None), body
    assert body["error"]["param"] == param and f"with '{said}'" in body["error"]["message"], body
    rules = DOCUMENT["paths"]["/v1/responses"]["post"]["x-rayturn-rules"]
    assert any("'allowed_token_ids' and 'bad_words'" in rule and "'text.format'" in rule for rule in rules)
