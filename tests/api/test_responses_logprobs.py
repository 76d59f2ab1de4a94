"""Log probabilities on the Responses API: ``include: ["message.output_text.logprobs"]`` asks for them, with
``top_logprobs`` alternatives per token (alone, as OpenAI, it returns none). Through the ingress's real Responses
and chat paths, with the decode pool replaced by one that answers scripted steps, a response's message carries
the same entries as the chat API's ``logprobs.content`` for the same steps, streamed or not; each body and event
is valid for the ``openai`` SDK; bad values are 400s naming the field, as the published schema says."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from ingress_recorder import (
    RecordingPipeline,
    ScriptedDecode,
    assert_refused,
    http_request,
    request_schema,
    send_http,
)
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from rayturn.api.openapi import openapi_document
from rayturn.api.pipeline import CallPipeline
from rayturn.api.responses_bodies import OUTPUT_LOGPROBS, ResponseFrame, response_usage
from rayturn.api.responses_request import parse_responses_request
from rayturn.api.responses_stream import ResponsesStream
from rayturn.api.serving_chat import ServingChat
from rayturn.api.serving_responses import ServingResponses
from rayturn.api.settings import IngressSettings
from rayturn.engine.sequence import TokenLogprob
from rayturn.engine.tool_calls import ToolCall, ToolCallDelta
from rayturn.messages import Delta, Step

MODEL = "tiny"
DOCUMENT = openapi_document(MODEL, vocab_size=263, max_model_len=4096)
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
# The scripted answer: per step its text and its one token with that token's alternatives (ids of the tiny
# model's byte vocabulary; 0xc3 alone is half a character, named by its bytes).
STEPS = (
    ("Hi", TokenLogprob(72, -0.25, ((72, -0.25), (0xC3, -1.5)))),
    (" you", TokenLogprob(32, -0.5, ((32, -0.5), (10, -2.0)))),
    ("!", TokenLogprob(33, -1.0, ((33, -1.0), (46, -1.25)))),
)


def scripted_steps() -> tuple[Step, ...]:
    """``STEPS`` as the decode pool streams them: one token per step, the last ending the answer."""
    steps = []
    for i, (text, scored) in enumerate(STEPS):
        reason = "stop" if i == len(STEPS) - 1 else None
        delta = Delta(0, (scored.token_id,), text, (scored,), reason)
        steps.append(Step((delta,), 9, 0, 0, finished=reason is not None, path="local", replica_id="decode-1"))
    return tuple(steps)


def post(serving: Any, body: dict[str, Any]) -> Any:
    """The answer to ``body``: its JSON body, or its stream's events."""

    async def go() -> Any:
        response = await serving.create(http_request(body), "request-1")
        if not hasattr(response, "body_iterator"):
            return json.loads(bytes(response.body))
        frames = [frame async for frame in response.body_iterator]
        text = "".join(frame.decode() if isinstance(frame, bytes) else frame for frame in frames)
        return [json.loads(line[len("data: ") :]) for line in text.split("\n") if line.startswith("data: {")]

    return asyncio.run(go())


def servings() -> tuple[ServingResponses, ServingChat, ScriptedDecode]:
    decode = ScriptedDecode(scripted_steps())
    pipeline = CallPipeline(decode, None, None, IngressSettings(model=MODEL, served_model_name=MODEL, page_size=16))
    return ServingResponses(pipeline), ServingChat(pipeline), decode


def without_bytes(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Entries as a text event carries them: each token and alternative less its ``bytes``."""

    def drop(token: dict[str, Any]) -> dict[str, Any]:
        return {key: value for key, value in token.items() if key != "bytes"}

    return [drop(entry) | {"top_logprobs": [drop(top) for top in entry["top_logprobs"]]} for entry in entries]


def test_include_asks_for_them_and_top_logprobs_counts_the_alternatives() -> None:
    asked = parse_responses_request({"input": "hi", "include": [OUTPUT_LOGPROBS], "top_logprobs": 3}, MODEL)
    assert (asked.sampling.logprobs, asked.sampling.top_logprobs, asked.echo["top_logprobs"]) == (True, 3, 3)
    plain = parse_responses_request({"input": "hi", "include": [OUTPUT_LOGPROBS]}, MODEL)
    assert (plain.sampling.logprobs, plain.sampling.top_logprobs, plain.echo["top_logprobs"]) == (True, 0, None)
    for body in ({"input": "hi", "top_logprobs": 5}, {"input": "hi", "include": ["reasoning.encrypted_content"]}):
        assert parse_responses_request(body, MODEL).sampling.logprobs is False

    pipeline = RecordingPipeline()
    for extra, expected in (
        ({"include": [OUTPUT_LOGPROBS], "top_logprobs": 4}, 4),
        ({"include": [OUTPUT_LOGPROBS]}, 0),
        ({"top_logprobs": 4}, None),
    ):
        status, body, call = send_http(pipeline, "responses", extra)
        assert status == 200 and call is not None, body
        assert call.params.logprobs == expected  # the engine's count of alternatives; None: no logprobs at all


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ({"top_logprobs": 21}, "an integer in [0, 20], got 21"),
        ({"top_logprobs": -1}, "an integer in [0, 20], got -1"),
        ({"top_logprobs": "3"}, "an integer"),
        ({"include": [OUTPUT_LOGPROBS], "top_logprobs": 2.5}, "an integer"),
    ],
)
def test_bad_top_logprobs_are_400s_as_the_schema_says(extra: dict[str, Any], said: str) -> None:
    assert_refused(RecordingPipeline(), "responses", extra, "top_logprobs", said, DOCUMENT)


def test_a_response_carries_the_chat_apis_logprobs_streamed_or_not() -> None:
    responses, chat, decode = servings()
    asked = {"input": "hi", "include": [OUTPUT_LOGPROBS], "top_logprobs": 2, "max_output_tokens": 3}
    chat_body = post(chat, {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2})
    expected = chat_body["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in expected] == ["H", " ", "!"]
    assert expected[0]["top_logprobs"][1] == {"token": "bytes:\\xc3", "logprob": -1.5, "bytes": [0xC3]}

    body = post(responses, asked)
    response = Response.model_validate(body)
    assert response.output_text == "Hi you!" and response.top_logprobs == 2
    assert body["output"][0]["content"][0]["logprobs"] == expected

    events = post(responses, {**asked, "stream": True})
    for event in events:
        EVENTS.validate_python(event)
    deltas = [event for event in events if event["type"] == "response.output_text.delta"]
    assert [event["logprobs"] for event in deltas] == [[entry] for entry in without_bytes(expected)]
    (done,) = [event for event in events if event["type"] == "response.output_text.done"]
    (part,) = [event for event in events if event["type"] == "response.content_part.done"]
    assert done["logprobs"] == without_bytes(expected) and part["part"]["logprobs"] == expected
    assert events[-1]["response"]["output"][0]["content"][0]["logprobs"] == expected

    # Not asked for: empty lists, as before, and the engine computes none.
    for extra in ({}, {"stream": True}):
        answer = post(responses, {"input": "hi", "top_logprobs": 2, **extra})
        final = answer[-1]["response"] if extra else answer
        assert final["output"][0]["content"][0]["logprobs"] == []
        assert all(event.get("logprobs", []) == [] for event in (answer if extra else []))
    assert [call.params.logprobs for call in decode.calls] == [2, 2, 2, None, None]


def entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}


def stream() -> ResponsesStream:
    echo = parse_responses_request({"input": "hi"}, MODEL).echo
    return ResponsesStream(ResponseFrame("resp_1", 1700000000, MODEL, echo), parse_tools=True)


def test_a_streamed_message_holds_every_token_up_to_its_end() -> None:
    """Reasoning tokens go out with the first text delta; tokens left at the end with ``output_text.done``."""
    first, second, last = entry("<think>", -0.1), entry("Yes", -0.2), entry("<eos>", -0.3)
    thinking = stream()
    events = thinking.start()
    thinking.score([first])
    events += thinking.push("<think>so", ToolCallDelta(content="", tool_calls=(), reasoning="so"))
    thinking.score([second])
    events += thinking.push("Yes", ToolCallDelta(content="Yes", tool_calls=()))
    thinking.score([last])
    events += thinking.finish("stop", response_usage(5, 3), ToolCallDelta(content="", tool_calls=()))
    for event in events:
        EVENTS.validate_python(event)
    (delta,) = [event for event in events if event["type"] == "response.output_text.delta"]
    (done,) = [event for event in events if event["type"] == "response.output_text.done"]
    assert delta["logprobs"] == without_bytes([first, second])
    assert done["logprobs"] == without_bytes([first, second, last])
    message = thinking.response["output"][1]
    assert message["type"] == "message" and message["content"][0]["logprobs"] == [first, second, last]

    # Prose then a call: the message closes at the call with every token so far; none after it.
    calling = stream()
    calling.start()
    calling.score([first])
    calling.push("Ok", ToolCallDelta(content="Ok", tool_calls=()))
    calling.score([second])
    call = ToolCall(id="call_1", name="shell", arguments="{}")
    calling.push("<tool_call>...", ToolCallDelta(content="", tool_calls=(call,)))
    calling.score([last])
    calling.finish("stop", response_usage(5, 3), ToolCallDelta(content="", tool_calls=()))
    output = Response.model_validate(calling.response).output
    assert [item.type for item in output] == ["message", "function_call"]
    assert calling.response["output"][0]["content"][0]["logprobs"] == [first, second]

    # An empty answer's message still holds its tokens.
    empty = stream()
    empty.start()
    empty.score([last])
    events = empty.finish("stop", response_usage(5, 1), ToolCallDelta(content="", tool_calls=()))
    (done,) = [event for event in events if event["type"] == "response.output_text.done"]
    assert done["logprobs"] == without_bytes([last])
    assert empty.response["output"][0]["content"][0]["logprobs"] == [last]


def test_a_responses_output_is_sent_back_as_input_as_the_schema_says() -> None:
    """The usual way to continue without the store: the last response's output items, as they came, then the next
    message. Their ids, statuses, annotations and log probabilities are not read, and the schema allows them."""
    responses, _, _ = servings()
    body = post(responses, {"input": "hi", "include": [OUTPUT_LOGPROBS], "top_logprobs": 1, "store": False})
    call = {
        "id": "fc_1",
        "type": "function_call",
        "status": "completed",
        "call_id": "c1",
        "name": "f",
        "arguments": "{}",
    }
    reasoning = {
        "id": "rs_1",
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "so"}],
    }
    sdk_output = [item.model_dump(exclude_none=True) for item in Response.model_validate(body).output]
    for output in (body["output"], sdk_output):
        assert output[0]["content"][0]["logprobs"]
        items = [{"role": "user", "content": "hi"}, reasoning, *output, call]
        items += [{"type": "function_call_output", "call_id": "c1", "output": "ok"}, {"role": "user", "content": "go"}]
        parsed = parse_responses_request({"input": items}, MODEL)
        assert [message["role"] for message in parsed.input_messages] == ["user", "assistant", "tool", "user"]
        assert parsed.input_messages[1]["content"] == "Hi you!"
        assert request_schema(DOCUMENT, "responses").is_valid({"input": items})
