"""Anthropic Messages at the API edge: request validation into the chat form, bodies and stream events (checked
with the official ``anthropic`` SDK's types), usage accounting, error shapes."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import httpx2 as httpx
import pytest

anthropic = pytest.importorskip("anthropic")
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

from rayturn.api.anthropic_bodies import (  # noqa: E402
    MessageStream,
    count_tokens_body,
    error_body,
    message_body,
    messages_usage,
    stop_reason,
    text_block,
    thinking_block,
    tool_use_block,
    tool_use_id,
)
from rayturn.api.anthropic_request import (  # noqa: E402
    parse_count_tokens_request,
    parse_messages_request,
)
from rayturn.api.errors import APIError, authentication_failed, model_not_found, rate_limited, replica_unavailable  # noqa: E402
from rayturn.api.protocol import CachePoint  # noqa: E402
from rayturn.api.session import classify_call  # noqa: E402
from rayturn.engine.tool_calls import ToolCall  # noqa: E402

MODEL = "tiny"
EVENTS: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
WEATHER = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}], **fields}


def error_of(value: object) -> APIError:
    with pytest.raises(APIError) as caught:
        parse_messages_request(value, MODEL)
    return caught.value


def test_claude_code_shaped_request_becomes_the_chat_form() -> None:
    request = parse_messages_request(
        body(
            system=[
                {"type": "text", "text": "You are a CLI."},
                {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
            ],
            tools=[WEATHER],
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Weather?", "cache_control": {"type": "ephemeral"}}],
                },
                {"role": "system", "content": "The user switched to plan mode."},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "x"},
                        {"type": "text", "text": "Let me check."},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "sunny"}],
                        },
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_2",
                            "content": "boom",
                            "is_error": True,
                            "cache_control": {"type": "ephemeral", "ttl": "1h"},
                        },
                    ],
                },
            ],
            thinking={"type": "adaptive"},
            context_management={"edits": []},
            output_config={"effort": "high"},
            metadata={"user_id": json.dumps({"device_id": "d", "session_id": "sess-42"})},
            stream=True,
            stop_sequences=["END"],
            temperature=0.5,
            top_k=20,
        ),
        MODEL,
    )
    chat = request.chat
    assert [m["role"] for m in chat.messages] == ["system", "user", "system", "assistant", "tool", "tool"]
    assert chat.messages[0]["content"] == "You are a CLI.\nBe brief."
    assert chat.messages[2]["content"] == "The user switched to plan mode."
    assistant = chat.messages[3]
    assert assistant["content"] == "Let me check."
    assert assistant["reasoning_content"] == "hmm"  # the thinking this server returned goes back to the template
    assert assistant["tool_calls"] == [
        {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ]
    assert chat.messages[4] == {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}
    assert chat.messages[5]["content"] == "Error: boom"
    assert chat.tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": WEATHER["input_schema"],
                "description": "Weather for a city",
            },
        }
    ]
    assert chat.tool_choice == "auto" and chat.parallel_tool_calls
    assert chat.stream and chat.sampling.stop == ("END",) and chat.sampling.temperature == 0.5
    assert chat.sampling.top_k == 20 and chat.sampling.max_tokens is None and request.max_tokens == 64
    # Breakpoints: the system prompt (1 message), the first user message (2), the last tool result (6, 1 h).
    assert chat.cache_points == (CachePoint(1, 300.0), CachePoint(2, 300.0), CachePoint(6, 3600.0))
    assert request.session_id == "sess-42"


@pytest.mark.parametrize(
    ("user_id", "session"),
    [
        (json.dumps({"session_id": "abc"}), "abc"),
        ("user_0123abcd_account__session_5f1e7a2c-1111-2222-3333-444455556666", "5f1e7a2c-1111-2222-3333-444455556666"),
        ("plain-user", "plain-user"),
        ("", None),
    ],
)
def test_metadata_user_id_names_the_session(user_id: str, session: str | None) -> None:
    assert parse_messages_request(body(metadata={"user_id": user_id}), MODEL).session_id == session


@pytest.mark.parametrize(
    ("choice", "expected", "parallel"),
    [
        ({"type": "auto"}, "auto", True),
        ({"type": "any"}, "required", True),
        ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}, True),
        ({"type": "none"}, "none", True),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
    ],
)
def test_tool_choice(choice: dict[str, Any], expected: object, parallel: bool) -> None:
    chat = parse_messages_request(body(tools=[WEATHER], tool_choice=choice), MODEL).chat
    assert chat.tool_choice == expected and chat.parallel_tool_calls is parallel


@pytest.mark.parametrize(
    ("fields", "param", "status"),
    [
        ({"max_tokens": None}, "max_tokens", 400),
        ({"max_tokens": 0}, "max_tokens", 400),
        ({"model": "claude-sonnet-4-5"}, "model", 404),
        ({"messages": []}, "messages", 400),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", 400),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].type",
            400,
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "messages[0].content[0].type",
            400,
        ),
        ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content[0].type", 400),
        ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content", 400),
        ({"temperature": 1.5}, "temperature", 400),
        ({"top_k": -1}, "top_k", 400),
        ({"stop_sequences": [""]}, "stop_sequences[0]", 400),
        ({"stop_sequences": "END"}, "stop_sequences", 400),
        ({"tools": [{"name": "x"}]}, "tools[0].input_schema", 400),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type", 400),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].name", 400),
        ({"tool_choice": {"type": "any"}}, "tool_choice", 400),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name", 400),
        (
            {"system": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]},
            "system[0].cache_control.ttl",
            400,
        ),
        ({"metadata": {"user_id": 5}}, "metadata.user_id", 400),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}]},
            "messages[1].content",
            400,
        ),
    ],
)
def test_bad_requests_name_the_field(fields: dict[str, Any], param: str, status: int) -> None:
    err = error_of(body(**fields))
    assert err.status_code == status and err.param == param, err.message
    assert param in err.message


def test_a_final_assistant_text_is_continued_not_answered() -> None:
    """Anthropic's prefill: the answer goes on from the final assistant text; any other final message, an empty
    assistant one or one that calls a tool, is answered in a new turn."""
    opened = [{"type": "text", "text": "{"}]
    prefill = [{"role": "user", "content": "Give JSON"}, {"role": "assistant", "content": opened}]
    assert parse_messages_request(body(messages=prefill), MODEL).chat.continue_final_message
    call = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}}
    for final in ("", [call], [{"type": "thinking", "thinking": "hm", "signature": "s"}]):
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": final}]
        assert not parse_messages_request(body(messages=messages), MODEL).chat.continue_final_message, final
    assert not parse_messages_request(body(), MODEL).chat.continue_final_message


def test_count_tokens_needs_no_max_tokens() -> None:
    chat = parse_count_tokens_request({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, MODEL)
    assert chat.messages == [{"role": "user", "content": "hi"}]
    MessageTokensCount.model_validate(count_tokens_body(12))


def test_tool_results_make_a_tool_continuation() -> None:
    results = [
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}, {"type": "text", "text": "note"}],
        }
    ]
    assert classify_call(results) == "tool_continuation"
    assert classify_call([{"role": "user", "content": "hi"}]) == "user"


@pytest.mark.parametrize(
    ("finish", "stop", "tools", "expected"),
    [
        ("length", None, False, ("max_tokens", None)),
        ("stop", "END", False, ("stop_sequence", "END")),
        ("stop", 7, False, ("end_turn", None)),
        ("stop", None, False, ("end_turn", None)),
        ("stop", None, True, ("tool_use", None)),
    ],
)
def test_stop_reasons(finish: str, stop: str | int | None, tools: bool, expected: tuple[str, str | None]) -> None:
    assert stop_reason(finish, stop, called_tools=tools) == expected


def test_usage_adds_up_to_the_prompt() -> None:
    usage = messages_usage(prompt_tokens=100, cached_tokens=48, output_tokens=5, page_size=16)
    assert usage == {
        "input_tokens": 4,
        "cache_creation_input_tokens": 48,
        "cache_read_input_tokens": 48,
        "output_tokens": 5,
    }
    cold = messages_usage(prompt_tokens=10, cached_tokens=0, output_tokens=1, page_size=16)
    assert cold["input_tokens"] == 10 and cold["cache_creation_input_tokens"] == 0


def test_message_body_validates_with_the_sdk() -> None:
    call = ToolCall(id="call_abc123", name="get_weather", arguments='{"city": "Paris"}')
    usage = messages_usage(40, 32, 3, 16)
    message = Message.model_validate(
        message_body(
            response_id="msg_1",
            model=MODEL,
            content=[text_block("Checking."), tool_use_block(call)],
            stop=("tool_use", None),
            usage=usage,
        )
    )
    assert message.stop_reason == "tool_use" and message.usage.cache_read_input_tokens == 32
    block = message.content[1]
    assert (
        block.type == "tool_use"
        and block.id == tool_use_id(call) == "toolu_abc123"
        and block.input == {"city": "Paris"}
    )


def _parse(lines: list[str]) -> list[Any]:
    events = []
    for line in lines:
        name, data = line.strip().split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data.removeprefix("data: "))
        assert payload["type"] == name.removeprefix("event: ")
        # ``ping`` is in Anthropic's stream but not in the SDK's event union (the SDK skips it).
        events.append(SimpleNamespace(**payload) if payload["type"] == "ping" else EVENTS.validate_python(payload))
    return events


def test_stream_follows_anthropics_event_sequence() -> None:
    stream = MessageStream("msg_1", MODEL)
    usage = messages_usage(40, 32, 0, 16)
    call = ToolCall(id="call_1", name="get_weather", arguments='{"city": "Rome"}')
    lines = stream.start(usage) + stream.text("Hel") + stream.text("lo") + stream.tool_calls([call])
    lines += stream.text("") + stream.finish(("tool_use", None), {**usage, "output_tokens": 9})
    events = _parse(lines)
    assert [e.type for e in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[2].index == 0 and events[6].index == 1 and events[6].content_block.type == "tool_use"
    assert json.loads(events[7].delta.partial_json) == {"city": "Rome"}
    assert events[9].delta.stop_reason == "tool_use" and events[9].usage.output_tokens == 9


def test_reasoning_streams_as_a_thinking_block_before_the_text_and_the_body_has_it_first() -> None:
    stream = MessageStream("msg_3", MODEL)
    usage = messages_usage(5, 0, 0, 16)
    lines = stream.start(usage) + stream.thinking("The user ") + stream.thinking("greets.") + stream.text("Hi!")
    lines += stream.thinking("") + stream.finish(("end_turn", None), usage)
    events = _parse(lines)
    assert [e.type for e in events][2:] == [
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[2].content_block.type == "thinking" and events[2].index == 0
    assert [events[3].delta.type, events[3].delta.thinking] == ["thinking_delta", "The user "]
    assert events[6].content_block.type == "text" and events[6].index == 1
    # What the SDK's own stream reader assembles from these events, served as the HTTP response of a stream.
    transport = httpx.MockTransport(
        lambda request: httpx.Response(200, headers={"content-type": "text/event-stream"}, content="".join(lines))
    )
    client = anthropic.Anthropic(
        api_key="k", base_url="http://rayturn.test", http_client=httpx.Client(transport=transport)
    )
    with client.messages.stream(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}]) as reader:
        final = reader.get_final_message()
    assert [
        (block.type, getattr(block, "thinking", None) or getattr(block, "text", None)) for block in final.content
    ] == [
        ("thinking", "The user greets."),
        ("text", "Hi!"),
    ]
    body = message_body(
        response_id="msg_4",
        model=MODEL,
        content=[thinking_block("The user greets."), text_block("Hi!")],
        stop=("end_turn", None),
        usage=usage,
    )
    message = Message.model_validate(body)
    assert message.content[0].type == "thinking" and message.content[0].thinking == "The user greets."


def test_stream_text_only() -> None:
    stream = MessageStream("msg_2", MODEL)
    usage = messages_usage(5, 0, 0, 16)
    events = _parse(stream.start(usage) + stream.text("hi") + stream.finish(("end_turn", None), usage))
    assert [e.type for e in events][-3:] == ["content_block_stop", "message_delta", "message_stop"]


@pytest.mark.parametrize(
    ("err", "status", "kind"),
    [
        (APIError(400, "bad"), 400, "invalid_request_error"),
        (authentication_failed(), 401, "authentication_error"),
        (model_not_found("x", MODEL), 404, "not_found_error"),
        (APIError(413, "too big"), 413, "request_too_large"),
        (rate_limited("busy"), 429, "rate_limit_error"),
        (replica_unavailable(), 529, "overloaded_error"),
        (APIError(500, "oops", type="server_error"), 500, "api_error"),
    ],
)
def test_error_shapes(err: APIError, status: int, kind: str) -> None:
    from rayturn.api.anthropic_bodies import anthropic_status

    shaped = error_body(err)
    assert anthropic_status(err) == status
    assert shaped == {"type": "error", "error": {"type": kind, "message": err.message}}


def test_breakpoints_inside_tool_results_count() -> None:
    result = {
        "type": "tool_result",
        "tool_use_id": "t1",
        "content": [{"type": "text", "text": "ok", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
    }
    chat = parse_messages_request(body(messages=[{"role": "user", "content": [result]}]), MODEL).chat
    assert chat.cache_points == (CachePoint(1, 3600.0),)


def test_structured_output_becomes_the_response_format() -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    chat = parse_messages_request(
        body(output_config={"effort": "high", "format": {"type": "json_schema", "schema": schema}}), MODEL
    ).chat
    assert chat.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema},
        "schema_param": "output_config.format.schema",
    }
    assert parse_messages_request(body(output_config={"effort": "high"}), MODEL).chat.response_format is None
    assert error_of(body(output_config={"format": {"type": "xml"}})).param == "output_config.format.type"
    assert error_of(body(output_config={"format": {"type": "json_schema"}})).param == "output_config.format.schema"
