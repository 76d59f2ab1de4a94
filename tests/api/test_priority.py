"""A call's class as each API reads it: body field (a name or vLLM's integer), header, gRPC field and metadata;
the 400 a bad one gets, the published schemas, and the per-key defaults of the server settings."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jsonschema
import pytest

from rayturn.api.anthropic_bodies import error_body
from rayturn.api.anthropic_request import parse_messages_request
from rayturn.api.chat_request import parse_chat_request
from rayturn.api.completion_request import parse_completion_request
from rayturn.api.errors import APIError
from rayturn.api.openapi import openapi_document
from rayturn.api.priority import grpc_priority, header_priority, requested_priority, vllm_priority
from rayturn.api.responses_request import parse_responses_request
from rayturn.api.settings import ServerSettings
from rayturn.api.tenants import key_tenant
from rayturn.cluster.config import ClusterConfig

MODEL = "tiny"
USER = {"role": "user", "content": "hi"}
BODIES: dict[str, tuple[dict[str, Any], Callable[[object, str], Any]]] = {
    "/v1/chat/completions": ({"messages": [USER]}, lambda body, model: parse_chat_request(body, model).priority),
    "/v1/completions": ({"prompt": "hi"}, lambda body, model: parse_completion_request(body, model).priority),
    "/v1/messages": (
        {"messages": [USER], "max_tokens": 2},
        lambda body, model: parse_messages_request(body, model).chat.priority,
    ),
    "/v1/responses": (
        {"input": "hi"},
        lambda body, model: (lambda parsed: (parsed.priority, parsed.chat().priority))(
            parse_responses_request(body, model)
        ),
    ),
}
DOCUMENT = openapi_document(MODEL, vocab_size=256)
GOOD = [
    ("background", "background"),
    ("batch", "background"),
    ("continuation", "continuation"),
    ("interactive", "interactive"),
    (-1, "continuation"),
    (0, None),
    (7, "background"),
    (2.0, "background"),  # an integer, as JSON writes one
]
BAD = ["urgent", "high", True, 1.5, {"class": "background"}, ["background"], 2**70]


def body_priority(path: str, value: object) -> str | None:
    body, read = BODIES[path]
    got = read({**body, "priority": value}, MODEL)
    if isinstance(got, tuple):  # Responses: the request's, and the chat call it becomes
        assert got[0] == got[1]
        return got[0]
    assert got is None or isinstance(got, str)
    return got


def body_schema(path: str) -> jsonschema.Draft202012Validator:
    schema = DOCUMENT["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize(("value", "expected"), GOOD)
def test_every_http_api_reads_the_body_field_and_its_schema_allows_it(
    path: str, value: object, expected: str | None
) -> None:
    assert body_priority(path, value) == expected
    body_schema(path).validate({**BODIES[path][0], "priority": value})


@pytest.mark.parametrize("path", list(BODIES))
def test_names_are_read_in_any_case_and_blank_or_absent_says_nothing(path: str) -> None:
    assert body_priority(path, " Batch ") == "background"
    assert body_priority(path, "") is None
    assert BODIES[path][1](BODIES[path][0], MODEL) in (None, (None, None))


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("value", BAD)
def test_a_bad_value_is_a_400_naming_priority_and_the_schema_refuses_it(path: str, value: object) -> None:
    with pytest.raises(APIError) as caught:
        body_priority(path, value)
    error = caught.value
    assert (error.status_code, error.param) == (400, "priority")
    assert "'priority'" in error.message
    if not isinstance(value, int):  # 2**70 is out of the int64 range: that is its message
        assert "continuation, interactive, background, batch" in error.message
    assert not body_schema(path).is_valid({**BODIES[path][0], "priority": value})


def test_the_errors_come_in_each_apis_own_shape() -> None:
    with pytest.raises(APIError) as caught:
        body_priority("/v1/messages", "urgent")
    assert error_body(caught.value) == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "Invalid 'priority': expected one of continuation, interactive, background, batch, "
            "got 'urgent'.",
        },
    }
    openai_shape = caught.value.to_dict()["error"]
    assert (openai_shape["type"], openai_shape["param"]) == ("invalid_request_error", "priority")


def test_vllm_integers_keep_vllms_order() -> None:
    """Lower runs first in vLLM; below 0 never runs later than saying nothing, above 0 never earlier."""
    assert [vllm_priority(value) for value in (-100, -1, 0, 1, 100)] == [
        "continuation",
        "continuation",
        None,
        "background",
        "background",
    ]


# -- header, gRPC field and metadata, and which wins -------------------------------------------------------------


def test_the_header_names_a_class_in_http_headers_and_grpc_metadata() -> None:
    assert header_priority({"X-Rayturn-Priority": "BATCH"}) == "background"
    assert header_priority([("x-rayturn-priority", "continuation"), ("other", b"\x00")]) == "continuation"
    assert header_priority({"x-rayturn-priority": "  "}) is None
    assert header_priority({}) is None
    for bad in ("-1", "urgent"):
        with pytest.raises(APIError, match=r"header 'x-rayturn-priority': expected one of continuation") as caught:
            header_priority({"x-rayturn-priority": bad})
        assert caught.value.param == "priority"


def test_the_body_wins_over_the_header_which_is_still_checked() -> None:
    header = {"x-rayturn-priority": "continuation"}
    assert requested_priority("background", header) == "background"
    assert requested_priority(None, header) == "continuation"
    assert requested_priority(None, {}) is None
    with pytest.raises(APIError, match="x-rayturn-priority"):
        requested_priority("background", {"x-rayturn-priority": "urgent"})


def test_the_grpc_field_wins_over_the_metadata_key() -> None:
    metadata = [("x-rayturn-priority", "continuation")]
    assert grpc_priority("batch", metadata) == "background"
    assert grpc_priority("", metadata) == "continuation"
    assert grpc_priority("", []) is None
    with pytest.raises(APIError, match=r"Invalid 'priority': expected one of") as caught:
        grpc_priority("urgent", metadata)
    assert (caught.value.status_code, caught.value.param) == (400, "priority")


# -- per key: server.tenant_priorities -----------------------------------------------------------------------------


def test_tenant_priorities_are_canonical_and_reach_the_key_table() -> None:
    own = key_tenant("sk-own")
    server = ServerSettings(
        api_keys=("sk-own",),
        tenant_keys={"batch-jobs": ("sk-batch",), "people": ("sk-people",)},
        tenant_priorities={"batch-jobs": "Batch", own: "continuation"},
    )
    assert dict(server.tenant_priorities) == {"batch-jobs": "background", own: "continuation"}
    keys = server.key_table("default")
    assert keys.default_priority("batch-jobs") == "background" and keys.default_priority(own) == "continuation"
    assert keys.default_priority("people") is None
    # A key's tenant may be named before its key is given (``rayturn serve --api-key``).
    assert dict(ServerSettings(tenant_priorities={"key-0123456789ab": "background"}).tenant_priorities)


@pytest.mark.parametrize(
    ("server", "match"),
    [
        (
            {"tenant_keys": {"team": ["sk-1"]}, "tenant_priorities": {"team": "urgent"}},
            r"server\.tenant_priorities\.team must be one of continuation, interactive, background, batch, "
            r"got 'urgent'",
        ),
        (
            {"tenant_keys": {"team": ["sk-1"]}, "tenant_priorities": {"teem": "background"}},
            r"server\.tenant_priorities\.teem names no tenant: expected a name of tenant_keys, or key-",
        ),
        ({"tenant_priorities": {"key-xyz": "background"}}, r"server\.tenant_priorities\.key-xyz names no tenant"),
        ({"tenant_priorities": {"team": 1}}, r"server\.tenant_priorities\.team must be a string"),
    ],
)
def test_bad_tenant_priorities_name_the_key(server: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ClusterConfig.from_dict({"server": server})


def test_tenant_priorities_survive_the_config_round_trip() -> None:
    config = ClusterConfig.from_dict(
        {"server": {"tenant_keys": {"batch": ["sk-b"]}, "tenant_priorities": {"batch": "batch"}}}
    )
    assert ClusterConfig.from_dict(config.to_dict()) == config
    assert config.to_dict()["server"]["tenant_priorities"] == {"batch": "background"}
