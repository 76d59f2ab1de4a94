"""Which class a call carries to the decode pool, through each API's whole ingress path (no cluster: the decode
pool is replaced by a recorder of the calls sent to it): body over header over the key's default over the call's
kind, and bad values answered in each API's own shape before anything is sent."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

pytest.importorskip("ray")

from ingress_recorder import APIS, GrpcContext, RecordingPipeline, send_grpc, send_http

from rayturn.api.grpc_service import GrpcCallFailed
from rayturn.api.tenants import KeyTable
from rayturn.protos import rayturn_pb2 as pb

BATCH_KEY, PEOPLE_KEY = "sk-batch", "sk-people"
USER = {"role": "user", "content": "hi"}
TOOL_RESULT = [USER, {"role": "assistant", "content": "ls"}, {"role": "tool", "content": "a.py", "tool_call_id": "1"}]


@pytest.fixture(scope="module")
def pipeline() -> RecordingPipeline:
    keys = KeyTable.build([], {"batch": [BATCH_KEY], "people": [PEOPLE_KEY]}, priorities={"batch": "background"})
    return RecordingPipeline(keys)


def call_http(
    pipeline: RecordingPipeline, api: str, extra: dict[str, Any], headers: dict[str, str], key: str = PEOPLE_KEY
) -> tuple[int, dict[str, Any], str | None]:
    """The status, the body, and the class of the call sent to the decode pool ("nothing sent": none sent)."""
    status, body, sent = send_http(pipeline, api, extra, {"authorization": f"Bearer {key}", **headers})
    return status, body, sent.priority if sent is not None else "nothing sent"


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


def call_grpc(pipeline: RecordingPipeline, request: pb.GenerateRequest, context: GrpcContext) -> str | None:
    return send_grpc(pipeline, request, context).priority


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
