"""The per-request speculative decoding switch through each API's whole ingress path (no cluster: the decode pool
is replaced by a recorder of the calls sent to it): the body field (gRPC: ``sampling.speculative``) reaches the
call's sampling parameters, absent or null leaves the server's default, and a value of the wrong type is a 400
naming the field, in the API's own shape, before anything is sent; the published schemas agree."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

pytest.importorskip("ray")

from ingress_recorder import APIS, RecordingPipeline, request_schema, send_grpc, send_http

from rayturn.api.openapi import openapi_document
from rayturn.protos import rayturn_pb2 as pb

DOCUMENT = openapi_document("tiny", vocab_size=256)
NOTHING_SENT = "nothing sent"


@pytest.fixture(scope="module")
def pipeline() -> RecordingPipeline:
    return RecordingPipeline()


def call_http(pipeline: RecordingPipeline, api: str, extra: dict[str, Any]) -> tuple[int, dict[str, Any], object]:
    """The status, the body, and the switch of the call sent to the decode pool (``NOTHING_SENT``: none sent)."""
    status, body, sent = send_http(pipeline, api, extra)
    return status, body, sent.params.speculative if sent is not None else NOTHING_SENT


def body_schema(api: str) -> jsonschema.Draft202012Validator:
    return request_schema(DOCUMENT, api)


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


@pytest.mark.parametrize("speculative", [True, False, None], ids=["on", "off", "unset"])
def test_grpc_sends_sampling_speculative(pipeline: RecordingPipeline, speculative: bool | None) -> None:
    sampling = pb.SamplingOptions() if speculative is None else pb.SamplingOptions(speculative=speculative)
    sent = send_grpc(pipeline, pb.GenerateRequest(text="hi", sampling=sampling))
    assert sent.params.speculative is speculative
