"""gRPC ``Tokenize``: the prompt ids a ``Generate`` call with the same request would compute, without running it.
Through the ingress's real pipeline (its calls recorded, not sent): for a chat with tools, a text, token ids and a
truncated text, the ids equal the prompt of the call ``Generate`` sends, and a chat's equal HTTP's ``/tokenize`` of
the same chat; bad requests are INVALID_ARGUMENT naming the field, a missing key UNAUTHENTICATED; a prompt that
leaves no room for its ``max_tokens`` is still counted."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest
from ingress_recorder import GrpcContext, RecordingPipeline, grpc_refusal, http_request, send_grpc

from rayturn.api.grpc_decoding import UndecodableRequest
from rayturn.api.grpc_service import GrpcCallFailed, GrpcService
from rayturn.api.serving_tokens import ServingTokens
from rayturn.api.tenants import KeyTable
from rayturn.protos import rayturn_pb2 as pb

KEY = "sk-tokenize"
SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
TOOL = pb.Tool(name="open_file", description="Open a file.", parameters_json=json.dumps(SCHEMA))
QUESTION = pb.ChatMessage(role="user", content="What is in README.md?")
REQUESTS = {
    "chat with tools": pb.GenerateRequest(messages=pb.Messages(messages=[QUESTION]), tools=[TOOL]),
    "text": pb.GenerateRequest(text="def add(a, b):\n    return a + b\n"),
    "token ids": pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7, 8])),
    "truncated text": pb.GenerateRequest(
        text="x = 1\n" * 10, sampling=pb.SamplingOptions(max_tokens=2, truncate_prompt_tokens=7)
    ),
}


def tokenize(
    pipeline: RecordingPipeline, request: pb.GenerateRequest | UndecodableRequest, context: GrpcContext | None = None
) -> Any:
    return asyncio.run(GrpcService(pipeline).tokenize(request, context or GrpcContext()))


def refusal(pipeline: RecordingPipeline, request: Any, metadata: list[tuple[str, str]] | None = None) -> GrpcContext:
    context = GrpcContext(metadata)
    with pytest.raises(GrpcCallFailed):
        tokenize(pipeline, request, context)
    return context


@pytest.mark.parametrize("name", list(REQUESTS))
def test_the_ids_are_the_prompt_generate_sends(name: str) -> None:
    pipeline = RecordingPipeline()
    request = REQUESTS[name]
    answer = tokenize(pipeline, request)
    assert pipeline.sent == []  # nothing ran
    sent = send_grpc(pipeline, request)
    assert list(answer.token_ids) == list(sent.prompt_token_ids) and answer.max_model_len == 4096
    if name == "truncated text":
        assert len(answer.token_ids) == 7
    if name == "token ids":
        assert list(answer.token_ids) == [5, 6, 7, 8]


def test_a_chats_ids_are_https_tokenize_of_the_same_chat() -> None:
    pipeline = RecordingPipeline()
    tools = [
        {"type": "function", "function": {"name": "open_file", "description": "Open a file.", "parameters": SCHEMA}}
    ]
    body = {"messages": [{"role": "user", "content": QUESTION.content}], "tools": tools}
    response = asyncio.run(ServingTokens(pipeline).tokenize(http_request(body), "request-1"))
    http = json.loads(bytes(response.body))
    answer = tokenize(pipeline, REQUESTS["chat with tools"])
    assert list(answer.token_ids) == http["tokens"] and answer.max_model_len == http["max_model_len"]


def test_a_prompt_without_room_for_its_max_tokens_is_counted_where_generate_refuses_it() -> None:
    pipeline = RecordingPipeline()
    request = pb.GenerateRequest(text="hello there", sampling=pb.SamplingOptions(max_tokens=4096))
    assert grpc_refusal(pipeline, request).code == grpc.StatusCode.INVALID_ARGUMENT
    assert len(tokenize(pipeline, request).token_ids) == len(pipeline.tokenizer.encode("hello there"))


@pytest.mark.parametrize(
    ("request_message", "field"),
    [
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 99999])), "token_ids"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])), "token_ids"),
        (pb.GenerateRequest(), "input"),
        (pb.GenerateRequest(text=""), "text"),
        (pb.GenerateRequest(model="other", text="hi"), "model"),
        (pb.GenerateRequest(messages=pb.Messages(messages=[QUESTION]), tools=[pb.Tool(name="bad name")]), "tools[0]"),
    ],
)
def test_bad_requests_are_invalid_argument_naming_the_field(request_message: pb.GenerateRequest, field: str) -> None:
    context = refusal(RecordingPipeline(), request_message)
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and f"'{field}" in context.details, context.details


def test_an_undecodable_request_and_a_missing_key_are_refused() -> None:
    context = refusal(RecordingPipeline(), UndecodableRequest("rayturn.v1.GenerateRequest", 3))
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and "GenerateRequest" in context.details
    keyed = RecordingPipeline(KeyTable.build([KEY], {}))
    for metadata in ([], [("authorization", "Bearer sk-wrong")]):
        assert refusal(keyed, REQUESTS["text"], metadata).code == grpc.StatusCode.UNAUTHENTICATED
    answer = tokenize(keyed, REQUESTS["text"], GrpcContext([("authorization", f"Bearer {KEY}")]))
    assert len(answer.token_ids) > 0
