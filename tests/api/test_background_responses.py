"""Background responses (``background: true``) through the ingress's real Responses path and call pipeline, with
the decode pool replaced by one whose steps the test releases: answered ``queued`` at once, computed by a task,
read while ``in_progress``, cancelled (the decode replica's stream cancelled too), streamed again from a sequence
number while running and once stored, and refused where they cannot be."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from ingress_recorder import assert_refused
from openai.types.responses import Response
from starlette.requests import Request

from rayturn.api.background_responses import BackgroundRuns, starting_after, stream_query
from rayturn.api.errors import APIError, rate_limited
from rayturn.api.openapi import openapi_document
from rayturn.api.pipeline import CallPipeline
from rayturn.api.serving_responses import ServingResponses
from rayturn.api.settings import IngressSettings
from rayturn.api.tenants import KeyTable
from rayturn.messages import Call, Delta, Step

ALICE, BOB = "alice-key", "bob-key"
WORDS = ("Hello", " there", ",", " friend")


def step(text: str, index: int, finish_reason: str | None = None) -> Step:
    delta = Delta(0, (index,), text, None, finish_reason)
    return Step(
        (delta,),
        prompt_tokens=9,
        cached_tokens=0,
        loaded_tokens=0,
        finished=finish_reason is not None,
        path="local",
        replica_id="decode-1",
    )


class DecodeStream:
    """One call's stream from the scripted decode pool: a step each time the test releases one."""

    def __init__(self, call: Call, fail: APIError | None) -> None:
        self.call = call
        self.fail = fail
        self.released = asyncio.Semaphore(0)
        self.cancelled = False
        self.sent = 0

    def __aiter__(self) -> AsyncIterator[Step]:
        return self._steps()

    async def _steps(self) -> AsyncIterator[Step]:
        if self.fail is not None:
            raise self.fail
        for i, word in enumerate(WORDS):
            await self.released.acquire()
            self.sent += 1
            yield step(word, i, "stop" if i == len(WORDS) - 1 else None)

    def release(self, count: int = len(WORDS)) -> None:
        for _ in range(count):
            self.released.release()

    def cancel(self) -> None:
        self.cancelled = True


class ScriptedDecode:
    """A decode pool handle: ``generate.options(stream=True).remote(call)`` gives a ``DecodeStream``."""

    def __init__(self) -> None:
        self.streams: list[DecodeStream] = []
        self.fail: APIError | None = None
        self.generate = self

    def options(self, stream: bool = False) -> ScriptedDecode:
        return self

    def remote(self, call: Call) -> DecodeStream:
        self.streams.append(DecodeStream(call, self.fail))
        return self.streams[-1]


def serving(max_running: int = 8) -> tuple[ServingResponses, ScriptedDecode]:
    decode = ScriptedDecode()
    keys = KeyTable.build((), {"alice": (ALICE,), "bob": (BOB,)})
    settings = IngressSettings(model="tiny", served_model_name="tiny", page_size=16, keys=keys)
    return ServingResponses(CallPipeline(decode, None, None, settings), runs=BackgroundRuns(max_running)), decode


def request(method: str, body: dict[str, Any] | None = None, query: str = "", key: str = ALICE) -> Request:
    raw = json.dumps(body).encode() if body is not None else b""
    headers = [(b"authorization", f"Bearer {key}".encode())]
    if body is not None:
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    scope = {"type": "http", "method": method, "path": "/", "headers": headers, "query_string": query.encode()}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    return Request(scope, receive)


def body_of(response: Any) -> Any:
    return json.loads(bytes(response.body))


def event_of(frame: str | bytes) -> dict[str, Any]:
    """One SSE frame's event, checked to be named by its type."""
    text = frame.decode() if isinstance(frame, bytes) else frame
    name, data = text.strip().split("\n")
    event: dict[str, Any] = json.loads(data.removeprefix("data: "))
    assert name == f"event: {event['type']}"
    return event


async def events_of(response: Any) -> list[dict[str, Any]]:
    """The events of an SSE response (what is left of it)."""
    return [event_of(frame) async for frame in response.body_iterator]


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())  # type: ignore[arg-type]


BODY = {"model": "tiny", "input": "Say hello.", "max_output_tokens": 8, "background": True}


def test_a_background_response_is_queued_at_once_then_computed_read_and_continued() -> None:
    async def scenario() -> None:
        api, decode = serving()
        created = body_of(await api.create(request("POST", BODY), "r1"))
        assert created["status"] == "queued" and created["background"] is True and created["output"] == []
        Response.model_validate(created)
        rid = created["id"]
        await settle()
        (stream,) = decode.streams
        stream.release(1)
        await settle()
        running = body_of(await api.retrieve(request("GET"), rid, "r2"))
        assert running["status"] == "in_progress" and running["id"] == rid
        # A running response has no answer to continue yet.
        follow_up = {"model": "tiny", "input": "More.", "previous_response_id": rid}
        refused = await api.create(request("POST", follow_up), "r3")
        assert refused.status_code == 400
        assert body_of(refused)["error"]["code"] == "previous_response_in_progress"
        stream.release()
        await settle()
        done = body_of(await api.retrieve(request("GET"), rid, "r4"))
        assert done["status"] == "completed" and Response.model_validate(done).output_text == "".join(WORDS)
        assert done["usage"]["output_tokens"] == len(WORDS) and len(api.runs) == 0
        # Now it is continued like any stored response: its answer is the history.
        continued = asyncio.create_task(api.create(request("POST", {**follow_up, "background": False}), "r5"))
        await settle()
        decode.streams[-1].release()
        assert (await continued).status_code == 200
        assert len(decode.streams[-1].call.prompt_token_ids) > len(stream.call.prompt_token_ids) + len(WORDS)
        # Other tenants see nothing of it.
        for method in (api.retrieve, api.cancel):
            assert (await method(request("GET", key=BOB), rid, "r6")).status_code == 404

    run(scenario)


def test_cancelling_stops_the_decode_stream_and_stores_the_response_cancelled() -> None:
    async def scenario() -> None:
        api, decode = serving()
        rid = body_of(await api.create(request("POST", BODY), "r1"))["id"]
        await settle()
        decode.streams[0].release(2)
        await settle()
        cancelled = body_of(await api.cancel(request("POST"), rid, "r2"))
        assert cancelled["status"] == "cancelled" and cancelled["output"] == []
        assert decode.streams[0].cancelled and decode.streams[0].sent == 2 and len(api.runs) == 0
        assert body_of(await api.retrieve(request("GET"), rid, "r3"))["status"] == "cancelled"
        # Cancelling again answers the same; a cancelled response cannot be continued.
        assert body_of(await api.cancel(request("POST"), rid, "r4"))["status"] == "cancelled"
        follow_up = {"model": "tiny", "input": "More.", "previous_response_id": rid}
        refused = body_of(await api.create(request("POST", follow_up), "r5"))
        assert refused["error"]["code"] == "previous_response_unanswered"
        # An unknown response is a 404.
        unknown = await api.cancel(request("POST"), "resp_none", "r7")
        assert unknown.status_code == 404

    run(scenario)


def test_one_cancelled_before_its_task_ran_is_stored_cancelled_and_leaves_the_runs() -> None:
    async def scenario() -> None:
        api, decode = serving(max_running=1)
        rid = body_of(await api.create(request("POST", BODY), "r1"))["id"]
        assert body_of(await api.cancel(request("POST"), rid, "r2"))["status"] == "cancelled"
        assert decode.streams == [] and len(api.runs) == 0
        assert body_of(await api.retrieve(request("GET"), rid, "r3"))["status"] == "cancelled"
        # Its place is free again.
        assert (await api.create(request("POST", BODY), "r4")).status_code == 200

    run(scenario)


def test_a_finished_foreground_response_is_not_cancelled_and_delete_cancels_a_running_one() -> None:
    async def scenario() -> None:
        api, decode = serving()
        foreground = asyncio.create_task(api.create(request("POST", {**BODY, "background": False}), "r1"))
        await settle()
        decode.streams[0].release()
        rid = body_of(await foreground)["id"]
        refused = await api.cancel(request("POST"), rid, "r2")
        assert refused.status_code == 400 and body_of(refused)["error"]["param"] == "response_id"
        assert "completed" in body_of(refused)["error"]["message"]

        running = body_of(await api.create(request("POST", BODY), "r3"))["id"]
        await settle()
        assert (await api.delete(request("DELETE"), running, "r4")).status_code == 200
        assert decode.streams[1].cancelled and len(api.runs) == 0
        assert (await api.retrieve(request("GET"), running, "r5")).status_code == 404

    run(scenario)


def test_a_streamed_background_response_is_followed_from_a_sequence_number_while_running_and_once_stored() -> None:
    async def scenario() -> None:
        api, decode = serving()
        posted = await api.create(request("POST", {**BODY, "stream": True}), "r1")
        frames = posted.body_iterator
        await settle()
        (stream,) = decode.streams
        stream.release(2)
        first = [event_of(await anext(frames)) for _ in range(2)]
        rid = first[0]["response"]["id"]
        # A reader that lost the first events picks up after sequence number 3, live.
        resumed = asyncio.create_task(
            events_of(await api.retrieve(request("GET", query="stream=true&starting_after=3"), rid, "r2"))
        )
        await settle()
        stream.release()
        everything = first + await events_of(posted)
        after = await resumed
        numbers = [event["sequence_number"] for event in everything]
        assert numbers == list(range(len(everything)))
        assert after == everything[4:]
        assert everything[-1]["type"] == "response.completed"
        final = Response.model_validate(everything[-1]["response"])
        assert final.output_text == "".join(WORDS) and final.background
        # Once stored, the same events are streamed again, from the start or after any number.
        again = await events_of(await api.retrieve(request("GET", query="stream=true"), rid, "r3"))
        assert again == everything
        tail = await events_of(await api.retrieve(request("GET", query="stream=true&starting_after=7"), rid, "r4"))
        assert tail == everything[8:]
        stored = body_of(await api.retrieve(request("GET"), rid, "r5"))
        assert stored == everything[-1]["response"]

    run(scenario)


def test_the_same_events_as_a_foreground_stream() -> None:
    async def scenario() -> None:
        api, decode = serving()
        streams = []
        for background in (False, True):
            task = asyncio.create_task(
                api.create(request("POST", {**BODY, "stream": True, "background": background}), "r")
            )
            await settle()
            decode.streams[-1].release()
            streams.append(await events_of(await task))

        def shape(events: list[dict[str, Any]]) -> list[tuple[str, Any]]:
            return [(event["type"], event.get("delta")) for event in events]

        assert shape(streams[0]) == shape(streams[1])

    run(scenario)


def test_failures_end_the_response_failed_streamed_or_not() -> None:
    async def scenario() -> None:
        api, decode = serving()
        decode.fail = rate_limited("full")
        rid = body_of(await api.create(request("POST", BODY), "r1"))["id"]
        await settle()
        failed = body_of(await api.retrieve(request("GET"), rid, "r2"))
        assert failed["status"] == "failed" and failed["error"]["code"] == "rate_limit_exceeded"
        Response.model_validate(failed)
        events = await events_of(await api.create(request("POST", {**BODY, "stream": True}), "r3"))
        assert [event["type"] for event in events] == ["response.failed"]
        assert events[0]["response"]["status"] == "failed"

    run(scenario)


def test_bad_reads_and_too_many_running_are_refused() -> None:
    async def scenario() -> None:
        api, decode = serving(max_running=1)
        rid = body_of(await api.create(request("POST", BODY), "r1"))["id"]
        await settle()
        full = await api.create(request("POST", BODY), "r2")
        assert full.status_code == 429 and len(decode.streams) == 1
        # Not made to be streamed: a 400 naming 'stream'.
        not_streamed = await api.retrieve(request("GET", query="stream=true"), rid, "r3")
        assert not_streamed.status_code == 400 and body_of(not_streamed)["error"]["param"] == "stream"
        for query, param in [
            ("stream=maybe", "stream"),
            ("stream=true&starting_after=-1", "starting_after"),
            ("starting_after=x", "starting_after"),
        ]:
            bad = await api.retrieve(request("GET", query=query), rid, "r4")
            assert bad.status_code == 400 and body_of(bad)["error"]["param"] == param, query
        decode.streams[0].release()
        await settle()
        assert len(api.runs) == 0

    run(scenario)


def test_background_needs_the_store() -> None:
    from ingress_recorder import RecordingPipeline

    document = openapi_document("tiny", 100)
    assert_refused(
        RecordingPipeline(), "responses", {"background": True, "store": False}, "background", "store", document
    )


@pytest.mark.parametrize(("value", "expected"), [(None, -1), ("0", 0), ("17", 17)])
def test_query_parameters(value: str | None, expected: int) -> None:
    assert starting_after(value) == expected
    assert stream_query("true") and not stream_query("false") and not stream_query(None)
    for bad in ("-1", "1.5", "", "²", "9" * 19):
        with pytest.raises(APIError):
            starting_after(bad)
