"""The per-request speculative decoding switch through each API's whole ingress path (no cluster: the decode pool
is replaced by a recorder of the calls sent to it): the body field (gRPC: ``sampling.speculative``) reaches the
call's sampling parameters, absent or null leaves the server's default, and a value of the wrong type is a 400
naming the field, in the API's own shape, before anything is sent; the published schemas agree."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import pytest

pytest.importorskip("ray")

from starlette.requests import Request

from rayturn.api.call_result import CallResult
from rayturn.api.grpc_service import GrpcService
from rayturn.api.openapi import openapi_document
from rayturn.api.pipeline import CallPipeline, Steps
from rayturn.api.serving_chat import ServingChat
from rayturn.api.serving_completion import ServingCompletion
from rayturn.api.serving_messages import ServingMessages
from rayturn.api.serving_responses import ServingResponses
from rayturn.api.settings import IngressSettings
from rayturn.messages import Call
from rayturn.protos import rayturn_pb2 as pb

USER = {"role": "user", "content": "hi"}
APIS: dict[str, tuple[type[Any], str, dict[str, Any]]] = {
    "chat": (ServingChat, "/v1/chat/completions", {"messages": [USER], "max_tokens": 2}),
    "completions": (ServingCompletion, "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    "messages": (ServingMessages, "/v1/messages", {"messages": [USER], "max_tokens": 2}),
    "responses": (ServingResponses, "/v1/responses", {"input": "hi", "max_output_tokens": 2}),
}
DOCUMENT = openapi_document("tiny", vocab_size=256)
NOTHING_SENT = "nothing sent"


class RecordingPipeline(CallPipeline):
    """The ingress's real pipeline, whose calls are recorded instead of sent to a decode pool."""

    def __init__(self) -> None:
        super().__init__(None, None, None, IngressSettings(model="tiny", served_model_name="tiny", page_size=16))
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


def http_request(body: dict[str, Any]) -> Request:
    raw = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    scope = {"type": "http", "method": "POST", "path": "/", "headers": headers, "query_string": b""}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    return Request(scope, receive)


def call_http(pipeline: RecordingPipeline, api: str, extra: dict[str, Any]) -> tuple[int, dict[str, Any], object]:
    """The status, the body, and the switch of the call sent to the decode pool (``NOTHING_SENT``: none sent)."""
    serving, _, body = APIS[api]
    before = len(pipeline.sent)
    response = asyncio.run(serving(pipeline).create(http_request({**body, **extra}), "request-1"))
    sent = pipeline.sent[before:]
    assert len(sent) <= 1
    return response.status_code, json.loads(bytes(response.body)), sent[0].params.speculative if sent else NOTHING_SENT


def body_schema(api: str) -> jsonschema.Draft202012Validator:
    path = APIS[api][1]
    return jsonschema.Draft202012Validator(
        DOCUMENT["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    )


@pytest.mark.parametrize("api", list(APIS))
@pytest.mark.parametrize(
    ("extra", "expected"),
    [({"speculative": True}, True), ({"speculative": False}, False), ({}, None), ({"speculative": None}, None)],
    ids=["on", "off", "absent", "null"],
)
def test_the_body_field_reaches_the_calls_sampling(
    pipeline: RecordingPipeline, api: str, extra: dict[str, Any], expected: bool | None
) -> None:
    status, body, sent = call_http(pipeline, api, extra)
    assert status == 200, body
    assert sent is expected
    if extra.get("speculative") is not None:
        body_schema(api).validate({**APIS[api][2], **extra})


@pytest.mark.parametrize("api", list(APIS))
@pytest.mark.parametrize("value", ["yes", 1, 0, {"enabled": True}, [True]])
def test_a_value_that_is_not_a_boolean_is_a_400_naming_the_field(
    pipeline: RecordingPipeline, api: str, value: object
) -> None:
    status, body, sent = call_http(pipeline, api, {"speculative": value})
    assert (status, sent) == (400, NOTHING_SENT)
    assert body["error"]["type"] == "invalid_request_error"
    assert "Invalid type for 'speculative': expected a boolean" in body["error"]["message"]
    if api == "messages":
        assert body["type"] == "error"
    else:
        assert body["error"]["param"] == "speculative"
    assert not body_schema(api).is_valid({**APIS[api][2], "speculative": value})


class GrpcContext:
    def invocation_metadata(self) -> list[tuple[str, str]]:
        return []


@pytest.mark.parametrize("speculative", [True, False, None], ids=["on", "off", "unset"])
def test_grpc_sends_sampling_speculative(pipeline: RecordingPipeline, speculative: bool | None) -> None:
    sampling = pb.SamplingOptions() if speculative is None else pb.SamplingOptions(speculative=speculative)
    before = len(pipeline.sent)

    async def run() -> None:
        async for _ in GrpcService(pipeline).generate(pb.GenerateRequest(text="hi", sampling=sampling), GrpcContext()):
            pass

    asyncio.run(run())
    (sent,) = pipeline.sent[before:]
    assert sent.params.speculative is speculative
