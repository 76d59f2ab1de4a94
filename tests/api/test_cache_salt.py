"""vLLM's ``cache_salt`` through each API's whole ingress path (no cluster: the decode pool is replaced by a
recorder of the calls sent to it): the call carries its tenant's salt joined with its own, its page hashes are
salted with that, and a bad salt is a 400 naming the field, in the API's own shape (gRPC: INVALID_ARGUMENT),
before anything is sent; the published schemas agree. vLLM's rules for a salt (a non-empty string of at most 128
characters without '@', '/', '\\' or NUL) are taken as they are, so a salt one server takes the other takes."""

from __future__ import annotations

from typing import Any

import grpc
import jsonschema
import pytest

pytest.importorskip("ray")

from ingress_recorder import (
    APIS,
    GrpcContext,
    RecordingPipeline,
    grpc_refusal,
    request_schema,
    send_grpc,
    send_http,
)

from rayturn.api.openapi import openapi_document
from rayturn.api.tenants import KeyTable
from rayturn.engine.page_hash import hash_pages, salt_owner, salted
from rayturn.messages import Call
from rayturn.protos import rayturn_pb2 as pb

TEAM_KEY = "sk-team"
DOCUMENT = openapi_document("tiny", vocab_size=256)
# Long enough for full pages of 16 tokens under every API's template.
LONG = "Refactor the module and keep its tests green. " * 3
PROMPTS: dict[str, dict[str, Any]] = {
    "chat": {"messages": [{"role": "user", "content": LONG}]},
    "completions": {"prompt": LONG},
    "messages": {"messages": [{"role": "user", "content": LONG}]},
    "responses": {"input": LONG},
}
GOOD = ["s", "x" * 128, "Zm9vYmFy+K3z=", "tenant salt with spaces", "naïve-ünïcode", "line\nbreak"]
BAD: list[tuple[object, str]] = [
    ("", "non-empty"),
    ("x" * 129, "at most 128"),
    ("a/b", "'/'"),
    ("a@b", "'@'"),
    ("a\\b", "'\\'"),
    ("a\x00b", "NUL"),
    (7, "Invalid type"),
    (["s"], "Invalid type"),
    ({"salt": "s"}, "Invalid type"),
    (True, "Invalid type"),
]


@pytest.fixture(scope="module")
def open_door() -> RecordingPipeline:
    """A cluster without keys: one tenant, whose own salt is none."""
    return RecordingPipeline()


@pytest.fixture(scope="module")
def with_keys() -> RecordingPipeline:
    return RecordingPipeline(KeyTable.build([], {"team": [TEAM_KEY]}))


def body_schema(api: str) -> jsonschema.Draft202012Validator:
    return request_schema(DOCUMENT, api)


def expected_hashes(pipeline: RecordingPipeline, call: Call, salt: str) -> tuple[bytes, ...]:
    usable = (len(call.prompt_token_ids) - 1) // pipeline.page_size
    prompt = list(call.prompt_token_ids[: usable * pipeline.page_size])
    return tuple(hash_pages(prompt, pipeline.page_size, pipeline.model_id, salt))


@pytest.mark.parametrize("api", list(APIS))
@pytest.mark.parametrize("keys", [False, True], ids=["no-keys", "tenant"])
def test_the_call_carries_its_tenants_salt_then_its_own_and_its_pages_are_hashed_with_it(
    open_door: RecordingPipeline, with_keys: RecordingPipeline, api: str, keys: bool
) -> None:
    pipeline, tenant = (with_keys, "team") if keys else (open_door, "")
    headers = {"authorization": f"Bearer {TEAM_KEY}"} if keys else {}
    calls = {}
    for salt in (None, "s1", "s2"):
        extra = {**PROMPTS[api], **({} if salt is None else {"cache_salt": salt})}
        status, body, call = send_http(pipeline, api, extra, headers)
        assert status == 200 and call is not None, body
        assert call.cache_salt == salted(tenant, salt) and salt_owner(call.cache_salt) == tenant
        assert len(call.page_hashes) >= 2
        assert call.page_hashes == expected_hashes(pipeline, call, call.cache_salt)
        calls[salt] = call
    assert calls[None].prompt_token_ids == calls["s1"].prompt_token_ids == calls["s2"].prompt_token_ids
    # The same prompt under three salts: three chains with no page in common.
    chains = [set(call.page_hashes) for call in calls.values()]
    assert not (chains[0] & chains[1]) and not (chains[0] & chains[2]) and not (chains[1] & chains[2])
    assert calls["s1"].page_keys != calls[None].page_keys


@pytest.mark.parametrize("api", list(APIS))
@pytest.mark.parametrize("salt", GOOD)
def test_vllms_salts_are_taken_and_the_schema_allows_them(open_door: RecordingPipeline, api: str, salt: str) -> None:
    status, body, call = send_http(open_door, api, {"cache_salt": salt})
    assert status == 200 and call is not None, body
    assert call.cache_salt == salted("", salt)
    body_schema(api).validate({**APIS[api][2], "cache_salt": salt})


@pytest.mark.parametrize("api", list(APIS))
def test_null_is_no_salt(open_door: RecordingPipeline, api: str) -> None:
    status, body, call = send_http(open_door, api, {"cache_salt": None})
    assert status == 200 and call is not None and call.cache_salt == "", body


@pytest.mark.parametrize("api", list(APIS))
@pytest.mark.parametrize(("value", "said"), BAD, ids=[f"bad-{i}" for i in range(len(BAD))])
def test_a_bad_salt_is_a_400_naming_it_in_the_apis_shape_and_nothing_is_sent(
    open_door: RecordingPipeline, api: str, value: object, said: str
) -> None:
    status, body, call = send_http(open_door, api, {"cache_salt": value})
    assert (status, call) == (400, None), body
    error = body["error"]
    assert error["type"] == "invalid_request_error"
    assert "'cache_salt'" in error["message"] and said in error["message"], error["message"]
    if api == "messages":
        assert body["type"] == "error"
    else:
        assert error["param"] == "cache_salt"
    assert not body_schema(api).is_valid({**APIS[api][2], "cache_salt": value})


# -- gRPC -----------------------------------------------------------------------------------------------------------

MESSAGES = pb.Messages(messages=[pb.ChatMessage(role="user", content=LONG)])


@pytest.mark.parametrize("prompt", [{"messages": MESSAGES}, {"text": LONG}, {"token_ids": pb.TokenIds(ids=[5] * 40)}])
@pytest.mark.parametrize("salt", ["", "s1"], ids=["unset", "salt"])
def test_grpc_sends_the_field_joined_with_the_keys_tenant(
    with_keys: RecordingPipeline, prompt: dict[str, Any], salt: str
) -> None:
    context = GrpcContext([("authorization", f"Bearer {TEAM_KEY}")])
    call = send_grpc(with_keys, pb.GenerateRequest(**prompt, cache_salt=salt), context)
    assert call.cache_salt == salted("team", salt or None)
    assert call.page_hashes and call.page_hashes == expected_hashes(with_keys, call, call.cache_salt)


@pytest.mark.parametrize(("value", "said"), [case for case in BAD if isinstance(case[0], str) and case[0]])
def test_a_bad_grpc_salt_is_invalid_argument(open_door: RecordingPipeline, value: str, said: str) -> None:
    context = grpc_refusal(open_door, pb.GenerateRequest(text="hi", cache_salt=value))
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "'cache_salt'" in context.details and said in context.details
