"""Session ids from HTTP headers, the OpenAI body and gRPC metadata; call classification."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from starlette.requests import Request

from rayturn.api.errors import APIError
from rayturn.api.serving import HTTPServing
from rayturn.api.session import (
    AGENT_SESSION_HEADERS,
    MAX_SESSION_ID_CHARS,
    SESSION_HEADERS,
    classify_call,
    header_session,
    session_id_from_grpc_metadata,
    session_id_from_headers,
)


def test_x_session_id_wins_over_agent_headers_and_body() -> None:
    headers = {"X-Session-Id": "ours", "x-claude-code-session-id": "claude", "session_id": "codex"}
    assert session_id_from_headers(headers, {"user": "someone"}) == "ours"


@pytest.mark.parametrize("header", AGENT_SESSION_HEADERS)
def test_each_agent_header_is_read_case_insensitively(header: str) -> None:
    assert session_id_from_headers({header.upper(): "abc-123"}) == "abc-123"


def test_agent_headers_are_trusted_in_declared_order() -> None:
    headers = {"x-session-affinity": "opencode", "X-Claude-Code-Session-Id": "claude", "session_id": "codex"}
    assert session_id_from_headers(headers) == "claude"
    assert session_id_from_headers({"x-session-affinity": "opencode", "session_id": "codex"}) == "codex"


def test_body_user_field_is_the_last_resort() -> None:
    assert session_id_from_headers({"content-type": "application/json"}, {"user": "u-7"}) == "u-7"
    assert session_id_from_headers({}, {"model": "m"}) is None
    assert session_id_from_headers({}) is None


def test_empty_and_blank_values_are_skipped() -> None:
    headers = {"x-session-id": "", "x-claude-code-session-id": "   ", "session_id": "codex"}
    assert session_id_from_headers(headers, {"user": "u"}) == "codex"
    assert session_id_from_headers({"x-session-id": ""}, {"user": ""}) is None


def test_values_are_trimmed() -> None:
    assert session_id_from_headers({"x-session-id": " abc "}) == "abc"


def test_overlong_value_is_rejected_naming_the_header() -> None:
    with pytest.raises(ValueError, match="x-claude-code-session-id"):
        session_id_from_headers({"X-Claude-Code-Session-Id": "a" * (MAX_SESSION_ID_CHARS + 1)})
    assert session_id_from_headers({"x-session-id": "a" * MAX_SESSION_ID_CHARS}) == "a" * MAX_SESSION_ID_CHARS


def test_header_session_names_the_header_it_read() -> None:
    headers = {"X-Session-Id": " ", "Session_Id": "codex", "x-opencode-session": "oc"}
    assert header_session(headers) == ("codex", "session_id")
    assert header_session({"content-type": "application/json"}) is None


def http_request(headers: dict[str, str]) -> Request:
    raw = [(name.encode(), value.encode()) for name, value in headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": raw})


def session_refusal(headers: dict[str, str], body_session: tuple[str | None, str]) -> APIError:
    serving = HTTPServing(SimpleNamespace(telemetry=None, served_model="tiny"))  # type: ignore[arg-type]
    with pytest.raises(APIError) as caught:
        serving.call_context(http_request(headers), body_session)
    assert caught.value.status_code == 400
    return caught.value


@pytest.mark.parametrize("header", SESSION_HEADERS)
def test_an_overlong_session_header_is_blamed_on_the_header(header: str) -> None:
    too_long = "s" * (MAX_SESSION_ID_CHARS + 44)
    for body_session in ((None, "user"), ("ok", "prompt_cache_key"), (None, "metadata.user_id")):
        error = session_refusal({header: too_long}, body_session)
        assert error.param == header
        assert error.message == f"session id in {header!r} is 300 characters, the limit is {MAX_SESSION_ID_CHARS}"


def test_an_overlong_body_session_is_blamed_on_its_field_and_a_header_wins_over_it() -> None:
    too_long = "u" * (MAX_SESSION_ID_CHARS + 1)
    for field in ("user", "prompt_cache_key", "metadata.user_id"):
        error = session_refusal({"x-session-id": "  "}, (too_long, field))
        assert error.param == field and repr(field) in error.message
    serving = HTTPServing(SimpleNamespace(telemetry=None, served_model="tiny"))  # type: ignore[arg-type]
    session_id, _ = serving.call_context(http_request({"x-session-id": "ours"}), (too_long, "user"))
    assert session_id == "ours"


def test_overlong_or_non_string_user_field_is_rejected() -> None:
    with pytest.raises(ValueError, match="'user'"):
        session_id_from_headers({}, {"user": "u" * (MAX_SESSION_ID_CHARS + 1)})
    with pytest.raises(ValueError, match="'user'"):
        session_id_from_headers({}, {"user": 42})


def test_grpc_metadata_session_id_then_x_session_id() -> None:
    assert session_id_from_grpc_metadata([("x-session-id", "b"), ("session_id", "a")]) == "a"
    assert session_id_from_grpc_metadata([("authorization", "t"), ("x-session-id", "b")]) == "b"
    assert session_id_from_grpc_metadata([("session_id", ""), ("x-session-id", "b")]) == "b"
    assert session_id_from_grpc_metadata([("trace-bin", b"\x00"), ("other", "x")]) is None
    assert session_id_from_grpc_metadata([]) is None


def test_grpc_metadata_overlong_value_is_rejected() -> None:
    with pytest.raises(ValueError, match="session_id"):
        session_id_from_grpc_metadata([("session_id", "s" * (MAX_SESSION_ID_CHARS + 1))])


def test_classify_openai_tool_result_as_continuation() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "fix the bug"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    assert classify_call(messages) == "tool_continuation"
    answered = [*messages, {"role": "assistant", "content": "done"}, {"role": "user", "content": "thanks"}]
    assert classify_call(answered) == "user"


def test_classify_legacy_function_result_as_continuation() -> None:
    assert classify_call([{"role": "function", "name": "f", "content": "1"}]) == "tool_continuation"


def test_classify_anthropic_tool_result_part_as_continuation() -> None:
    tool_result = {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "ok"},
            {"type": "text", "text": "and here is more context"},
        ],
    }
    assert classify_call([{"role": "user", "content": "hi"}, tool_result]) == "tool_continuation"
    plain_parts = {"role": "user", "content": [{"type": "text", "text": "new question"}]}
    assert classify_call([tool_result, plain_parts]) == "user"


def test_classify_empty_conversation_as_user() -> None:
    assert classify_call([]) == "user"


def test_lifecycle_hints_from_headers_and_metadata() -> None:
    from rayturn.api.session import LifecycleHints, lifecycle_hints

    assert lifecycle_hints({"X-Rayturn-Call": "tool", "x-rayturn-after": " User "}) == LifecycleHints(
        "tool_continuation", "user"
    )
    assert lifecycle_hints({}) == LifecycleHints()
    assert lifecycle_hints([("x-rayturn-call", "user"), ("x-rayturn-after-bin", b"\x00")]) == LifecycleHints("user")
    with pytest.raises(ValueError, match="'x-rayturn-after' must be one of tool, user, got 'later'"):
        lifecycle_hints({"x-rayturn-after": "later"})
