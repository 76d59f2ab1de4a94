"""Each API's whole ingress path without a cluster: the ingress's real pipeline, whose calls are recorded instead of
sent to a decode pool, and requests made for it (HTTP bodies, gRPC requests with their metadata)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import jsonschema
import pytest
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
from rayturn.messages import Call, Step
from rayturn.protos import rayturn_pb2 as pb

USER = {"role": "user", "content": "hi"}
# Each HTTP API that makes a call: its serving class, its path, and a small valid body.
APIS: dict[str, tuple[type[Any], str, dict[str, Any]]] = {
    "chat": (ServingChat, "/v1/chat/completions", {"messages": [USER], "max_tokens": 2}),
    "completions": (ServingCompletion, "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    "messages": (ServingMessages, "/v1/messages", {"messages": [USER], "max_tokens": 2}),
    "responses": (ServingResponses, "/v1/responses", {"input": "hi", "max_output_tokens": 2}),
}


class RecordingPipeline(CallPipeline):
    """The ingress's real pipeline (``tiny``, pages of 16 tokens), whose calls are recorded instead of sent."""

    def __init__(self, keys: KeyTable | None = None) -> None:
        settings = IngressSettings(model="tiny", served_model_name="tiny", page_size=16, keys=keys or KeyTable())
        super().__init__(None, None, None, settings)
        self.sent: list[Call] = []

    async def start(self, call: Call) -> tuple[CallResult, Steps, Any]:
        self.sent.append(call)
        return CallResult(completions={}, request_id=call.request_id), _no_steps(), ()


async def _no_steps() -> AsyncIterator[tuple[Any, ...]]:
    return
    yield ()


class ScriptedDecode:
    """A decode pool handle whose every call streams ``steps`` (``generate.options(stream=True).remote(call)``)."""

    def __init__(self, steps: Sequence[Step]) -> None:
        self.generate = self
        self.steps = tuple(steps)
        self.calls: list[Call] = []

    def options(self, stream: bool = False) -> ScriptedDecode:
        return self

    def remote(self, call: Call) -> ScriptedDecode:
        self.calls.append(call)
        return self

    def cancel(self) -> None:
        pass

    async def __aiter__(self) -> AsyncIterator[Step]:
        for step in self.steps:
            yield step


def http_request(body: dict[str, Any], headers: dict[str, str] | None = None) -> Request:
    raw = json.dumps(body).encode()
    header_list = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    header_list += [(name.lower().encode(), value.encode()) for name, value in (headers or {}).items()]
    scope = {"type": "http", "method": "POST", "path": "/", "headers": header_list, "query_string": b""}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    return Request(scope, receive)


def send_http(
    pipeline: RecordingPipeline, api: str, extra: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any], Call | None]:
    """The status, the body, and the call sent to the decode pool (None: none sent) of ``api``'s small body with
    ``extra`` fields."""
    serving, _, body = APIS[api]
    before = len(pipeline.sent)
    response = asyncio.run(serving(pipeline).create(http_request({**body, **extra}, headers), "request-1"))
    sent = pipeline.sent[before:]
    assert len(sent) <= 1
    return response.status_code, json.loads(bytes(response.body)), sent[0] if sent else None


class GrpcContext:
    """What ``GrpcService.generate`` reads of a call's context (metadata) and writes to it (a failure's status)."""

    def __init__(self, metadata: list[tuple[str, str]] | None = None) -> None:
        self.metadata = metadata or []
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self.metadata

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


def send_grpc(pipeline: RecordingPipeline, request: pb.GenerateRequest, context: GrpcContext | None = None) -> Call:
    """The one call a ``Generate`` request sent to the decode pool (``GrpcCallFailed`` when it was refused)."""
    before = len(pipeline.sent)

    async def run() -> None:
        async for _ in GrpcService(pipeline).generate(request, context or GrpcContext()):
            pass

    asyncio.run(run())
    (sent,) = pipeline.sent[before:]
    return sent


def grpc_refusal(pipeline: RecordingPipeline, request: pb.GenerateRequest) -> GrpcContext:
    """The context of a ``Generate`` request that was refused (``GrpcCallFailed``), its status set."""
    context = GrpcContext()
    with pytest.raises(GrpcCallFailed):
        send_grpc(pipeline, request, context)
    return context


def request_schema(document: dict[str, Any], api: str) -> jsonschema.Draft202012Validator:
    """The body schema ``document`` (the OpenAPI document) publishes for ``api``."""
    schema = document["paths"][APIS[api][1]]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return jsonschema.Draft202012Validator(schema)


def assert_refused(
    pipeline: RecordingPipeline, api: str, extra: dict[str, Any], param: str, said: str, document: dict[str, Any]
) -> None:
    """``api``'s small body with ``extra`` is a 400 naming ``param`` and saying ``said``, nothing is sent, and the
    schema ``document`` publishes refuses that body too."""
    status, body, call = send_http(pipeline, api, extra)
    assert (status, call) == (400, None), body
    assert body["error"]["param"] == param and said in body["error"]["message"], body
    assert not request_schema(document, api).is_valid({**APIS[api][2], **extra})
