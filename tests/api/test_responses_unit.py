"""The Responses API edge without Ray: request parsing into chat calls, bodies and stream events (checked with
the openai SDK's types), the store of finished responses."""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Callable
from typing import Any

import pytest
from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseCreatedEvent,
    ResponseFailedEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseIncompleteEvent,
    ResponseInProgressEvent,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseReasoningTextDeltaEvent,
    ResponseReasoningTextDoneEvent,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
)

from rayturn.api.errors import APIError, rate_limited
from rayturn.api.protocol import PROMPT_CACHE_RETENTION_S, CachePoint
from rayturn.api.response_store import ResponseStore, StoredResponse
from rayturn.api.responses_bodies import (
    ResponseFrame,
    assistant_message,
    output_items,
    response_error,
    response_usage,
)
from rayturn.api.responses_request import parse_responses_request
from rayturn.api.responses_stream import ResponsesStream, sse_event
from rayturn.api.session import classify_call
from rayturn.engine.tool_calls import ParsedToolCalls, ToolCall, ToolCallDelta

MODEL = "qwen-test"
EVENT_TYPES: dict[str, Any] = {
    "response.created": ResponseCreatedEvent,
    "response.in_progress": ResponseInProgressEvent,
    "response.output_item.added": ResponseOutputItemAddedEvent,
    "response.content_part.added": ResponseContentPartAddedEvent,
    "response.output_text.delta": ResponseTextDeltaEvent,
    "response.output_text.done": ResponseTextDoneEvent,
    "response.content_part.done": ResponseContentPartDoneEvent,
    "response.output_item.done": ResponseOutputItemDoneEvent,
    "response.reasoning_text.delta": ResponseReasoningTextDeltaEvent,
    "response.reasoning_text.done": ResponseReasoningTextDoneEvent,
    "response.function_call_arguments.delta": ResponseFunctionCallArgumentsDeltaEvent,
    "response.function_call_arguments.done": ResponseFunctionCallArgumentsDoneEvent,
    "response.completed": ResponseCompletedEvent,
    "response.incomplete": ResponseIncompleteEvent,
    "response.failed": ResponseFailedEvent,
}


def function_tool(name: str) -> dict[str, Any]:
    return {
        "type": "function",
        "name": name,
        "description": f"The {name} tool.",
        "strict": False,
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
    }


CODEX_TOOLS = [
    function_tool(name)
    for name in ("shell", "exec_command", "write_stdin", "update_plan", "apply_patch", "view_image", "a", "b", "c")
]
CODEX_BODY: dict[str, Any] = {
    "model": MODEL,
    "instructions": "You are Codex.",
    "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sandbox: on"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<env/>"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list files"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Listing."}]},
        {"type": "function_call", "name": "shell", "arguments": '{"cmd": "ls"}', "call_id": "call_1"},
        {"type": "function_call_output", "call_id": "call_1", "output": "a.py\nb.py"},
    ],
    "tools": [*CODEX_TOOLS, {"type": "web_search", "external_web_access": False}, {"type": "local_shell"}],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "reasoning": {"effort": "medium", "summary": "auto"},
    "store": False,
    "stream": True,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "019a-session",
}


def test_a_codex_request_becomes_a_chat_call_with_its_tool_loop() -> None:
    parsed = parse_responses_request(CODEX_BODY, MODEL)
    chat = parsed.chat()
    assert chat.messages == [
        {"role": "system", "content": "You are Codex."},
        {"role": "system", "content": "sandbox: on"},
        {"role": "user", "content": "<env/>"},
        {"role": "user", "content": "list files"},
        {
            "role": "assistant",
            "content": "Listing.",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "shell", "arguments": {"cmd": "ls"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "a.py\nb.py"},
    ]
    # The built-in web_search and local_shell are dropped; the nine function tools take the chat shape.
    assert chat.tools is not None and len(chat.tools) == 9
    assert chat.tools[0] == {
        "type": "function",
        "function": {
            "name": "shell",
            "description": "The shell tool.",
            "parameters": CODEX_TOOLS[0]["parameters"],
            "strict": False,
        },
    }
    assert chat.tool_choice == "auto" and chat.prompt_tools == chat.tools and not chat.parallel_tool_calls
    assert chat.stream and not parsed.store and parsed.previous_response_id is None
    assert parsed.body_session == ("019a-session", "prompt_cache_key")
    assert chat.prompt_cache_key == "019a-session"
    assert classify_call(chat.messages) == "tool_continuation"
    assert chat.response_format is None and chat.cache_points == ()


def test_a_string_input_is_one_user_message_and_the_settings_are_echoed() -> None:
    parsed = parse_responses_request({"model": MODEL, "input": "hi", "user": "u1", "max_output_tokens": 9}, MODEL)
    assert parsed.chat().messages == [{"role": "user", "content": "hi"}]
    assert parsed.chat().tool_choice == "none" and parsed.chat().prompt_tools is None
    assert parsed.store and parsed.sampling.max_tokens == 9 and parsed.body_session == ("u1", "user")
    assert (
        parsed.echo["tool_choice"] == "auto" and parsed.echo["tools"] == [] and parsed.echo["truncation"] == "disabled"
    )


def test_history_comes_between_the_instructions_and_the_new_input() -> None:
    body = {"model": MODEL, "input": "next", "instructions": "be brief", "prompt_cache_retention": "24h"}
    history = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"}]
    chat = parse_responses_request(body, MODEL).chat(history)
    assert [m["content"] for m in chat.messages] == ["be brief", "first", "ok", "next"]
    assert chat.cache_points == (CachePoint(num_messages=4, ttl_s=PROMPT_CACHE_RETENTION_S["24h"]),)


def test_function_calls_join_the_assistant_message_before_them() -> None:
    call = {"type": "function_call", "name": "f", "call_id": "c1", "arguments": "not json"}
    body = {
        "model": MODEL,
        "input": [
            {"role": "user", "content": "go"},
            call,
            {**call, "call_id": "c2", "arguments": '{"x": 1}'},
            {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "done"}]},
        ],
    }
    messages = parse_responses_request(body, MODEL).chat().messages
    assert messages[1] == {
        "role": "assistant",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "not json"}},
            {"id": "c2", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
        ],
    }
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "done"}


def test_text_formats_become_the_chat_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    form = {"type": "json_schema", "name": "out", "schema": schema, "strict": True}
    parsed = parse_responses_request(
        {"model": MODEL, "input": "x", "text": {"format": form, "verbosity": "low"}}, MODEL
    )
    assert parsed.chat().response_format == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": schema, "strict": True},
        "schema_param": "text.format.schema",
    }
    assert parsed.echo["text"] == {"format": form, "verbosity": "low"}
    json_mode = parse_responses_request(
        {"model": MODEL, "input": "x", "text": {"format": {"type": "json_object"}}}, MODEL
    )
    assert json_mode.response_format == {"type": "json_object"}
    plain = parse_responses_request({"model": MODEL, "input": "x", "text": {"format": {"type": "text"}}}, MODEL)
    assert plain.response_format is None


def test_a_named_tool_choice_shows_only_that_tool() -> None:
    body = {
        "model": MODEL,
        "input": "x",
        "tools": CODEX_TOOLS[:2],
        "tool_choice": {"type": "function", "name": "shell"},
    }
    parsed = parse_responses_request(body, MODEL)
    assert parsed.tool_choice == {"type": "function", "function": {"name": "shell"}}
    assert parsed.echo["tool_choice"] == {"type": "function", "name": "shell"}
    prompt_tools = parsed.chat().prompt_tools
    assert prompt_tools is not None and [tool["function"]["name"] for tool in prompt_tools] == ["shell"]


BAD_REQUESTS: list[tuple[dict[str, Any], str]] = [
    ({"input": None}, "input"),
    ({"input": 7}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"content": "no role or type"}]}, "input[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "local_shell_call", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:"}]}]},
        "input[0].content[0].type",
    ),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "name": "f", "call_id": "c"}]}, "input[0].arguments"),
    ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"tools": [function_tool("f"), function_tool("f")]}, "tools[1].name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [function_tool("f")], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice.name"),
    ({"tools": [function_tool("f")], "tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"text": {"verbosity": "loud"}}, "text.verbosity"),
    ({"truncation": "sometimes"}, "truncation"),
    ({"prompt_cache_retention": "forever"}, "prompt_cache_retention"),
    ({"metadata": {"k": 1}}, "metadata.k"),
    ({"include": [1]}, "include[0]"),
    ({"include": ["reasoning.encrypted_content", "output_text.logprobs"]}, "include[1]"),
    ({"store": "yes"}, "store"),
    ({"background": True, "store": False}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"top_logprobs": 21}, "top_logprobs"),
]


@pytest.mark.parametrize(("patch", "param"), BAD_REQUESTS, ids=[param for _, param in BAD_REQUESTS])
def test_bad_input_is_a_400_naming_the_field(patch: dict[str, Any], param: str) -> None:
    body = {"model": MODEL, "input": "hi", **patch}
    with pytest.raises(APIError) as err:
        parse_responses_request(body, MODEL)
    assert err.value.status_code == 400 and err.value.type == "invalid_request_error"
    assert err.value.param == param and param in err.value.message


def test_another_model_is_a_404() -> None:
    with pytest.raises(APIError) as err:
        parse_responses_request({"model": "gpt-9", "input": "hi"}, MODEL)
    assert err.value.status_code == 404


def frame(body: dict[str, Any] = CODEX_BODY) -> ResponseFrame:
    return ResponseFrame("resp_1", 1700000000, MODEL, parse_responses_request(body, MODEL).echo)


CALL = ToolCall(id="call_9", name="shell", arguments='{"cmd": "ls"}')


def test_a_finished_body_is_a_valid_response_with_prose_then_calls() -> None:
    output = output_items(ParsedToolCalls(content="Let me look.", tool_calls=(CALL,)), "completed")
    body = frame().body("completed", output, response_usage(120, 9, cached_tokens=112, kv_store_tokens=16))
    response = Response.model_validate(body)
    assert response.status == "completed" and response.output_text == "Let me look."
    assert [item.type for item in response.output] == ["message", "function_call"]
    call = response.output[1]
    assert (
        call.type == "function_call" and call.call_id == "call_9" and call.id is not None and call.id.startswith("fc_")
    )
    assert response.usage is not None and response.usage.total_tokens == 129
    assert response.usage.input_tokens_details.cached_tokens == 112
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    assert response.tool_choice == "auto" and len(response.tools) == 9 and response.parallel_tool_calls is False
    assert response.reasoning is not None and response.reasoning.summary == "auto"
    assert response.instructions == "You are Codex." and response.store is False


def test_a_cut_answer_is_incomplete_and_an_empty_one_is_an_empty_message() -> None:
    output = output_items(ParsedToolCalls(content="half an ans", tool_calls=()), "incomplete")
    response = Response.model_validate(frame().body("incomplete", output, response_usage(5, 16)))
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens" and response.output[0].status == "incomplete"
    empty = output_items(ParsedToolCalls(content=None, tool_calls=()), "completed")
    assert Response.model_validate(frame().body("completed", empty, response_usage(5, 1))).output_text == ""


def test_an_answer_sent_back_as_input_is_the_message_the_store_keeps() -> None:
    """Continuing by ``previous_response_id`` and by resending the output render the same history."""
    for parsed in (
        ParsedToolCalls(content="Let me look.", tool_calls=(CALL, ToolCall("call_8", "shell", "{}"))),
        ParsedToolCalls(content=None, tool_calls=(CALL,)),
        ParsedToolCalls(content="just prose", tool_calls=()),
        ParsedToolCalls(content="Looking.", tool_calls=(CALL,), reasoning="List first."),
        ParsedToolCalls(content=None, tool_calls=(CALL,), reasoning="Just call it."),
    ):
        output = output_items(parsed, "completed")
        resent = parse_responses_request({"model": MODEL, "input": copy.deepcopy(output)}, MODEL)
        assert list(resent.input_messages) == [assistant_message(output)]


def test_reasoning_items_sent_back_reach_the_assistant_message_they_precede() -> None:
    def messages(*items: dict[str, Any]) -> list[dict[str, Any]]:
        return list(parse_responses_request({"model": MODEL, "input": list(items)}, MODEL).input_messages)

    user = {"role": "user", "content": "list files"}
    call = {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": '{"cmd": "ls"}'}
    output = {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"}
    summarised = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Run ls."}]}
    assert messages(user, summarised, call, output)[1] == {
        "role": "assistant",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "shell", "arguments": {"cmd": "ls"}}}],
        "reasoning_content": "Run ls.",
    }
    encrypted = {"type": "reasoning", "summary": [], "encrypted_content": "gAAAA..."}
    assert "reasoning_content" not in messages(user, encrypted, call, output)[1]  # nothing this server can read
    # Reasoning that no assistant message follows is dropped, not carried over to a later one.
    dangling = messages(user, summarised, output, {"role": "assistant", "content": "Done."})
    assert all("reasoning_content" not in message for message in dangling)
    with pytest.raises(APIError, match="summary"):
        messages(user, {"type": "reasoning", "summary": "not a list"}, call)


def stream_events(
    stream: ResponsesStream, pieces: list[str], reason: str = "stop", parsed: list[ToolCallDelta] | None = None
) -> list[dict[str, Any]]:
    events = stream.start()
    for i, piece in enumerate(pieces):
        events += stream.push(piece, None if parsed is None else parsed[i])
    held = None if parsed is None else parsed[-1]
    events += stream.finish(reason, response_usage(10, len(pieces)), held)
    return events


def validated(events: list[dict[str, Any]]) -> list[str]:
    """The event types, each event checked against its SDK type and numbered in order."""
    for number, event in enumerate(events):
        assert event["sequence_number"] == number
        EVENT_TYPES[event["type"]].model_validate(event)
    return [event["type"] for event in events]


def ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


TEXT_EVENTS = [
    "response.output_item.added",
    "response.content_part.added",
]
CLOSE_TEXT = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
CALL_EVENTS = [
    "response.output_item.added",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
]


def test_streamed_prose_then_a_call_arrive_in_openais_order() -> None:
    text = 'Let me look.\n<tool_call>\n{"name": "shell", "arguments": {"cmd": "ls"}}\n</tool_call>'
    pieces = [text[i : i + 7] for i in range(0, len(text), 7)]
    stream = ResponsesStream(frame(), parse_tools=True, id_factory=ids())
    types = validated(stream_events(stream, pieces))
    deltas = types.count("response.output_text.delta")
    assert types == [
        "response.created",
        "response.in_progress",
        *TEXT_EVENTS,
        *["response.output_text.delta"] * deltas,
        *CLOSE_TEXT,
        *CALL_EVENTS,
        "response.completed",
    ]
    response = Response.model_validate(stream.response)
    assert response.output_text == "Let me look." and response.status == "completed"
    call = response.output[1]
    assert call.type == "function_call" and call.call_id == "call_0" and json.loads(call.arguments) == {"cmd": "ls"}
    # The same items as the whole answer's body, ids aside.
    whole = output_items(
        ParsedToolCalls(content="Let me look.", tool_calls=(ToolCall("call_0", "shell", call.arguments),)), "completed"
    )
    assert [{**item, "id": None} for item in stream.output] == [{**item, "id": None} for item in whole]


REASONING_EVENTS = ["response.output_item.added", "response.content_part.added"]
CLOSE_REASONING = ["response.reasoning_text.done", "response.content_part.done", "response.output_item.done"]
HARMONY_ANSWER = (
    "<|channel|>analysis<|message|>The user wants a listing; run ls.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.shell <|constrain|>json<|message|>{"cmd": "ls"}<|call|>'
)


def test_harmony_reasoning_streams_as_a_reasoning_item_before_the_call() -> None:
    pieces = [HARMONY_ANSWER[i : i + 9] for i in range(0, len(HARMONY_ANSWER), 9)]
    stream = ResponsesStream(frame(), parse_tools=True, id_factory=ids(), parser="harmony")
    types = validated(stream_events(stream, pieces))
    deltas = types.count("response.reasoning_text.delta")
    assert deltas > 1  # streamed as it comes, not at the end
    assert types == [
        "response.created",
        "response.in_progress",
        *REASONING_EVENTS,
        *["response.reasoning_text.delta"] * deltas,
        *CLOSE_REASONING,
        *CALL_EVENTS,
        "response.completed",
    ]
    response = Response.model_validate(stream.response)
    reasoning, call = response.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
    assert reasoning.content is not None and reasoning.content[0].text == "The user wants a listing; run ls."
    assert call.type == "function_call" and json.loads(call.arguments) == {"cmd": "ls"}
    assert response.output_text == ""  # reasoning is never the answer's text
    # The whole answer's body has the same items, ids aside.
    whole = output_items(
        ParsedToolCalls(None, (ToolCall("call_0", "shell", call.arguments),), "The user wants a listing; run ls."),
        "completed",
    )
    assert [{**item, "id": None} for item in stream.output] == [{**item, "id": None} for item in whole]
    assert assistant_message(whole)["reasoning_content"] == "The user wants a listing; run ls."


def test_reasoning_then_prose_closes_the_reasoning_item_and_reasoning_alone_still_ends_with_a_message() -> None:
    text = "<|channel|>analysis<|message|>Greet.<|end|><|start|>assistant<|channel|>final<|message|>Hi!"
    stream = ResponsesStream(frame(), parse_tools=True, parser="harmony")
    types = validated(stream_events(stream, [text[:35], text[35:]]))
    assert types[2:4] == REASONING_EVENTS and types[-4:] == [*CLOSE_TEXT, "response.completed"]
    response = Response.model_validate(stream.response)
    assert [item.type for item in response.output] == ["reasoning", "message"] and response.output_text == "Hi!"
    only_reasoning = ResponsesStream(frame(), parse_tools=True, parser="harmony")
    validated(stream_events(only_reasoning, ["<|channel|>analysis<|message|>Hmm"], reason="length"))
    cut = Response.model_validate(only_reasoning.response)
    assert [item.type for item in cut.output] == ["reasoning", "message"] and cut.status == "incomplete"
    whole = output_items(ParsedToolCalls(None, (), "Hmm"), "incomplete")
    assert [item["type"] for item in whole] == ["reasoning", "message"]


def test_the_replicas_split_is_used_and_surplus_calls_dropped_without_parallel_calls() -> None:
    second = ToolCall(id="call_b", name="shell", arguments="{}")
    parsed = [ToolCallDelta("", (CALL,)), ToolCallDelta("", (second,)), ToolCallDelta("", ())]
    stream = ResponsesStream(frame(), parse_tools=True, parallel_tool_calls=False)
    types = validated(stream_events(stream, ["<tool_call>…", "<tool_call>…"], parsed=parsed))
    assert types == ["response.created", "response.in_progress", *CALL_EVENTS, "response.completed"]
    assert [item["call_id"] for item in stream.output] == ["call_9"]


def test_a_stream_cut_by_the_length_ends_incomplete() -> None:
    stream = ResponsesStream(frame(), parse_tools=False)
    types = validated(stream_events(stream, ["a", "b"], reason="length"))
    assert types[-4:] == [*CLOSE_TEXT, "response.incomplete"]
    response = Response.model_validate(stream.response)
    assert response.output_text == "ab" and response.output[0].status == "incomplete"


def test_an_empty_stream_still_ends_with_a_message_and_a_failure_is_a_failed_response() -> None:
    stream = ResponsesStream(frame(), parse_tools=False)
    types = validated(stream_events(stream, []))
    assert types == ["response.created", "response.in_progress", *TEXT_EVENTS, *CLOSE_TEXT, "response.completed"]
    failing = ResponsesStream(frame(), parse_tools=False)
    events = failing.start() + failing.push("partial") + [failing.fail(response_error(rate_limited("busy")))]
    validated(events)
    failed = Response.model_validate(events[-1]["response"])
    assert failed.status == "failed" and failed.error is not None and failed.error.code == "rate_limit_exceeded"


def test_each_event_is_named_in_its_sse_frame() -> None:
    event = {"type": "response.output_text.delta", "sequence_number": 3, "delta": "é"}
    assert sse_event(event) == 'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",' + (
        '"sequence_number":3,"delta":"é"}\n\n'
    )


def stored(response_id: str, tenant: str = "t", num_bytes: int = 10) -> StoredResponse:
    body = {"id": response_id, "output": []}
    return StoredResponse(response_id, tenant, body, ({"role": "user", "content": "x"},), num_bytes)


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_the_store_evicts_the_least_recently_used_by_count_and_by_bytes() -> None:
    store = ResponseStore(max_entries=2, max_bytes=100)
    store.put(stored("a"))
    store.put(stored("b"))
    assert store.get("t", "a") is not None  # a is now the most recently used
    store.put(stored("c"))
    assert store.get("t", "b") is None and store.get("t", "a") is not None and len(store) == 2
    store.put(stored("big", num_bytes=95))
    assert len(store) == 1 and store.num_bytes == 95  # both small ones went to make room
    store.put(stored("huge", num_bytes=101))
    assert store.get("t", "huge") is None and store.get("t", "big") is not None


def test_the_store_keeps_tenants_apart_and_forgets_entries_left_unused() -> None:
    clock = Clock()
    store = ResponseStore(ttl_s=60, clock=clock)
    store.put(stored("a", tenant="alice"))
    store.put(stored("b", tenant="alice"))
    assert store.get("bob", "a") is None and not store.delete("bob", "a")
    clock.now_s = 50
    assert store.get("alice", "a") is not None  # renewed until 110
    clock.now_s = 100
    assert store.get("alice", "b") is None and store.get("alice", "a") is not None
    assert store.num_bytes == 10
    assert store.delete("alice", "a") and len(store) == 0 and store.num_bytes == 0


def test_one_tenant_s_traffic_evicts_its_own_responses_first() -> None:
    store = ResponseStore(max_entries=4, max_bytes=1000)
    store.put(stored("alice-1", tenant="alice"))
    for i in range(10):  # bob floods the store
        store.put(stored(f"bob-{i}", tenant="bob"))
    assert store.get("alice", "alice-1") is not None and len(store) == 4
    assert [store.get("bob", f"bob-{i}") is not None for i in range(10)] == [False] * 7 + [True] * 3
    bytes_store = ResponseStore(max_entries=100, max_bytes=100)
    bytes_store.put(stored("alice-1", tenant="alice", num_bytes=30))
    for i in range(5):
        bytes_store.put(stored(f"bob-{i}", tenant="bob", num_bytes=30))
    assert bytes_store.get("alice", "alice-1") is not None and bytes_store.num_bytes <= 100
