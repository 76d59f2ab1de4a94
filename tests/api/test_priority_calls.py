"""Which class a call carries to the decode pool, through each API's whole ingress path (no cluster: the decode
pool is replaced by a recorder of the calls sent to it): body over header over the key's default over the call's
kind, and bad values answered in each API's own shape before anything is sent."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

pytest.importorskip("ray")

from starlette.requests import Request

from rayturn.api.call_result import CallResult
from rayturn.api.grpc_service import GrpcCallFailed, GrpcService
from rayturn.api.pipeline import CallPipeline, Steps
from rayturn.api.serving_chat import ServingChat
from rayturn.api.serving_completion import ServingCompletion
from rayturn.api.serving_messages import ServingMessages
from rayturn.api.serving_responses import ServingResponses
from rayturn.api.settings import IngressSettings
from rayturn.api.tenants import KeyTable
from rayturn.messages import Call
from rayturn.protos import rayturn_pb2 as pb

BATCH_KEY, PEOPLE_KEY = "sk-batch", "sk-people"
USER = {"role": "user", "content": "hi"}
TOOL_RESULT = [USER, {"role": "assistant", "content": "ls"}, {"role": "tool", "content": "a.py", "tool_call_id": "1"}]
APIS: dict[str, tuple[type[Any], dict[str, Any]]] = {
    "chat": (ServingChat, {"messages": [USER], "max_tokens": 2}),
    "completions": (ServingCompletion, {"prompt": "hi", "max_tokens": 2}),
    "messages": (ServingMessages, {"messages": [USER], "max_tokens": 2}),
    "responses": (ServingResponses, {"input": "hi", "max_output_tokens": 2}),
}


class RecordingPipeline(CallPipeline):
    """The ingress's real pipeline, whose calls are recorded instead of sent to a decode pool."""

    def __init__(self) -> None:
        keys = KeyTable.build([], {"batch": [BATCH_KEY], "people": [PEOPLE_KEY]}, priorities={"batch": "background"})
        super().__init__(
            None, None, None, IngressSettings(model="tiny", served_model_name="tiny", page_size=16, keys=keys)
        )
        self.sent: list[Call] = []

    async def start(self, call: Call) -> tuple[CallResult, Steps, Any]:
        self.sent.append(call)
        return CallResult(completions={}, request_id=call.request_id), _no_steps(), ()


async def _no_steps() -> AsyncIterator[tuple[Any, ...]]:
    return
    yield ()


@pytest.fixture(scope="module")
def pipeline() -> RecordingPipeline:
    return RecordingPipeline()


def http_request(body: dict[str, Any], headers: dict[str, str]) -> Request:
    raw = json.dumps(body).encode()
    header_list = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    header_list += [(name.lower().encode(), value.encode()) for name, value in headers.items()]
    scope = {"type": "http", "method": "POST", "path": "/", "headers": header_list, "query_string": b""}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    return Request(scope, receive)


def call_http(
    pipeline: RecordingPipeline, api: str, extra: dict[str, Any], headers: dict[str, str], key: str = PEOPLE_KEY
) -> tuple[int, dict[str, Any], str | None]:
    """The status, the body, and the class of the call sent to the decode pool (None: none sent)."""
    serving, body = APIS[api]
    before = len(pipeline.sent)
    request = http_request({**body, **extra}, {"authorization": f"Bearer {key}", **headers})
    response = asyncio.run(serving(pipeline).create(request, "request-1"))
    sent = pipeline.sent[before:]
    assert len(sent) <= 1
    return response.status_code, json.loads(bytes(response.body)), sent[0].priority if sent else "nothing sent"


@pytest.mark.parametrize("api", list(APIS))
@pytest.mark.parametrize(
    ("extra", "headers", "key", "expected"),
    [
        ({"priority": "background"}, {"x-rayturn-priority": "continuation"}, PEOPLE_KEY, "background"),
        ({}, {"x-rayturn-priority": "continuation"}, BATCH_KEY, "continuation"),
        ({"priority": "interactive"}, {}, BATCH_KEY, "interactive"),
        ({}, {}, BATCH_KEY, "background"),
        ({"priority": 0}, {}, BATCH_KEY, "background"),  # vLLM's default says nothing
        ({"priority": -2}, {}, BATCH_KEY, "continuation"),
        ({}, {}, PEOPLE_KEY, None),  # by the call's kind, on the replica
    ],
    ids=["body-over-header", "header-over-key", "body-over-key", "key", "vllm-zero", "vllm-negative", "kind"],
)
def test_the_class_sent_is_body_then_header_then_key_then_kind(
    pipeline: RecordingPipeline, api: str, extra: dict[str, Any], headers: dict[str, str], key: str, expected: str
) -> None:
    status, body, sent = call_http(pipeline, api, extra, headers, key)
    assert status == 200, body
    assert sent == expected


def test_a_call_of_no_class_keeps_its_kind_for_the_replica(pipeline: RecordingPipeline) -> None:
    call_http(pipeline, "chat", {"messages": TOOL_RESULT}, {})
    assert (pipeline.sent[-1].priority, pipeline.sent[-1].continues_turn) == (None, True)


@pytest.mark.parametrize("api", list(APIS))
@pytest.mark.parametrize(
    ("extra", "headers"), [({"priority": "urgent"}, {}), ({}, {"x-rayturn-priority": "urgent"})], ids=["body", "header"]
)
def test_a_bad_class_is_a_400_in_the_apis_own_shape_and_nothing_is_sent(
    pipeline: RecordingPipeline, api: str, extra: dict[str, Any], headers: dict[str, str]
) -> None:
    status, body, sent = call_http(pipeline, api, extra, headers)
    assert (status, sent) == (400, "nothing sent")
    if api == "messages":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    else:
        assert (body["error"]["type"], body["error"]["param"]) == ("invalid_request_error", "priority")
    assert "continuation, interactive, background, batch" in body["error"]["message"]


# -- gRPC -----------------------------------------------------------------------------------------------------------


class GrpcContext:
    def __init__(self, metadata: list[tuple[str, str]]) -> None:
        self.metadata = metadata
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self.metadata

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


def call_grpc(pipeline: RecordingPipeline, request: pb.GenerateRequest, context: GrpcContext) -> str | None:
    before = len(pipeline.sent)

    async def run() -> None:
        async for _ in GrpcService(pipeline).generate(request, context):
            pass

    asyncio.run(run())
    (sent,) = pipeline.sent[before:]
    return sent.priority


@pytest.mark.parametrize(
    ("field", "metadata", "key", "expected"),
    [
        ("batch", [("x-rayturn-priority", "continuation")], PEOPLE_KEY, "background"),
        ("", [("x-rayturn-priority", "continuation")], BATCH_KEY, "continuation"),
        ("", [], BATCH_KEY, "background"),
        ("", [], PEOPLE_KEY, None),
    ],
    ids=["field-over-metadata", "metadata-over-key", "key", "kind"],
)
@pytest.mark.parametrize("chat", [True, False], ids=["messages", "text"])
def test_grpc_sends_the_field_then_the_metadata_then_the_keys_class(
    pipeline: RecordingPipeline, field: str, metadata: list[tuple[str, str]], key: str, expected: str | None, chat: bool
) -> None:
    prompt: dict[str, Any] = {"messages": pb.Messages(messages=[pb.ChatMessage(role="user", content="hi")])}
    request = pb.GenerateRequest(**(prompt if chat else {"text": "hi"}), priority=field)
    context = GrpcContext([("authorization", f"Bearer {key}"), *metadata])
    assert call_grpc(pipeline, request, context) == expected


@pytest.mark.parametrize(
    ("field", "metadata"), [("urgent", []), ("", [("x-rayturn-priority", "urgent")])], ids=["field", "metadata"]
)
def test_a_bad_grpc_class_is_invalid_argument(pipeline: RecordingPipeline, field: str, metadata: list[Any]) -> None:
    context = GrpcContext([("authorization", f"Bearer {PEOPLE_KEY}"), *metadata])
    with pytest.raises(GrpcCallFailed):
        call_grpc(pipeline, pb.GenerateRequest(text="hi", priority=field), context)
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "expected one of continuation, interactive, background, batch, got 'urgent'" in context.details
