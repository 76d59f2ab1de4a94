"""A call's id from its ``x-request-id`` (``api/request_ids.py``), through the ingress's middleware and its error
shapes, on a small app of its own (the cluster tests check it behind Serve's proxy)."""

from __future__ import annotations

import re

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from rayturn.api.errors import APIError
from rayturn.api.ingress import error_for_path
from rayturn.api.request_ids import MAX_CLIENT_ID, RequestIdMiddleware, client_request_id, request_id_of

SUFFIX = re.compile(r"-[0-9a-f]{12}")


@pytest.fixture()
def seen() -> list[str]:
    """The ids the route saw."""
    return []


@pytest.fixture()
def client(seen: list[str]) -> TestClient:
    async def echo(request: Request) -> JSONResponse:
        seen.append(request_id_of(request))
        return JSONResponse({"id": seen[-1]})

    app = Starlette(routes=[Route(path, echo, methods=["POST"]) for path in ("/v1/chat/completions", "/v1/messages")])
    app.add_middleware(RequestIdMiddleware, failure=error_for_path)
    return TestClient(app)


def test_without_the_header_a_call_gets_a_minted_id(client: TestClient) -> None:
    first = client.post("/v1/chat/completions").json()["id"]
    second = client.post("/v1/chat/completions").json()["id"]
    assert re.fullmatch(r"[0-9a-f]{32}", first) and re.fullmatch(r"[0-9a-f]{32}", second)
    assert first != second


def test_the_call_id_starts_with_the_client_value_and_two_calls_with_one_value_stay_apart(client: TestClient) -> None:
    value = "trace-42/span:7=+"
    ids = [client.post("/v1/chat/completions", headers={"X-Request-Id": value}).json()["id"] for _ in range(2)]
    for call_id in ids:
        assert call_id.startswith(f"{value}-") and SUFFIX.fullmatch(call_id[len(value) :]), call_id
    assert ids[0] != ids[1]


def test_a_value_of_the_longest_length_is_taken(client: TestClient) -> None:
    value = "a" * MAX_CLIENT_ID
    assert client.post("/v1/chat/completions", headers={"X-Request-Id": value}).json()["id"].startswith(value + "-")


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("a" * (MAX_CLIENT_ID + 1), f"must be 1-{MAX_CLIENT_ID} characters long; it has {MAX_CLIENT_ID + 1}"),
        ("two words", "only printable ASCII characters, no spaces; it holds ' '"),
        ("caf\u00e9", "only printable ASCII characters"),
    ],
)
def test_a_bad_value_is_a_400_in_openai_shape_naming_the_header(
    client: TestClient, seen: list[str], value: str, words: str
) -> None:
    # A str header value must be ASCII in httpx: the non-ASCII one goes as bytes, as a client may send it.
    headers = {"X-Request-Id": value.encode()}
    response = client.post("/v1/chat/completions", headers=headers)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "x-request-id" and error["code"] == "invalid_request_id"
    assert "'x-request-id'" in error["message"] and words in error["message"], error["message"]
    assert seen == []  # the route never ran


def test_a_bad_value_on_the_anthropic_route_is_a_400_in_anthropic_shape(client: TestClient, seen: list[str]) -> None:
    response = client.post("/v1/messages", headers={"X-Request-Id": "has space"})
    assert response.status_code == 400
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "'x-request-id'" in body["error"]["message"]
    assert seen == []


def test_the_check_alone() -> None:
    assert client_request_id(None) is None
    assert client_request_id("req_01ABC") == "req_01ABC"
    for bad in ("", "tab\there", "x" * (MAX_CLIENT_ID + 1)):
        with pytest.raises(APIError) as err:
            client_request_id(bad)
        assert err.value.status_code == 400 and err.value.param == "x-request-id"


def test_a_request_that_did_not_pass_the_middleware_gets_a_minted_id() -> None:
    request = Request({"type": "http", "method": "POST", "path": "/", "headers": []})
    assert re.fullmatch(r"[0-9a-f]{32}", request_id_of(request))
