"""OpenAI API edge: request validation, response shapes (checked with the openai SDK's types), tool-call streaming."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import jsonschema
import pytest
from anthropic.pagination import SyncPage
from anthropic.types import ModelInfo
from openai.types import Completion, CompletionUsage, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from rayturn.api.bodies import (
    MIN_LOGPROB,
    TokenNames,
    assistant_output,
    chat_choice,
    chat_chunk,
    chat_completion,
    chat_completion_id,
    chat_logprobs,
    chat_usage_chunk,
    completion,
    completion_choice,
    completion_chunk,
    completion_id,
    completion_logprobs,
    completion_usage_chunk,
    model_card,
    models_list,
    usage,
    vllm_prompt_logprobs,
)
from rayturn.api.chat_request import parse_chat_request
from rayturn.api.completion_request import CompletionRequest, parse_completion_request
from rayturn.api.errors import (
    APIError,
    authentication_failed,
    context_length_exceeded,
    invalid_request,
    model_not_found,
    rate_limited,
    server_error,
)
from rayturn.api.openapi import chat_request_schema
from rayturn.api.protocol import ChatRequest, SamplingSpec, to_sampling_params
from rayturn.api.serving_completion import MAX_PROMPT_SCORES, _check_score_size
from rayturn.api.streaming import SSE_DONE, ChatStreamState, sse
from rayturn.engine.sampling_params import SamplingParams
from rayturn.engine.sequence import TokenLogprob
from rayturn.engine.tool_calls import ParsedToolCalls, ToolCall

MODEL = "qwen-test"
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME_TOOL: dict[str, Any] = {"type": "function", "function": {"name": "get_time"}}


def _chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


def _completion_body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Once upon a time", **fields}


def _chat_error(body: object) -> APIError:
    with pytest.raises(APIError) as caught:
        parse_chat_request(body, MODEL)
    return caught.value


def _completion_error(body: object) -> APIError:
    with pytest.raises(APIError) as caught:
        parse_completion_request(body, MODEL)
    return caught.value


def _sequential_ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


# ---------------------------------------------------------------- errors


def test_error_body_is_openai_shape() -> None:
    error = invalid_request("Invalid 'n': bad.", param="n")
    assert error.status_code == 400
    assert error.to_dict() == {
        "error": {"message": "Invalid 'n': bad.", "type": "invalid_request_error", "param": "n", "code": None}
    }


@pytest.mark.parametrize(
    ("error", "status_code", "error_type", "code"),
    [
        (authentication_failed(), 401, "authentication_error", "invalid_api_key"),
        (model_not_found("gpt-4o", MODEL), 404, "not_found_error", "model_not_found"),
        (
            context_length_exceeded(9000, 8192, param="messages"),
            400,
            "invalid_request_error",
            "context_length_exceeded",
        ),
        (rate_limited("slow down"), 429, "rate_limit_error", "rate_limit_exceeded"),
        (server_error("engine died"), 500, "server_error", None),
    ],
)
def test_error_helpers(error: APIError, status_code: int, error_type: str, code: str | None) -> None:
    assert (error.status_code, error.type, error.code) == (status_code, error_type, code)
    assert set(error.to_dict()["error"]) == {"message", "type", "param", "code"}


def test_unknown_model_is_404_naming_both_models() -> None:
    error = _chat_error(_chat_body(model="gpt-4o"))
    assert (error.status_code, error.param) == (404, "model")
    assert "gpt-4o" in error.message and MODEL in error.message


def test_body_must_be_an_object() -> None:
    error = _chat_error([{"role": "user", "content": "hi"}])
    assert (error.status_code, error.param) == (400, None)
    assert "JSON object" in error.message


# ---------------------------------------------------------------- chat validation


def _with_messages(*messages: Any) -> dict[str, Any]:
    return _chat_body(messages=list(messages))


_ASSISTANT_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}

CHAT_400_CASES = [
    ({"model": 3}, "model"),
    ({"messages": None}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    (_with_messages("hi"), "messages[0]"),
    (_with_messages({"content": "hi"}), "messages[0].role"),
    (_with_messages({"role": "robot", "content": "hi"}), "messages[0].role"),
    (_with_messages({"role": "user"}), "messages[0].content"),
    (_with_messages({"role": "user", "content": 7}), "messages[0].content"),
    (_with_messages({"role": "user", "content": [{"type": "text"}]}), "messages[0].content[0].text"),
    (
        _with_messages(
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {}}]},
        ),
        "messages[1].content[1].type",
    ),
    (_with_messages({"role": "user", "content": "hi", "name": 5}), "messages[0].name"),
    (_with_messages({"role": "assistant"}), "messages[0].content"),
    (
        _with_messages({"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}),
        "messages[0].tool_calls[0].function",
    ),
    (
        _with_messages({"role": "assistant", "tool_calls": [{**_ASSISTANT_CALL, "id": None}]}),
        "messages[0].tool_calls[0].id",
    ),
    (
        _with_messages(
            {"role": "assistant", "tool_calls": [{**_ASSISTANT_CALL, "function": {"name": "f", "arguments": {}}}]}
        ),
        "messages[0].tool_calls[0].function.arguments",
    ),
    (
        _with_messages({"role": "assistant", "tool_calls": [_ASSISTANT_CALL]}, {"role": "tool", "content": "sunny"}),
        "messages[1].tool_call_id",
    ),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"n": 1.5}, "n"),
    ({"n": True}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_completion_tokens": "10"}, "max_completion_tokens"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": 3}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", 1]}, "stop[1]"),
    ({"stop_token_ids": [5, -1]}, "stop_token_ids[1]"),
    ({"stop_token_ids": list(range(257))}, "stop_token_ids"),
    ({"seed": "42"}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"user": 1}, "user"),
    ({"stream": "true"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"stream": True, "stream_options": []}, "stream_options"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"frequency_penalty": "0.5"}, "frequency_penalty"),
    ({"logit_bias": [10]}, "logit_bias"),
    ({"logit_bias": {"42": 101}}, "logit_bias.42"),
    ({"logit_bias": {"42": "10"}}, "logit_bias.42"),
    ({"logit_bias": {"-1": 5}}, "logit_bias"),
    ({"logit_bias": {"token": 5}}, "logit_bias"),
    ({"logit_bias": {"7": 1, "07": 2}}, "logit_bias"),
    ({"logit_bias": {"9" * 19: 1}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tools": []}, "tools"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [WEATHER_TOOL, {"type": "function", "function": {"name": "get time"}}]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 1}}]}, "tools[0].function.description"),
    ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools[1].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER_TOOL], "tool_choice": 1}, "tool_choice"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "custom"}}, "tool_choice.type"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function"}}, "tool_choice.function"),
    (
        {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
        "tool_choice.function.name",
    ),
]


@pytest.mark.parametrize(("fields", "param"), CHAT_400_CASES, ids=[param for _, param in CHAT_400_CASES])
def test_chat_validation_names_the_field(fields: dict[str, Any], param: str) -> None:
    error = _chat_error(_chat_body(**fields))
    assert (error.status_code, error.type, error.param) == (400, "invalid_request_error", param)
    assert f"'{param}'" in error.message


def test_tool_choice_naming_an_undeclared_tool_says_which() -> None:
    body = _chat_body(tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert "'get_time'" in _chat_error(body).message


def test_unsupported_features_say_so() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    error = _chat_error(_with_messages({"role": "user", "content": [image]}))
    assert error.code == "unsupported_value" and "'image_url'" in error.message


def test_continue_final_message_goes_on_from_the_assistant_text() -> None:
    """vLLM's pair: ``continue_final_message`` with ``add_generation_prompt`` false; either alone is refused."""
    prefill = [{"role": "user", "content": "JSON please"}, {"role": "assistant", "content": '{"ok":'}]
    both = {"continue_final_message": True, "add_generation_prompt": False}
    assert parse_chat_request(_chat_body(messages=prefill, **both), MODEL).continue_final_message
    assert not parse_chat_request(_chat_body(messages=prefill), MODEL).continue_final_message
    cases = [
        (_chat_body(messages=prefill, continue_final_message=True), "continue_final_message", "Cannot set both"),
        (_chat_body(messages=prefill, add_generation_prompt=False), "add_generation_prompt", "only with"),
        (_chat_body(**both), "continue_final_message", "must be an assistant message"),
    ]
    for body, param, words in cases:
        error = _chat_error(body)
        assert (error.status_code, error.param) == (400, param) and words in error.message, error.message
    # The OpenAPI document says the same of the pair (the final message's role is one of its listed rules).
    document = jsonschema.Draft202012Validator(chat_request_schema(MODEL, vocab_size=263))
    assert document.is_valid(_chat_body(messages=prefill, **both))
    assert not any(document.is_valid(body) for body, _, words in cases if words != "must be an assistant message")


def test_response_formats_are_taken() -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    request = parse_chat_request(
        _chat_body(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}), MODEL
    )
    assert request.response_format == {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    json_mode = parse_chat_request(_chat_body(response_format={"type": "json_object"}), MODEL)
    assert json_mode.response_format == {"type": "json_object"}
    assert parse_chat_request(_chat_body(response_format={"type": "text"}), MODEL).response_format is None


def test_chat_defaults() -> None:
    request = parse_chat_request(_chat_body(), MODEL)
    assert request == ChatRequest(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        tools=None,
        tool_choice="none",
        sampling=SamplingSpec(),
        stream=False,
        include_usage=False,
        user=None,
        parallel_tool_calls=True,
    )
    assert request.prompt_tools is None


def test_nulls_count_as_absent_and_unknown_fields_are_ignored() -> None:
    body = _chat_body(
        temperature=None,
        top_p=None,
        n=None,
        stop=None,
        seed=None,
        tools=None,
        stream=None,
        metadata={"a": "b"},
        store=True,
    )
    assert parse_chat_request(body, MODEL).sampling == SamplingSpec()


def test_chat_sampling_fields() -> None:
    body = _chat_body(
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        seed=-3,
        stop="END",
        stop_token_ids=[7],
        n=3,
        logprobs=True,
        top_logprobs=5,
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=-1,
        logit_bias={"42": 10, "7": -100, "0": 0.5},
        user="alice",
        response_format={"type": "text"},
    )
    request = parse_chat_request(body, MODEL)
    assert request.sampling == SamplingSpec(
        max_tokens=None,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        seed=-3,
        stop=("END",),
        stop_token_ids=(7,),
        n=3,
        logprobs=True,
        top_logprobs=5,
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=-1.0,
        logit_bias=((0, 0.5), (7, -100.0), (42, 10.0)),
    )
    assert request.user == "alice"
    quiet = _chat_body(presence_penalty=0, frequency_penalty=0.0, logit_bias={})
    assert parse_chat_request(quiet, MODEL).sampling == SamplingSpec()


@pytest.mark.parametrize(
    ("fields", "max_tokens"),
    [
        ({"max_tokens": 10}, 10),
        ({"max_completion_tokens": 20}, 20),
        ({"max_tokens": 10, "max_completion_tokens": 20}, 20),
        ({"max_tokens": 10, "max_completion_tokens": None}, 10),
    ],
)
def test_max_completion_tokens_wins(fields: dict[str, Any], max_tokens: int) -> None:
    assert parse_chat_request(_chat_body(**fields), MODEL).sampling.max_tokens == max_tokens


def test_stream_options() -> None:
    streaming = parse_chat_request(_chat_body(stream=True, stream_options={"include_usage": True}), MODEL)
    assert (streaming.stream, streaming.include_usage) == (True, True)
    assert not parse_chat_request(_chat_body(stream=True), MODEL).include_usage


def test_messages_are_normalized_for_the_chat_template() -> None:
    body = _with_messages(
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "name": "bob", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "not json"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]},
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "easy"},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "assistant", "content": "Rain.", "reasoning": "as this server sends it back"},
    )
    assert parse_chat_request(body, MODEL).messages == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "a\nb", "name": "bob"},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
                {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "not json"}},
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "easy"},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "assistant", "content": "Rain.", "reasoning_content": "as this server sends it back"},
    ]


def test_tools_and_tool_choice() -> None:
    tools = [WEATHER_TOOL, {**TIME_TOOL, "function": {**TIME_TOOL["function"], "strict": True}}]
    auto = parse_chat_request(_chat_body(tools=tools), MODEL)
    assert auto.tool_choice == "auto"
    assert auto.tools == tools and auto.prompt_tools == tools

    named_choice = {"type": "function", "function": {"name": "get_time"}}
    named = parse_chat_request(_chat_body(tools=tools, tool_choice=named_choice), MODEL)
    assert named.tool_choice == named_choice
    assert named.prompt_tools == [tools[1]]

    none = parse_chat_request(_chat_body(tools=tools, tool_choice="none", parallel_tool_calls=False), MODEL)
    assert none.prompt_tools is None and not none.parallel_tool_calls
    assert parse_chat_request(_chat_body(tool_choice="none"), MODEL).tool_choice == "none"


# ---------------------------------------------------------------- completion validation

COMPLETION_400_CASES = [
    ({"prompt": None}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [1, -1]}, "prompt[1]"),
    ({"prompt": [1, "a"]}, "prompt[1]"),
    ({"prompt": ["a", 3]}, "prompt[1]"),
    ({"prompt": ["a", [1, -2]]}, "prompt[1][1]"),
    ({"prompt": [[1], []]}, "prompt[1]"),
    ({"prompt": ["a"] * 257}, "prompt"),
    ({"prompt": [""]}, "prompt[0]"),
    ({"echo": "yes"}, "echo"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"echo": True, "max_tokens": -1}, "max_tokens"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ({"bad_words": [""]}, "bad_words[0]"),
    ({"bad_words": "x"}, "bad_words"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids[1]"),
    ({"length_penalty": 0.5}, "length_penalty"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": "10"}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 1.5}, "truncate_prompt_tokens"),
    ({"truncation_side": "middle"}, "truncation_side"),
    ({"truncation_side": 1}, "truncation_side"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"suffix": "end"}, "suffix"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"best_of": 2}, "best_of"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
]


@pytest.mark.parametrize(("fields", "param"), COMPLETION_400_CASES, ids=[param for _, param in COMPLETION_400_CASES])
def test_completion_validation_names_the_field(fields: dict[str, Any], param: str) -> None:
    error = _completion_error(_completion_body(**fields))
    assert (error.status_code, error.param) == (400, param)
    assert f"'{param}'" in error.message


def test_completion_request() -> None:
    request = parse_completion_request(
        _completion_body(prompt=[[1, 2, 3]], logprobs=2, max_tokens=8, best_of=1, echo=False, stream=True), MODEL
    )
    assert request == CompletionRequest(
        model=MODEL,
        prompts=((1, 2, 3),),
        sampling=SamplingSpec(max_tokens=8, logprobs=True, top_logprobs=2),
        stream=True,
        include_usage=False,
        user=None,
    )
    assert parse_completion_request(_completion_body(prompt=["hello"]), MODEL).prompts == ("hello",)
    assert _completion_error(_completion_body(model="other")).status_code == 404


@pytest.mark.parametrize("body", [{"prompt": "hi"}, {"model": "", "prompt": "hi"}, {"model": None, "prompt": "hi"}])
def test_a_missing_or_empty_model_is_the_served_model(body: dict[str, Any]) -> None:
    assert parse_completion_request(body, MODEL).model == MODEL
    assert parse_chat_request({**body, "messages": [{"role": "user", "content": "hi"}]}, MODEL).model == MODEL


def test_completion_prompt_batches() -> None:
    assert parse_completion_request(_completion_body(prompt=["a", "b"]), MODEL).prompts == ("a", "b")
    mixed = parse_completion_request(_completion_body(prompt=["a", [5, 6], "c"]), MODEL)
    assert mixed.prompts == ("a", (5, 6), "c")
    assert [mixed.param(index) for index in range(3)] == ["prompt[0]", "prompt[1]", "prompt[2]"]
    assert parse_completion_request(_completion_body(prompt=[[1], [2, 3]]), MODEL).prompts == ((1,), (2, 3))


def test_echo_scores_the_prompt_with_the_answers_alternatives() -> None:
    request = parse_completion_request(_completion_body(echo=True, logprobs=3, max_tokens=0), MODEL)
    assert (request.echo, request.generates, request.sampling.prompt_logprobs) == (True, False, 3)
    assert parse_completion_request(_completion_body(echo=True), MODEL).sampling.prompt_logprobs is None


def test_vllm_sampling_extensions_reach_the_engine() -> None:
    body = _completion_body(
        repetition_penalty=1.2,
        min_p=0.05,
        min_tokens=3,
        max_tokens=8,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        use_beam_search=False,
        length_penalty=1.0,
        guided_json=None,
        bad_words=[],
        spaces_between_special_tokens=True,
        prompt_logprobs=2,
    )
    params = _params(parse_completion_request(body, MODEL).sampling)
    assert (params.repetition_penalty, params.min_p, params.min_tokens) == (1.2, 0.05, 3)
    assert (params.include_stop_str_in_output, params.skip_special_tokens, params.prompt_logprobs) == (True, False, 2)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"continue_final_message": True}, "continue_final_message"),
        ({"add_generation_prompt": False}, "add_generation_prompt"),
        ({"echo": True}, "echo"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"repetition_penalty": -1}, "repetition_penalty"),
    ],
)
def test_chat_refuses_what_it_cannot_honour(fields: dict[str, Any], param: str) -> None:
    error = _chat_error(_chat_body(**fields))
    assert (error.status_code, error.param) == (400, param)
    assert f"'{param}'" in error.message


# ---------------------------------------------------------------- sampling params


def _params(spec: SamplingSpec, *, prompt_tokens: int = 100, max_model_len: int = 1000) -> SamplingParams:
    return to_sampling_params(spec, default_max_tokens=512, prompt_tokens=prompt_tokens, max_model_len=max_model_len)


def test_max_tokens_defaults_to_the_room_left_capped() -> None:
    assert _params(SamplingSpec()).max_tokens == 512
    assert _params(SamplingSpec(), prompt_tokens=900).max_tokens == 100
    assert _params(SamplingSpec(max_tokens=900)).max_tokens == 900


def test_max_tokens_beyond_the_context_is_a_400() -> None:
    with pytest.raises(APIError) as caught:
        _params(SamplingSpec(max_tokens=901))
    error = caught.value
    assert (error.status_code, error.param, error.code) == (400, "max_tokens", "context_length_exceeded")
    assert "1000" in error.message and "1001" in error.message and "901" in error.message


@pytest.mark.parametrize("prompt_tokens", [1000, 1200])
def test_prompt_filling_the_context_is_context_length_exceeded(prompt_tokens: int) -> None:
    with pytest.raises(APIError) as caught:
        to_sampling_params(
            SamplingSpec(),
            default_max_tokens=16,
            prompt_tokens=prompt_tokens,
            max_model_len=1000,
            prompt_param="prompt",
        )
    error = caught.value
    assert (error.status_code, error.param, error.code) == (400, "prompt", "context_length_exceeded")
    assert str(prompt_tokens) in error.message and "1000" in error.message


def test_sampling_params_mapping() -> None:
    spec = SamplingSpec(
        max_tokens=10,
        temperature=0.0,
        top_p=0.5,
        top_k=3,
        seed=1,
        stop=("x",),
        stop_token_ids=(2,),
        n=2,
        ignore_eos=True,
    )
    assert _params(spec) == SamplingParams(
        n=2,
        max_tokens=10,
        temperature=0.0,
        top_p=0.5,
        top_k=3,
        seed=1,
        stop=("x",),
        stop_token_ids=(2,),
        ignore_eos=True,
    )
    assert _params(SamplingSpec()).logprobs is None
    assert _params(SamplingSpec(logprobs=True)).logprobs == 0
    assert _params(SamplingSpec(logprobs=True, top_logprobs=5)).logprobs == 5


def test_engine_rejections_become_400s_naming_the_field() -> None:
    with pytest.raises(APIError) as caught:
        _params(SamplingSpec(temperature=-1.0))
    assert (caught.value.status_code, caught.value.param) == (400, "temperature")
    assert "'temperature'" in caught.value.message


# ---------------------------------------------------------------- responses


def _token_bytes(token_id: int) -> bytes:
    return {1: b"Hel", 2: b"lo", 3: " wörld".encode(), 4: b"!", 5: b"\xc3", 6: b"\xa9"}.get(
        token_id, f"<{token_id}>".encode()
    )


NAMES = TokenNames(_token_bytes)


LOGPROBS = (
    TokenLogprob(token_id=1, logprob=-0.1, top=((1, -0.1), (2, -2.5))),
    TokenLogprob(token_id=3, logprob=float("-inf"), top=((4, -0.01), (3, float("-inf")))),
)


def test_usage_shape() -> None:
    body = usage(prompt_tokens=10, completion_tokens=5, cached_tokens=8)
    parsed = CompletionUsage.model_validate(body)
    assert (parsed.total_tokens, parsed.prompt_tokens_details and parsed.prompt_tokens_details.cached_tokens) == (15, 8)


def test_chat_completion_shape_with_logprobs() -> None:
    logprobs = chat_logprobs(LOGPROBS, NAMES)
    body = chat_completion(
        response_id=chat_completion_id(),
        model=MODEL,
        created=1700000000,
        choices=[
            chat_choice(0, content="Hel wörld", finish_reason="stop", logprobs=logprobs),
            chat_choice(1, content="Hel", finish_reason="length"),
        ],
        usage=usage(4, 3),
    )
    parsed = ChatCompletion.model_validate(body)
    assert parsed.id.startswith("chatcmpl-") and parsed.object == "chat.completion"
    assert [choice.finish_reason for choice in parsed.choices] == ["stop", "length"]
    assert parsed.choices[0].message.content == "Hel wörld"
    assert parsed.choices[0].logprobs is not None and parsed.choices[0].logprobs.content is not None
    second = parsed.choices[0].logprobs.content[1]
    assert (second.token, second.bytes, second.logprob) == (" wörld", list(" wörld".encode()), MIN_LOGPROB)
    assert [(top.token, top.logprob) for top in second.top_logprobs] == [("!", -0.01), (" wörld", MIN_LOGPROB)]
    assert parsed.choices[1].logprobs is None
    json.dumps(body, allow_nan=False)


def test_chat_completion_shape_with_tool_calls() -> None:
    request = parse_chat_request(_chat_body(tools=[WEATHER_TOOL]), MODEL)
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    output = assistant_output(text, request, id_factory=_sequential_ids())
    body = chat_completion(
        response_id="chatcmpl-1",
        model=MODEL,
        created=1,
        choices=[chat_choice(0, content=output.content, tool_calls=output.tool_calls, finish_reason="stop")],
        usage=usage(4, 3),
    )
    choice = ChatCompletion.model_validate(body).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    assert choice.message.tool_calls is not None
    call = choice.message.tool_calls[0]
    assert call.type == "function"
    assert (call.id, call.function.name, call.function.arguments) == ("call_0", "get_weather", '{"city": "Paris"}')


def test_a_chat_choice_carries_reasoning_in_vllms_field() -> None:
    body = chat_completion(
        response_id="chatcmpl-1",
        model=MODEL,
        created=1,
        choices=[chat_choice(0, content="Hello!", finish_reason="stop", reasoning="Greet back.")],
        usage=usage(4, 3),
    )
    message = ChatCompletion.model_validate(body).choices[0].message
    assert message.content == "Hello!" and message.model_extra == {"reasoning": "Greet back."}
    plain = chat_choice(0, content="Hello!", finish_reason="stop")
    assert "reasoning" not in plain["message"]


def test_assistant_output_without_tools_keeps_the_text() -> None:
    request = parse_chat_request(_chat_body(tools=[WEATHER_TOOL], tool_choice="none"), MODEL)
    text = ' <tool_call>{"name": "get_weather"}</tool_call> '
    assert assistant_output(text, request).content == text


def test_a_harmony_answer_is_split_with_or_without_tools() -> None:
    text = "<|channel|>analysis<|message|>Greet back.<|end|><|start|>assistant<|channel|>final<|message|>Hello!"
    for body in (_chat_body(), _chat_body(tools=[WEATHER_TOOL], tool_choice="none")):
        request = parse_chat_request(body, MODEL)
        expected = ParsedToolCalls(content="Hello!", tool_calls=(), reasoning="Greet back.")
        assert assistant_output(text, request, parser="harmony") == expected
        state = ChatStreamState.for_request(request, 0, parser="harmony")
        state.start()
        pushed = [state.push(piece) for piece in (text[:40], text[40:])]
        deltas = [choice["delta"] for choice in (*pushed, state.finish("stop")) if choice]
        assert "".join(delta.get("content", "") for delta in deltas) == "Hello!"
        assert "".join(delta.get("reasoning", "") for delta in deltas) == "Greet back."


def test_assistant_output_single_call_when_not_parallel() -> None:
    request = parse_chat_request(_chat_body(tools=[WEATHER_TOOL], parallel_tool_calls=False), MODEL)
    text = '<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b"}</tool_call>'
    assert [call.name for call in assistant_output(text, request).tool_calls] == ["a"]


def test_completion_shape_with_logprobs() -> None:
    body = completion(
        response_id=completion_id(),
        model=MODEL,
        created=1,
        choices=[
            completion_choice(0, text="Hel wörld", finish_reason="abort", logprobs=completion_logprobs(LOGPROBS, NAMES))
        ],
        usage=usage(4, 2, cached_tokens=2),
    )
    parsed = Completion.model_validate(body)
    assert parsed.id.startswith("cmpl-") and parsed.object == "text_completion"
    choice = parsed.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.logprobs is not None
    assert choice.logprobs.tokens == ["Hel", " wörld"]
    assert choice.logprobs.token_logprobs == [-0.1, MIN_LOGPROB]
    assert choice.logprobs.top_logprobs == [{"Hel": -0.1, "lo": -2.5}, {"!": -0.01, " wörld": MIN_LOGPROB}]
    assert choice.logprobs.text_offset == [0, 3]


def test_completion_chunks() -> None:
    common: dict[str, Any] = {"response_id": "cmpl-1", "model": MODEL, "created": 1}
    choice = completion_choice(0, text="Hel", finish_reason=None)
    chunk = completion_chunk(**common, choices=[choice])
    # The API streams finish_reason null until the last chunk; the SDK's Completion type (which its stream
    # reader fills without validating) declares it non-null, so check the rest of the shape with a final one.
    assert choice["finish_reason"] is None
    final = Completion.model_validate({**chunk, "choices": [{**choice, "finish_reason": "length"}]})
    assert final.choices[0].text == "Hel"
    assert completion_chunk(**common, choices=[], include_usage=True)["usage"] is None
    last = Completion.model_validate(completion_usage_chunk(**common, usage=usage(3, 2)))
    assert last.choices == [] and last.usage is not None and last.usage.total_tokens == 5


def test_chat_chunks() -> None:
    common: dict[str, Any] = {"response_id": "chatcmpl-1", "model": MODEL, "created": 1}
    state = ChatStreamState(0, parse_tools=False)
    opening = state.start()
    pushed = state.push("Hi", chat_logprobs(LOGPROBS[:1], NAMES))
    assert pushed is not None
    chunks = [
        chat_chunk(**common, choices=[opening], include_usage=True),
        chat_chunk(**common, choices=[pushed]),
        chat_chunk(**common, choices=[state.finish("length")]),
        chat_usage_chunk(**common, usage=usage(3, 2)),
    ]
    parsed = [ChatCompletionChunk.model_validate(chunk) for chunk in chunks]
    assert chunks[0]["usage"] is None and "usage" not in chunks[1]
    assert parsed[0].choices[0].delta.role == "assistant" and parsed[0].choices[0].delta.content == ""
    assert parsed[1].choices[0].delta.content == "Hi" and parsed[1].choices[0].delta.role is None
    assert parsed[1].choices[0].logprobs is not None
    assert parsed[2].choices[0].finish_reason == "length"
    assert parsed[3].choices == [] and parsed[3].usage is not None and parsed[3].usage.total_tokens == 5


def test_sse_framing() -> None:
    event = sse({"text": "wörld\n"})
    assert event == 'data: {"text":"wörld\\n"}\n\n'
    assert json.loads(event.removeprefix("data: ")) == {"text": "wörld\n"}
    assert SSE_DONE == "data: [DONE]\n\n"


def test_models_list() -> None:
    card = model_card(MODEL, 1700000000, root="/models/qwen", max_model_len=4096)
    body = models_list([card], {})
    assert body["object"] == "list"
    model = Model.model_validate(body["data"][0])
    assert (model.id, model.created, model.object) == (MODEL, 1700000000, "model")
    assert (card["max_model_len"], card["root"]) == (4096, "/models/qwen")


def test_the_model_list_is_anthropic_s_too() -> None:
    """The same bodies read whole as the ``anthropic`` SDK's models page and ``ModelInfo``."""
    card = model_card(MODEL, 1700000000, root="/models/qwen", max_model_len=4096)
    info = ModelInfo.model_validate(card)
    assert (info.id, info.type, info.display_name, info.lifecycle) == (MODEL, "model", MODEL, "active")
    assert info.created_at == datetime(2023, 11, 14, 22, 13, 20, tzinfo=UTC) and info.max_input_tokens == 4096
    assert card["created_at"] == "2023-11-14T22:13:20Z"
    page = SyncPage[ModelInfo].model_validate(models_list([card], {}))
    assert ([m.id for m in page.data], page.first_id, page.last_id, page.has_more) == ([MODEL], MODEL, MODEL, False)


def test_the_model_list_pages_as_anthropic_s_does() -> None:
    cards = [{"id": f"m{n}"} for n in range(5)]

    def listed(**query: str) -> tuple[list[str], Any, Any, bool]:
        body = models_list(cards, query)
        return [card["id"] for card in body["data"]], body["first_id"], body["last_id"], body["has_more"]

    assert listed() == (["m0", "m1", "m2", "m3", "m4"], "m0", "m4", False)
    assert listed(limit="2") == (["m0", "m1"], "m0", "m1", True)
    assert listed(limit="2", after_id="m1") == (["m2", "m3"], "m2", "m3", True)
    assert listed(limit="2", after_id="m2") == (["m3", "m4"], "m3", "m4", False)
    assert listed(after_id="m4") == ([], None, None, False)
    assert listed(limit="2", before_id="m4") == (["m2", "m3"], "m2", "m3", True)
    assert listed(limit="2", before_id="m2") == (["m0", "m1"], "m0", "m1", False)
    assert listed(before_id="m0") == ([], None, None, False)
    assert listed(limit="1000") == listed()
    for query, param in (
        ({"limit": "0"}, "limit"),
        ({"limit": "1001"}, "limit"),
        ({"limit": "ten"}, "limit"),
        ({"after_id": "m9"}, "after_id"),
        ({"before_id": ""}, "before_id"),
        ({"after_id": "m1", "before_id": "m3"}, "before_id"),
    ):
        with pytest.raises(APIError) as refused:
            models_list(cards, query)
        assert (refused.value.status_code, refused.value.param) == (400, param), query
        assert f"'{param}'" in refused.value.message


def test_logprob_tokens_are_their_raw_bytes_and_never_collide() -> None:
    """Two tokens that each hold half of 'é' read as U+FFFD when decoded alone; OpenAI names them by bytes."""
    halves = (TokenLogprob(token_id=5, logprob=-0.5, top=((5, -0.5), (6, -0.9), (1, -3.0))),)
    chat = chat_logprobs(halves, NAMES)[0]
    assert (chat["token"], chat["bytes"]) == ("bytes:\\xc3", [0xC3])
    assert [(top["token"], top["bytes"]) for top in chat["top_logprobs"]] == [
        ("bytes:\\xc3", [0xC3]),
        ("bytes:\\xa9", [0xA9]),
        ("Hel", list(b"Hel")),
    ]
    completion = completion_logprobs(halves + (TokenLogprob(6, -0.2, ()),), NAMES)
    assert completion["top_logprobs"][0] == {"bytes:\\xc3": -0.5, "bytes:\\xa9": -0.9, "Hel": -3.0}
    assert completion["text_offset"] == [0, 0]  # 'é' is one character, whole after the second token
    same_name = TokenNames(lambda token_id: b"x")
    assert completion_logprobs((TokenLogprob(1, -1.0, ((1, -1.0), (2, -2.0))),), same_name)["top_logprobs"] == [
        {"x": -1.0, "token_id:2": -2.0}
    ]
    as_ids = NAMES.with_token_ids(True)
    assert chat_logprobs(halves, as_ids)[0]["token"] == "token_id:5"


def test_the_chosen_token_keeps_its_name_when_another_reads_alike() -> None:
    alike = TokenNames(lambda token_id: b" " if token_id in (7, 8) else b"x")
    body = completion_logprobs((TokenLogprob(8, -0.5, ((7, -0.4), (8, -0.5))),), alike)
    assert body["tokens"] == [" "]
    assert body["top_logprobs"] == [{"token_id:7": -0.4, " ": -0.5}]


def test_vllm_prompt_logprobs_shape() -> None:
    scored = (None, TokenLogprob(3, -1.5, ((1, -0.2), (3, -1.5))), TokenLogprob(4, -6.0, ((1, -0.1),)))
    assert vllm_prompt_logprobs(scored, NAMES) == [
        None,
        {
            "3": {"logprob": -1.5, "rank": 2, "decoded_token": " wörld"},
            "1": {"logprob": -0.2, "rank": 1, "decoded_token": "Hel"},
        },
        {
            "4": {"logprob": -6.0, "rank": None, "decoded_token": "!"},
            "1": {"logprob": -0.1, "rank": 1, "decoded_token": "Hel"},
        },
    ]


def test_an_echoed_prompt_leads_with_an_unscored_token() -> None:
    """As OpenAI's and vLLM's echo answers: the first prompt token has null logprob and alternatives (the
    SDK's pydantic types say non-null, so this checks the body itself)."""
    body = completion_logprobs(LOGPROBS, NAMES, unscored=2)
    assert body == {
        "tokens": ["lo", "Hel", " wörld"],
        "token_logprobs": [None, -0.1, MIN_LOGPROB],
        "top_logprobs": [None, {"Hel": -0.1, "lo": -2.5}, {"!": -0.01, " wörld": MIN_LOGPROB}],
        "text_offset": [0, 2, 5],
    }


# ---------------------------------------------------------------- streaming with tools


def _stream(
    pieces: Sequence[str], *, parse_tools: bool = True, parallel_tool_calls: bool = True, finish: str = "stop"
) -> tuple[list[dict[str, Any]], str, list[ToolCall], str | None]:
    """Feed pieces, validate every chunk, and reassemble content, tool calls and finish_reason."""
    state = ChatStreamState(
        0, parse_tools=parse_tools, parallel_tool_calls=parallel_tool_calls, id_factory=_sequential_ids()
    )
    choices = [choice for piece in pieces if (choice := state.push(piece)) is not None]
    choices.append(state.finish(finish))
    content = ""
    calls: list[ToolCall] = []
    for choice in choices:
        chunk = chat_chunk(response_id="chatcmpl-1", model=MODEL, created=1, choices=[choice])
        delta = ChatCompletionChunk.model_validate(chunk).choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            assert call.index == len(calls) and call.id is not None and call.function is not None
            assert call.function.name is not None and call.function.arguments is not None
            calls.append(ToolCall(id=call.id, name=call.function.name, arguments=call.function.arguments))
    assert choices[0]["delta"]["role"] == "assistant"
    assert all("role" not in choice["delta"] for choice in choices[1:])
    assert state.tool_calls == tuple(calls)
    return choices, content, calls, choices[-1]["finish_reason"]


def _expected(text: str) -> tuple[str, list[ToolCall]]:
    request = parse_chat_request(_chat_body(tools=[WEATHER_TOOL]), MODEL)
    parsed = assistant_output(text, request, id_factory=_sequential_ids())
    return parsed.content or "", list(parsed.tool_calls)


TOOL_TEXTS = [
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n<tool_call>\n  {"name": "b"}  \n</tool_call>\nDone.',
    '<tool_call>{"name": "code", "arguments": {"src": "print(\'</tool_call>\')"}}</tool_call> after',
    'Bad: <tool_call>{"arguments": {}}</tool_call> then <tool_call>{"name": "ok"}</tool_call>',
    'Not json <tool_call> oops </tool_call> and a <tool_ tag and <tool_call>{"name": "late"}</tool_call>',
    '<tool_call>{"name": "a"} trailing</tool_call>'
    '<tool_call>{"name": "b", "parameters": {"q": "<tool_call>"}}</tool_call>',
    'cut short <tool_call>{"name": "get_weather", "arguments": {"city": "Par',
    "ends with a partial tag <tool_ca",
    "  plain prose, no calls at all  \n",
    '<tool_call>["name"]</tool_call><tool_call>\n{"name": "x"}\n</tool_call',
]


@pytest.mark.parametrize("text", TOOL_TEXTS)
def test_streamed_tool_calls_match_the_whole_text_parse_at_every_split(text: str) -> None:
    expected = _expected(text)
    for split_char in range(len(text) + 1):
        _, content, calls, _ = _stream([text[:split_char], text[split_char:]])
        assert (content, calls) == expected, f"split at {split_char}"


@pytest.mark.parametrize("text", TOOL_TEXTS)
def test_streamed_tool_calls_match_char_by_char_and_random_pieces(text: str) -> None:
    expected = _expected(text)
    assert _stream(list(text))[1:3] == expected
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(6, len(text))))
        pieces = [text[start:end] for start, end in itertools.pairwise([0, *cuts, len(text)])]
        assert _stream(pieces)[1:3] == expected


def test_finish_reason_is_tool_calls_only_with_calls() -> None:
    assert _stream(['<tool_call>{"name": "a"}</tool_call>'])[3] == "tool_calls"
    assert _stream(["just text"])[3] == "stop"
    assert _stream(["just text"], finish="length")[3] == "length"


def _delta(choice: dict[str, Any] | None) -> dict[str, Any]:
    assert choice is not None
    delta: dict[str, Any] = choice["delta"]
    return delta


def test_text_around_tool_calls_streams_as_soon_as_decided() -> None:
    state = ChatStreamState(0, parse_tools=True, id_factory=_sequential_ids())
    assert _delta(state.push("Hello <tool")) == {"role": "assistant", "content": "Hello"}
    assert state.push('_call>{"name": "get_weather", "arguments": {"ci') is None
    assert state.push('ty": "Paris"}}\n</tool_') is None
    emitted = state.push("call> Next")
    assert emitted is not None
    assert emitted["delta"] == {
        "content": "  Next",
        "tool_calls": [
            {
                "index": 0,
                "id": "call_0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    }
    assert _delta(state.push(" <b>")) == {"content": " <b>"}
    assert state.finish("stop")["delta"] == {}


def test_parallel_tool_calls_false_streams_only_the_first_call() -> None:
    text = '<tool_call>{"name": "a"}</tool_call> <tool_call>{"name": "b"}</tool_call>'
    _, content, calls, reason = _stream(list(text), parallel_tool_calls=False)
    assert (content, [call.name for call in calls], reason) == ("", ["a"], "tool_calls")


def test_without_tools_text_streams_unchanged() -> None:
    text = '  Hi <tool_call>{"name": "a"}</tool_call>\n\n'
    pieces = [text[:3], text[3:9], text[9:]]
    choices, content, calls, reason = _stream(pieces, parse_tools=False)
    assert [choice["delta"].get("content") for choice in choices[:-1]] == pieces
    assert (content, calls, reason) == (text, [], "stop")


def test_logprobs_wait_for_the_next_emitted_chunk() -> None:
    entries = chat_logprobs(LOGPROBS, NAMES)
    state = ChatStreamState(0, parse_tools=True)
    assert state.push("<tool_", entries[:1]) is None
    emitted = state.push("x>", entries[1:])
    assert emitted is not None and emitted["logprobs"] == {"content": entries}
    assert state.finish("stop")["logprobs"] is None


def test_token_ids_wait_for_the_next_emitted_chunk_and_none_are_lost() -> None:
    """vLLM's ``return_token_ids``: every delta's ids go out with the next chunk the choice emits, so the chunks'
    ids together are the answer's however the text was held back; a request that did not ask gets none."""
    state = ChatStreamState(0, parse_tools=True, token_ids=True)
    state.hold_token_ids([1, 2])
    assert state.push("<tool_") is None
    state.hold_token_ids([3])
    emitted = state.push("x> and more")
    assert emitted is not None and emitted["token_ids"] == [1, 2, 3]
    state.hold_token_ids([4])
    assert state.push("") is None
    state.hold_token_ids([5, 6])
    assert state.finish("stop")["token_ids"] == [4, 5, 6]
    quiet = ChatStreamState(0, parse_tools=False)
    quiet.hold_token_ids([1])
    assert "token_ids" not in (quiet.push("a") or {}) and "token_ids" not in quiet.finish("stop")
    hidden = ChatStreamState(0, parse_tools=True, token_ids=True, reasoning="qwen3", show_reasoning=False)
    hidden.hold_token_ids([7])
    assert hidden.finish("stop")["token_ids"] is None


def test_stream_state_for_request_parses_only_when_tools_are_offered() -> None:
    text = '<tool_call>{"name": "get_weather"}</tool_call>'
    offered = parse_chat_request(_chat_body(tools=[WEATHER_TOOL]), MODEL)
    declined = parse_chat_request(_chat_body(tools=[WEATHER_TOOL], tool_choice="none"), MODEL)
    with_tools = ChatStreamState.for_request(offered, 0, id_factory=_sequential_ids())
    assert _delta(with_tools.push(text))["tool_calls"][0]["function"]["name"] == "get_weather"
    assert _delta(ChatStreamState.for_request(declined, 0).push(text))["content"] == text


def test_prompt_scores_are_bounded_per_prompt() -> None:
    """A long context's scores, each a Python object through the replica and the ingress, are capped."""
    _check_score_size(MAX_PROMPT_SCORES // 21, 20, "prompt")
    with pytest.raises(APIError) as caught:
        _check_score_size(MAX_PROMPT_SCORES // 21 + 1, 20, "prompt[3]")
    assert (caught.value.status_code, caught.value.param) == (400, "prompt[3]")
    assert f"at most {MAX_PROMPT_SCORES // 21} tokens" in caught.value.message
    _check_score_size(MAX_PROMPT_SCORES // 2, 1, "prompt")
