"""vLLM's ``allowed_token_ids`` and ``bad_words`` through the ingress (no cluster: the decode pool is replaced by a
recorder of the calls sent to it): chat completions, completions and gRPC's ``SamplingOptions`` carry them to the
call's sampling parameters, the words tokenized as vLLM tokenizes them; bad values are a 400 naming the field
(gRPC: INVALID_ARGUMENT) before anything is sent; the published schemas agree."""

from __future__ import annotations

from typing import Any

import grpc
import jsonschema
import pytest

pytest.importorskip("ray")

from ingress_recorder import (
    APIS,
    RecordingPipeline,
    assert_refused,
    grpc_refusal,
    request_schema,
    send_grpc,
    send_http,
)

from rayturn.api.errors import APIError
from rayturn.api.openapi import openapi_document
from rayturn.api.sampling_fields import bad_word_ids
from rayturn.protos import rayturn_pb2 as pb

FILTERING_APIS = ["chat", "completions"]
DOCUMENT = openapi_document("tiny", vocab_size=263)  # the tiny preset's


@pytest.fixture(scope="module")
def pipeline() -> RecordingPipeline:
    return RecordingPipeline()


def body_schema(api: str) -> jsonschema.Draft202012Validator:
    return request_schema(DOCUMENT, api)


def test_words_are_tokenized_as_vllm_does() -> None:
    """As is (leading whitespace stripped), and after one space where that gives another first token and as many
    tokens: a BPE vocabulary's word-in-the-middle form."""
    vocabulary = {"hello": [5, 6], " hello": [7, 6], "x": [9], " x": [10, 9], "ab": [3, 4], " ab": [3, 4]}
    encode = vocabulary.__getitem__
    assert bad_word_ids(["hello", "  x", "ab"], encode) == ((5, 6), (7, 6), (9,), (3, 4))
    with pytest.raises(APIError, match=r"bad_words\[0\]': expected 1 to 1024 tokens, got 0"):
        bad_word_ids(["nothing"], lambda _text: [])
    both_forms = lambda text: [1000 + len(text)] if text[0] == " " else [len(text)]  # noqa: E731
    assert len(bad_word_ids([f"w{i}" for i in range(64)], both_forms)) == 128
    with pytest.raises(APIError, match="the words make 130 token sequences; at most 128"):
        bad_word_ids([f"w{i}" for i in range(65)], both_forms)


@pytest.mark.parametrize("api", FILTERING_APIS)
def test_the_fields_reach_the_calls_sampling(pipeline: RecordingPipeline, api: str) -> None:
    encode = pipeline.tokenizer.encode
    extra = {"allowed_token_ids": [40, 41, 41, 200], "bad_words": ["def", "  return"]}
    status, body, call = send_http(pipeline, api, extra)
    assert status == 200 and call is not None, body
    assert call.params.allowed_token_ids == (40, 41, 41, 200)
    expected = tuple(tuple(encode(word, add_special_tokens=False)) for word in ("def", "return"))
    assert call.params.bad_words == expected and all(len(word) > 1 for word in expected)
    body_schema(api).validate({**APIS[api][2], **extra})
    status, body, call = send_http(pipeline, api, {"allowed_token_ids": None, "bad_words": None})
    assert status == 200 and call is not None and (call.params.allowed_token_ids, call.params.bad_words) == (None, ())


BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"allowed_token_ids": []}, "allowed_token_ids", "expected 1 to 262144 token ids, got 0"),
    ({"allowed_token_ids": [1, -1]}, "allowed_token_ids[1]", "a non-negative integer"),
    ({"allowed_token_ids": ["1"]}, "allowed_token_ids[0]", "a non-negative integer"),
    ({"allowed_token_ids": 5}, "allowed_token_ids", "an array"),
    ({"allowed_token_ids": [3, 263, 999]}, "allowed_token_ids", "out of vocabulary [0, 263): [263, 999]"),
    ({"bad_words": "def"}, "bad_words", "an array"),
    ({"bad_words": ["ok", ""]}, "bad_words[1]", "not only whitespace"),
    ({"bad_words": ["   "]}, "bad_words[0]", "not only whitespace"),
    ({"bad_words": [7]}, "bad_words[0]", "a string"),
    ({"bad_words": ["x" * 257]}, "bad_words[0]", "1 to 256 characters"),
    ({"bad_words": ["w"] * 129}, "bad_words", "at most 128 words, got 129"),
]


@pytest.mark.parametrize("api", FILTERING_APIS)
@pytest.mark.parametrize(("extra", "param", "said"), BAD, ids=[f"bad-{i}" for i in range(len(BAD))])
def test_a_bad_value_is_a_400_naming_the_field_and_nothing_is_sent(
    pipeline: RecordingPipeline, api: str, extra: dict[str, Any], param: str, said: str
) -> None:
    assert_refused(pipeline, api, extra, param, said, DOCUMENT)


def test_grpc_sampling_options_carry_them(pipeline: RecordingPipeline) -> None:
    sampling = pb.SamplingOptions(allowed_token_ids=[7, 8], bad_words=["ab"])
    call = send_grpc(pipeline, pb.GenerateRequest(text="hi", sampling=sampling))
    assert call.params.allowed_token_ids == (7, 8)
    assert call.params.bad_words == (tuple(pipeline.tokenizer.encode("ab", add_special_tokens=False)),)
    unset = send_grpc(pipeline, pb.GenerateRequest(text="hi"))
    assert (unset.params.allowed_token_ids, unset.params.bad_words) == (None, ())


@pytest.mark.parametrize(
    ("sampling", "said"),
    [
        (pb.SamplingOptions(allowed_token_ids=[1, -3]), "sampling.allowed_token_ids': expected non-negative"),
        (pb.SamplingOptions(allowed_token_ids=[263]), "out of vocabulary"),
        (pb.SamplingOptions(bad_words=[" "]), "sampling.bad_words[0]': expected a word"),
        (pb.SamplingOptions(bad_words=["w"] * 129), "sampling.bad_words': expected at most 128 words"),
    ],
)
def test_bad_grpc_values_are_invalid_argument(pipeline: RecordingPipeline, sampling: Any, said: str) -> None:
    context = grpc_refusal(pipeline, pb.GenerateRequest(text="hi", sampling=sampling))
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and said in context.details, context.details


READ = {"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}
GUIDED: list[tuple[str, dict[str, Any], str]] = [
    ("chat", {"structured_outputs": {"regex": "[ab]+"}}, "structured_outputs"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"tools": [READ], "tool_choice": "required"}, "tool_choice"),
    ("chat", {"tools": [READ], "tool_choice": {"type": "function", "function": {"name": "read"}}}, "tool_choice"),
    ("completions", {"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs"),
]


@pytest.mark.parametrize(("api", "guide", "guide_name"), GUIDED, ids=[f"{api}-{name}" for api, _, name in GUIDED])
@pytest.mark.parametrize("filters", [{"allowed_token_ids": [40, 41]}, {"bad_words": ["ab"]}], ids=["allowed", "bad"])
def test_a_guided_answer_takes_no_token_filter(
    pipeline: RecordingPipeline, api: str, guide: dict[str, Any], guide_name: str, filters: dict[str, Any]
) -> None:
    """Where the format's next token is one the filters forbid, no token would be left: refused before it is sent
    (it was a 500 once the guide broke), with the guide alone and the filters alone still taken."""
    (name,) = filters
    status, body, call = send_http(pipeline, api, {**guide, **filters})
    assert (status, call) == (400, None), body
    assert body["error"]["param"] == name and f"Cannot set '{name}' with '{guide_name}" in body["error"]["message"]
    assert any("'allowed_token_ids' and 'bad_words' go with no" in rule for rule in _rules(api))
    for alone in (guide, filters):
        status, body, call = send_http(pipeline, api, alone)
        assert status == 200 and call is not None, body


def _rules(api: str) -> list[str]:
    rules: list[str] = DOCUMENT["paths"][APIS[api][1]]["post"]["x-rayturn-rules"]
    return rules


def test_a_guided_grpc_call_takes_no_token_filter(pipeline: RecordingPipeline) -> None:
    regex = pb.StructuredOutput(regex="a+")
    tool = pb.Tool(name="read", parameters_json='{"type": "object"}')
    messages = pb.Messages(messages=[pb.ChatMessage(role="user", content="hi")])
    forced = pb.ToolChoice(mode=pb.ToolChoice.MODE_REQUIRED)
    cases = [
        (
            pb.GenerateRequest(text="hi", sampling=pb.SamplingOptions(allowed_token_ids=[7], structured_output=regex)),
            "sampling.allowed_token_ids",
        ),
        (
            pb.GenerateRequest(
                messages=messages, tools=[tool], tool_choice=forced, sampling=pb.SamplingOptions(bad_words=["ab"])
            ),
            "sampling.bad_words",
        ),
    ]
    for request, param in cases:
        context = grpc_refusal(pipeline, request)
        assert context.code == grpc.StatusCode.INVALID_ARGUMENT and f"Cannot set '{param}' with" in context.details
