"""Bad input refused at the edge with a 4xx, and the published request schemas agreeing with the parsers (no cluster).

The cluster test (``tests/cluster/test_bad_input.py``) sends the same kinds
of bodies over real HTTP and gRPC; here each rule is pinned where it lives:
the JSON reader, typed field reads, the media-type check, the gRPC request
decoder, and the OpenAPI document.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

import grpc
import jsonschema
import pytest
from anthropic.types import Message
from openai.types.chat import ChatCompletionMessage

from rayturn.api.anthropic_bodies import error_body
from rayturn.api.anthropic_request import parse_messages_request
from rayturn.api.chat_request import decoded_arguments, parse_chat_request
from rayturn.api.completion_request import parse_completion_request
from rayturn.api.errors import APIError, client_error
from rayturn.api.grpc_decoding import SERVICER_FUNCTION, UndecodableRequest, add_servicer, decoded, lenient_decoder
from rayturn.api.json_fields import INT64_MAX, Fields, json_in_text
from rayturn.api.json_schema import token_id_key
from rayturn.api.openapi import openapi_document
from rayturn.api.protocol import MIN_LOGIT_DIVISOR, SamplingSpec, to_sampling_params
from rayturn.api.request_limits import check_json_media_type, parse_json
from rayturn.api.responses_request import parse_input_tokens_request, parse_responses_request
from rayturn.api.session import optional_session_id
from rayturn.api.tokenize_request import parse_detokenize_request, parse_tokenize_request
from rayturn.engine.sampling_params import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams
from rayturn.protos import rayturn_pb2 as pb

MODEL, VOCAB_SIZE = "tiny", 259


def refused(call: Any, *args: Any) -> APIError:
    with pytest.raises(APIError) as err:
        call(*args)
    assert 400 <= err.value.status_code < 500
    return err.value


# -- the JSON reader -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b'{"model": "a", "model": "b"}', "'model' appears twice"),
        (b'{"a": [{"b": 1, "c": {"d": 1, "d": 2}}]}', "'d' appears twice"),
        (b'{"temperature": NaN}', "NaN is not a JSON number"),
        (b'{"max_tokens": Infinity}', "Infinity is not a JSON number"),
        (b"[-Infinity]", "-Infinity is not a JSON number"),
        (b'{"max_tokens": ' + b"9" * 5000 + b"}", "4300 digits"),
        (b'{"a": "\xff"}', "can't decode byte 0xff"),
    ],
)
def test_json_with_two_meanings_or_none_is_a_400_that_says_why(body: bytes, words: str) -> None:
    err = refused(parse_json, body)
    assert err.status_code == 400 and words in err.message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (rb'{"messages": [{"role": "user", "content": "a\ud800"}]}', "messages[0].content"),
        (rb'{"input": "\udc00 low first"}', "input"),
        (rb'{"x": {"\ud800key": 1}}', "x"),
        (rb'["\ud83d"]', "[0]"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(body: bytes, param: str) -> None:
    err = refused(parse_json, body)
    assert (err.param, err.code) == (param, "invalid_unicode") and "surrogate" in err.message


def test_surrogate_pairs_and_escaped_backslashes_are_text() -> None:
    assert parse_json(rb'{"a": "\ud83d\ude00", "b": "\\ud800"}') == {"a": "\U0001f600", "b": "\\ud800"}


def test_deep_json_inside_a_string_field_is_text_not_a_crash() -> None:
    deep = "[" * 5000 + "]" * 5000
    assert json_in_text(deep) is None and json_in_text('{"a": 1}') == {"a": 1}
    assert decoded_arguments(deep) == deep
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    parsed = parse_messages_request({**body, "metadata": {"user_id": deep}}, MODEL)
    assert parsed.session_id == deep  # too long for a session id: the ingress answers 400 naming the field


# -- typed fields --------------------------------------------------------------------------------------


def test_integers_are_json_integers_up_to_int64() -> None:
    fields = Fields({"a": 2.0, "b": 2, "c": 1e30, "d": 2.5, "e": True, "f": INT64_MAX}, "")
    assert fields.integer("a", minimum=1) == 2 and isinstance(fields.integer("a"), int)
    assert fields.integer("b", minimum=1) == 2 and fields.integer("f") == INT64_MAX
    assert (
        "expected an integer in [1, 9223372036854775807], got 1e+30"
        in refused(lambda: fields.integer("c", minimum=1)).message
    )
    assert "expected an integer, got a number" in refused(lambda: fields.integer("d")).message
    assert "expected an integer, got a boolean" in refused(lambda: fields.integer("e")).message
    assert "expected an integer >= 3, got 2" in refused(lambda: fields.integer("b", minimum=3)).message


def test_numbers_past_the_float_range_are_named_as_such() -> None:
    """``1e400`` parses as infinity, which no number field takes: the error must not say it got "a number"."""
    body: Any = parse_json(b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e400, "seed": -1e400}')
    too_hot = refused(parse_chat_request, body, MODEL)
    assert too_hot.param == "temperature"
    assert too_hot.message == "Invalid type for 'temperature': expected a number, got a number out of range (inf)."
    del body["temperature"]
    seed = refused(parse_chat_request, body, MODEL)
    assert seed.param == "seed"
    assert seed.message == "Invalid type for 'seed': expected an integer, got a number out of range (-inf)."
    # NaN is no JSON, but a value may still reach a field read as one.
    not_a_number = Fields({"n": math.nan}, "")
    assert (
        "got a non-finite number (nan)" in refused(lambda: not_a_number.number("n", minimum=0.0, maximum=1.0)).message
    )


def test_token_ids_written_as_floats_reach_the_engine_as_ints() -> None:
    parsed = parse_completion_request({"prompt": [1.0, 2, 3.0], "stop_token_ids": [7.0]}, MODEL)
    assert parsed.prompts == ((1, 2, 3),) and all(type(token_id) is int for token_id in parsed.prompts[0])
    assert parsed.sampling.stop_token_ids == (7,) and type(parsed.sampling.stop_token_ids[0]) is int


def test_huge_and_negative_numbers_name_their_field() -> None:
    messages = [{"role": "user", "content": "hi"}]
    for value in (1e30, -1, 10**40):
        assert refused(parse_chat_request, {"messages": messages, "max_tokens": value}, MODEL).param == "max_tokens"
        body: dict[str, Any] = {"messages": messages, "max_tokens": value}
        assert refused(parse_messages_request, body, MODEL).param == "max_tokens"
        assert refused(parse_responses_request, {"input": "hi", "max_output_tokens": value}, MODEL).param == (
            "max_output_tokens"
        )
    assert refused(parse_chat_request, {"messages": messages, "n": 10**9}, MODEL).param == "n"


def test_a_vanishing_temperature_is_greedy_and_a_vanishing_penalty_is_bounded() -> None:
    spec = SamplingSpec(temperature=1e-300, repetition_penalty=1e-300)
    params = to_sampling_params(spec, default_max_tokens=4, prompt_tokens=3, max_model_len=64)
    assert params.greedy and params.repetition_penalty == MIN_LOGIT_DIVISOR
    with pytest.raises(APIError):
        to_sampling_params(SamplingSpec(temperature=-1e-300), default_max_tokens=4, prompt_tokens=3, max_model_len=64)


@pytest.mark.parametrize(
    "content_type", ["application/json", "application/json; charset=utf-8", "application/vnd.a+json"]
)
def test_json_media_types_pass(content_type: str) -> None:
    check_json_media_type({"content-type": content_type})
    check_json_media_type({})


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", "+json"]
)
def test_other_media_types_are_415(content_type: str) -> None:
    err = refused(check_json_media_type, {"content-type": content_type})
    assert (err.status_code, err.code) == (415, "unsupported_media_type") and "application/json" in err.message


# -- gRPC request messages -----------------------------------------------------------------------------


def test_bytes_that_do_not_decode_become_a_400_naming_the_message_type() -> None:
    decode = lenient_decoder(pb.GenerateRequest)
    good = pb.GenerateRequest(text="hi")
    assert decode(good.SerializeToString()) == good
    for data in (b"\x08\xff\xff", b"\x0a\x7f", b"\x0a\x02\xc3\x28"):  # truncated, past the end, not UTF-8
        undecodable = decode(data)
        assert undecodable == UndecodableRequest("rayturn.v1.GenerateRequest", len(data))
        err = refused(decoded, undecodable)
        assert err.status_code == 400 and "not a valid rayturn.v1.GenerateRequest" in err.message
    assert decoded(good) is good


class _Server:
    def __init__(self) -> None:
        self.generic: list[Any] = []
        self.registered: dict[str, dict[str, Any]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self.generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.registered[service] = handlers


class _Servicer:
    Generate = Health = Prewarm = Tokenize = staticmethod(lambda request, context: None)


def test_the_servicer_function_registers_every_method_with_the_lenient_decoder() -> None:
    server = _Server()
    add_servicer(_Servicer(), server)
    handlers = server.registered["rayturn.v1.RayTurn"]
    assert set(handlers) == set(pb.DESCRIPTOR.services_by_name["RayTurn"].methods_by_name)
    assert handlers["Generate"].response_streaming and not handlers["Health"].response_streaming
    for name, handler in handlers.items():
        assert isinstance(handler.request_deserializer(b"\xff"), UndecodableRequest), name
    assert len(server.generic) == 1 and isinstance(server.generic[0], grpc.GenericRpcHandler)
    assert SERVICER_FUNCTION == "rayturn.api.grpc_decoding.add_servicer"


# -- the OpenAPI document ------------------------------------------------------------------------------

DOCUMENT = openapi_document(MODEL, VOCAB_SIZE)
PARSERS: dict[str, Callable[[object, str], Any]] = {
    "/v1/chat/completions": parse_chat_request,
    "/v1/completions": parse_completion_request,
    "/v1/messages": parse_messages_request,
    "/v1/responses": parse_responses_request,
    "/v1/responses/input_tokens": parse_input_tokens_request,
    "/tokenize": parse_tokenize_request,
    "/detokenize": lambda body, model: parse_detokenize_request(body, model, VOCAB_SIZE),
}
USER = {"role": "user", "content": "hi"}
GOOD = {
    "/v1/chat/completions": {
        "model": MODEL,
        "messages": [USER],
        "max_tokens": 2,
        "top_logprobs": 2,
        "logprobs": True,
        "logit_bias": {"0": -100, str(VOCAB_SIZE - 1): 2.5},
        "frequency_penalty": 0.5,
        "presence_penalty": -2,
    },
    "/v1/completions": {
        "prompt": [[1, 2], "hi"],
        "max_tokens": 2,
        "stream": True,
        "stream_options": {},
        "min_tokens": 2,
        "stop_token_ids": [0, VOCAB_SIZE - 1],
    },
    "/v1/messages": {"messages": [USER], "max_tokens": 2, "stop_sequences": ["x"]},
    "/v1/messages/count_tokens": {"messages": [USER]},
    "/v1/responses": {
        "input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "t"}]}, USER],
        "tools": [{"type": "web_search"}],
        "seed": 7,
        "top_k": 5,
        "stop": "END",
        "min_tokens": 1,
        "stop_token_ids": [3],
        "n": 1,
        "include": ["reasoning.encrypted_content", "message.output_text.logprobs", "web_search_call.action.sources"],
    },
    "/v1/responses/input_tokens": {
        "input": [USER],
        "instructions": "Be terse.",
        "tools": [{"type": "function", "name": "f"}],
        "tool_choice": "required",
        "truncation": "auto",
    },
    "/tokenize": {
        "messages": [USER, {"role": "assistant", "content": "Sure"}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "continue_final_message": True,
        "add_generation_prompt": False,
        "return_token_strs": True,
    },
    "/detokenize": {"model": "", "tokens": [0, VOCAB_SIZE - 1]},
}
# Bodies the schema refuses and the parser refuses too: where the schema states a rule the parser holds.
BAD = {
    "/v1/chat/completions": [
        {"messages": []},
        {"messages": [USER, {"role": "assistant", "content": None}]},  # neither content nor calls
        {"messages": [USER, {"role": "assistant", "tool_calls": []}]},
        {"messages": [USER], "logit_bias": {"x": 1}},
        {"messages": [USER], "logit_bias": {"5": 101}},
        {"messages": [USER], "logit_bias": [5]},
        {"messages": [USER], "presence_penalty": 3},
        {"messages": [USER], "top_logprobs": 2},
        {"messages": [USER], "stream_options": {}},
        {"messages": [USER], "tool_choice": "required"},
        {"messages": [USER], "stop": ["a", "b", "c", "d", "e"]},
        {"messages": [USER], "n": 17},
        {"messages": [USER], "top_p": 0},
        {"messages": [USER], "model": "other"},
        {"messages": [{"role": "tool", "content": "x"}]},
        {"messages": [USER], "user": "u" * 257},
    ],
    "/v1/completions": [
        {"prompt": ""},
        {"prompt": [-1]},
        {"prompt": "a", "suffix": "b"},
        {"prompt": "a", "min_tokens": -1},
        {"prompt": "a", "stop_token_ids": [-1]},
        {"prompt": "a", "stop_token_ids": list(range(257))},
    ],
    "/v1/messages": [
        {"messages": [USER]},
        {"messages": [USER], "max_tokens": 0},
        {"messages": [USER], "max_tokens": 1, "temperature": 1.5},
        {"messages": [USER], "max_tokens": 1, "tool_choice": {"type": "any"}},
        {"messages": [{"role": "user", "content": [{"type": "image"}]}], "max_tokens": 1},
    ],
    "/v1/responses": [
        {},
        {"input": []},
        {"input": [{"type": "reasoning", "summary": []}]},  # reasoning alone makes no message
        {"input": "x", "background": True, "store": False},
        {"input": "x", "top_logprobs": 21},
        {"input": "x", "n": 2},
        {"input": "x", "top_k": -2},
        {"input": "x", "seed": "7"},
        {"input": "x", "vllm_xargs": {"a": 1}},
        {"input": "x", "include": ["message.output_text.logprob"]},
    ],
    "/v1/responses/input_tokens": [
        {},
        {"input": []},
        {"input": "x", "tool_choice": "required"},
        {"input": "x", "truncation": "no"},
    ],
    "/tokenize": [
        {},
        {"prompt": "a", "messages": [USER]},
        {"prompt": "a", "tools": [{"type": "function", "function": {"name": "f"}}]},
        {"prompt": "a", "add_generation_prompt": True},
        {"messages": []},
        {"messages": [USER], "tool_choice": "required"},
        {
            "messages": [USER, {"role": "assistant", "content": "a"}],
            "continue_final_message": True,
            "add_generation_prompt": True,
        },
        {"messages": [USER], "chat_template": "{{ messages }}"},
        {"prompt": "a", "model": "other"},
    ],
    "/detokenize": [{}, {"tokens": [-1]}, {"tokens": [VOCAB_SIZE]}, {"tokens": [1.5]}, {"tokens": "1 2"}],
}


def _body_schema(path: str) -> dict[str, Any]:
    return dict(DOCUMENT["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"])


def test_the_document_is_openapi_3_1_with_valid_json_schemas() -> None:
    assert DOCUMENT["openapi"] == "3.1.0"
    for path, operations in DOCUMENT["paths"].items():
        for operation in operations.values():
            if "requestBody" in operation:
                jsonschema.Draft202012Validator.check_schema(_body_schema(path))
                assert "x-rayturn-rules" in operation
            for status in ("4XX", "5XX"):
                shape = "AnthropicError" if path.startswith("/v1/messages") else "OpenAIError"
                if status in operation.get("responses", {}):
                    ref = operation["responses"][status]["content"]["application/json"]["schema"]["$ref"]
                    assert ref == f"#/components/schemas/{shape}"


@pytest.mark.parametrize("path", list(GOOD))
def test_a_good_body_is_valid_under_its_schema_and_parses(path: str) -> None:
    jsonschema.Draft202012Validator(_body_schema(path)).validate(GOOD[path])
    if path in PARSERS:
        PARSERS[path](GOOD[path], MODEL)


def test_a_chat_completions_message_sent_back_as_it_came_is_valid_and_parses() -> None:
    """The usual way to keep a chat's history: the answer's message appended as the SDK sends it on (the fields
    the response had, null ones too), here as OpenAI and vLLM answer a call of calls alone and one of text."""
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    answers = [
        {"role": "assistant", "content": None, "refusal": None, "annotations": [], "audio": None},
        {"role": "assistant", "content": "Done.", "refusal": None, "reasoning": None, "function_call": None},
    ]
    for answer, calls in zip(answers, ([call], None), strict=True):
        message = ChatCompletionMessage.model_validate({**answer, "tool_calls": calls})
        sent = message.model_dump(exclude_unset=True, mode="json")
        assert ("content" in sent) and ("refusal" in sent)
        results = [{"role": "tool", "tool_call_id": "call_1", "name": "f", "content": "ok"}] if calls else []
        body = {"messages": [USER, sent, *results, USER], "tools": [{"type": "function", "function": {"name": "f"}}]}
        jsonschema.Draft202012Validator(_body_schema("/v1/chat/completions")).validate(body)
        history = parse_chat_request(body, MODEL).messages[1]
        if calls is None:
            assert history == {"role": "assistant", "content": "Done."}
        else:
            assert [call["function"]["name"] for call in history["tool_calls"]] == ["f"] and "content" not in history


def test_an_anthropic_answers_content_sent_back_as_it_came_is_valid_and_parses() -> None:
    """The Anthropic way to keep history: the answer's ``content`` blocks appended as the SDK sends them on, with
    the fields the answer had (a text block's null ``citations``, a call's ``caller``)."""
    answer = Message.model_validate(
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": MODEL,
            "stop_reason": "tool_use",
            "stop_sequence": None,
            "usage": {"input_tokens": 9, "output_tokens": 4},
            "content": [
                {"type": "thinking", "thinking": "Look first.", "signature": ""},
                {"type": "text", "text": "Let me look.", "citations": None},
                {"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {}, "caller": {"type": "direct"}},
            ],
        }
    )
    blocks = [block.model_dump(exclude_unset=True, mode="json") for block in answer.content]
    assert blocks[1]["citations"] is None and blocks[2]["caller"] == {"type": "direct"}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.py"}
    body = {
        "max_tokens": 2,
        "messages": [USER, {"role": "assistant", "content": blocks}, {"role": "user", "content": [result]}],
        "tools": [{"name": "ls", "input_schema": {"type": "object"}}],
    }
    jsonschema.Draft202012Validator(_body_schema("/v1/messages")).validate(body)
    history = parse_messages_request(body, MODEL).chat.messages[1]
    assert history["content"] == "Let me look." and history["reasoning_content"] == "Look first."
    assert [call["function"]["name"] for call in history["tool_calls"]] == ["ls"]


@pytest.mark.parametrize(("path", "body"), [(path, body) for path, bodies in BAD.items() for body in bodies])
def test_what_the_schema_refuses_the_parser_refuses(path: str, body: dict[str, Any]) -> None:
    assert not jsonschema.Draft202012Validator(_body_schema(path)).is_valid(body), json.dumps(body)
    with pytest.raises((APIError, ValueError)):
        parsed = PARSERS[path](body, MODEL)
        if path == "/v1/chat/completions":  # the user field becomes the session id at the call's start
            optional_session_id(parsed.user, "user")


@pytest.mark.parametrize("most", [*range(0, 130), 262, 999, 1000, 1009, 9_999, 10_000, 32_767, 151_935, 200_064])
def test_token_id_keys_match_the_vocabulary_and_nothing_else(most: int) -> None:
    """``logit_bias``'s keys in the schema: every id up to ``most`` in decimal, nothing above it, no leading zero."""
    pattern = re.compile(token_id_key(most + 1)["pattern"])
    below = range(0, most + 1) if most < 2_000 else [*range(0, 2_000), *range(most - 2_000, most + 1)]
    assert all(pattern.fullmatch(str(i)) for i in below)
    assert not any(pattern.fullmatch(str(i)) for i in range(most + 1, most * 3 + 30))
    assert not any(pattern.fullmatch(text) for text in ("", "-1", "00", "01", f"0{most}", " 1", "1.0", "x"))


def test_error_shapes_are_what_the_apis_answer() -> None:
    schemas = DOCUMENT["components"]["schemas"]
    error = APIError(400, "bad", param="x")
    jsonschema.validate(error.to_dict(), schemas["OpenAIError"])
    jsonschema.validate(error_body(error), schemas["AnthropicError"])
    jsonschema.validate(error_body(APIError(415, "media")), schemas["AnthropicError"])
    assert error_body(APIError(415, "media"))["error"]["type"] == "invalid_request_error"


def test_running_out_of_stack_on_a_request_is_its_400_not_a_500() -> None:
    err = client_error(RecursionError("maximum recursion depth exceeded"), "req-1")
    assert (err.status_code, err.code) == (400, "json_too_deep") and "nests too deeply" in err.message


def test_stop_token_ids_out_of_the_vocabulary_are_refused_at_the_ingress_naming_the_field() -> None:
    spec = SamplingSpec(stop_token_ids=(7, 300, 2, 1000))
    with pytest.raises(APIError) as caught:
        to_sampling_params(spec, default_max_tokens=4, prompt_tokens=3, max_model_len=64, vocab_size=256)
    assert caught.value.status_code == 400 and caught.value.param == "stop_token_ids"
    assert caught.value.message == "Invalid 'stop_token_ids': token ids out of vocabulary [0, 256): [300, 1000]."
    params = to_sampling_params(
        SamplingSpec(stop_token_ids=(255,)), default_max_tokens=4, prompt_tokens=3, max_model_len=64, vocab_size=256
    )
    assert params.stop_token_ids == (255,)


def test_logit_bias_out_of_the_vocabulary_is_refused_at_the_ingress_naming_the_field() -> None:
    spec = SamplingSpec(logit_bias=((5, 1.0), (256, 2.0), (9000, -1.0)))
    with pytest.raises(APIError) as caught:
        to_sampling_params(spec, default_max_tokens=4, prompt_tokens=3, max_model_len=64, vocab_size=256)
    assert caught.value.status_code == 400 and caught.value.param == "logit_bias"
    assert caught.value.message == "Invalid 'logit_bias': token ids out of vocabulary [0, 256): [256, 9000]."
    spec = SamplingSpec(logit_bias=((255, 3.0),), frequency_penalty=0.5, presence_penalty=-0.25)
    params = to_sampling_params(spec, default_max_tokens=4, prompt_tokens=3, max_model_len=64, vocab_size=256)
    assert (params.logit_bias, params.frequency_penalty, params.presence_penalty) == (((255, 3.0),), 0.5, -0.25)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"frequency_penalty": 2.5}, "SamplingParams.frequency_penalty must be a number in [-2, 2], got 2.5"),
        ({"presence_penalty": float("nan")}, "SamplingParams.presence_penalty must be a number in [-2, 2], got nan"),
        ({"logit_bias": {3: 101.0}}, "SamplingParams.logit_bias values must be numbers in [-100, 100], got 101.0"),
        ({"logit_bias": {-3: 1.0}}, "SamplingParams.logit_bias keys must be token ids >= 0, got -3"),
        ({"logit_bias": [(3, 1.0), (3, 2.0)]}, "SamplingParams.logit_bias names a token id more than once"),
        ({"logit_bias": 5}, "SamplingParams.logit_bias must map token ids to numbers, got int"),
        ({"logit_bias": {i: 1.0 for i in range(1025)}}, "SamplingParams.logit_bias must name at most 1024 tokens"),
    ],
)
def test_sampling_params_check_penalties_and_bias(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as caught:
        SamplingParams(**fields)
    assert str(caught.value).startswith(message)


def test_sampling_params_bound_how_many_stops_a_request_gives() -> None:
    """Every token is checked against each stop: the engine refuses more than its limits, whatever API made them."""
    SamplingParams(stop=["s"] * MAX_STOP_STRINGS, stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)))
    with pytest.raises(ValueError, match=f"SamplingParams.stop must hold at most {MAX_STOP_STRINGS} strings"):
        SamplingParams(stop=["s"] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(ValueError, match=f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} token ids, got"):
        SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))
