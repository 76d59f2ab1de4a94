"""Two ingress replicas over one shared response keeper (``api.shared_responses``), each with the real Responses
path and call pipeline and a decode pool whose steps the test releases. The keeper is reached as through a Serve
handle, every argument and answer copied as Ray copies them: what one replica stored, the other reads, continues,
lists, references and deletes; a background response computed on one is seen queued and in progress on the other,
followed there when streamed, and cancelled from there (the decode stream stops); a snapshot late for its run's end
is dropped, a run whose replica is gone is cancelled by the keeper itself, and one whose replica stopped while it
ran is stored failed."""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Callable, Coroutine
from types import SimpleNamespace
from typing import Any

import pytest
from openai.types.responses import Response
from test_background_responses import (
    BODY,
    ScriptedDecode,
    body_of,
    event_of,
    events_of,
    request,
    run,
    serving,
    settle,
)

from rayturn.api import response_keeper, shared_responses
from rayturn.api.pipeline import CallPipeline
from rayturn.api.response_keeper import ResponseKeeper
from rayturn.api.response_store import StoredResponse
from rayturn.api.serving_responses import ServingResponses
from rayturn.api.settings import IngressSettings
from rayturn.api.tenants import KeyTable


class Method:
    def __init__(self, method: Callable[..., Coroutine[Any, Any, Any]], handle: KeeperHandle | None = None) -> None:
        self.method = method
        self.handle = handle
        self.calls = 0
        self.sent_bytes = 0  # pickled arguments, as they would cross to the keeper's process

    def remote(self, *args: object) -> Coroutine[Any, Any, Any]:
        self.calls += 1
        self.sent_bytes += len(pickle.dumps(args))

        async def call() -> Any:
            if self.handle is not None and self.handle.stopped:  # a stopped process's calls never arrive
                await asyncio.get_running_loop().create_future()
            answer = await self.method(*pickle.loads(pickle.dumps(args)))
            return pickle.loads(pickle.dumps(answer))

        return call()


class KeeperHandle:
    """A Serve handle's shape over a ``ResponseKeeper`` of this event loop: ``handle.get.remote(...)``.
    ``stopped``: the replica holding it stopped (what it sends from then on never reaches the keeper)."""

    def __init__(self, keeper: ResponseKeeper) -> None:
        self.keeper = keeper
        self.methods: dict[str, Method] = {}
        self.stopped = False

    def __getattr__(self, name: str) -> Method:
        return self.methods.setdefault(name, Method(getattr(self.keeper, name), self))


def replicas() -> tuple[ServingResponses, ServingResponses, ScriptedDecode, KeeperHandle]:
    decode = ScriptedDecode()
    keys = KeyTable.build((), {"alice": ("alice-key",), "bob": ("bob-key",)})
    settings = IngressSettings(model="tiny", served_model_name="tiny", page_size=16, keys=keys)
    handle = KeeperHandle(ResponseKeeper())
    one, other = (ServingResponses(CallPipeline(decode, None, None, settings), handle) for _ in range(2))
    return one, other, decode, handle


async def answer(api: ServingResponses, decode: ScriptedDecode, body: dict[str, Any]) -> dict[str, Any]:
    """The response to a foreground ``body``, its steps released once its call reached the decode pool."""
    task = asyncio.create_task(api.create(request("POST", body), "r"))
    await settle()
    decode.streams[-1].release()
    answered: dict[str, Any] = body_of(await task)
    return answered


def test_what_one_replica_stored_the_other_reads_continues_lists_references_and_deletes() -> None:
    async def scenario() -> None:
        one, other, decode, handle = replicas()
        first = await answer(one, decode, {"model": "tiny", "input": "List files.", "max_output_tokens": 8})
        assert first["status"] == "completed" and one.store.shared and other.store.shared
        read = body_of(await other.retrieve(request("GET"), first["id"], "r"))
        assert read == first
        Response.model_validate(read)
        continued = {"model": "tiny", "input": "And the tests?", "previous_response_id": first["id"]}
        second = await answer(other, decode, continued)
        # The other replica's prompt holds the first turn: its question, then its answer.
        prompt = decode.streams[1].call.prompt_token_ids
        assert second["status"] == "completed" and len(prompt) > len(decode.streams[0].call.prompt_token_ids)
        items = body_of(await one.input_items(request("GET", query="order=asc"), second["id"], "r"))["data"]
        assert [item["type"] for item in items] == ["message", "message", "message"]
        assert items[1]["id"] == first["output"][0]["id"]
        # A reference to the first answer's item, resolved on the other replica, makes the same prompt.
        by_reference = {
            "model": "tiny",
            "input": [
                {"role": "user", "content": "List files."},
                {"type": "item_reference", "id": first["output"][0]["id"]},
                {"role": "user", "content": "And the tests?"},
            ],
        }
        await answer(other, decode, by_reference)
        assert decode.streams[2].call.prompt_token_ids == prompt
        # Bob finds none of it on either replica.
        for api in (one, other):
            assert (await api.retrieve(request("GET", key="bob-key"), first["id"], "r")).status_code == 404
        # Deleted on one, gone on both.
        assert body_of(await one.delete(request("DELETE"), first["id"], "r"))["deleted"] is True
        for api in (one, other):
            assert (await api.retrieve(request("GET"), first["id"], "r")).status_code == 404
        refused = body_of(await other.create(request("POST", continued), "r"))
        assert refused["error"]["code"] == "previous_response_not_found"
        assert handle.methods["put"].calls == 3 and handle.methods["find_items"].calls == 1

    run(scenario)


def test_a_background_response_runs_on_one_replica_and_is_seen_and_cancelled_from_the_other() -> None:
    async def scenario() -> None:
        one, other, decode, handle = replicas()
        rid = body_of(await one.create(request("POST", BODY), "r1"))["id"]
        assert body_of(await other.retrieve(request("GET"), rid, "r"))["status"] == "queued"
        await settle()
        decode.streams[0].release(2)
        await settle()
        assert body_of(await other.retrieve(request("GET"), rid, "r"))["status"] == "in_progress"
        items = body_of(await other.input_items(request("GET"), rid, "r"))["data"]
        assert [item["content"][0]["text"] for item in items] == ["Say hello."]
        follow_up = {"model": "tiny", "input": "More.", "previous_response_id": rid}
        refused = body_of(await other.create(request("POST", follow_up), "r"))
        assert refused["error"]["code"] == "previous_response_in_progress"
        # Bob cannot cancel it; alice, through the other replica, stops the decode stream.
        assert (await other.cancel(request("POST", key="bob-key"), rid, "r")).status_code == 404
        cancelled = body_of(await other.cancel(request("POST"), rid, "r2"))
        assert cancelled["status"] == "cancelled" and cancelled["output"] == []
        assert decode.streams[0].cancelled and decode.streams[0].sent == 2 and len(one.runs) == 0
        for api in (one, other):
            assert body_of(await api.retrieve(request("GET"), rid, "r"))["status"] == "cancelled"
        # A running one deleted through the other replica is cancelled first, then gone everywhere.
        rid = body_of(await one.create(request("POST", BODY), "r3"))["id"]
        await settle()
        assert body_of(await other.delete(request("DELETE"), rid, "r"))["deleted"] is True
        assert decode.streams[1].cancelled and len(one.runs) == 0
        for api in (one, other):
            assert (await api.retrieve(request("GET"), rid, "r")).status_code == 404
        assert not handle.keeper._runs  # no watch is left waiting

    run(scenario)


def test_a_streamed_background_response_is_followed_from_the_other_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared_responses, "FOLLOW_EVERY_S", 0.01)
    monkeypatch.setattr(shared_responses, "SNAPSHOT_EVERY_S", 0.0)  # every event stored as it comes

    async def scenario() -> None:
        one, other, decode, handle = replicas()
        created = await one.create(request("POST", {**BODY, "stream": True}), "r1")
        await settle()
        decode.streams[0].release(2)
        await settle()
        frames = created.body_iterator
        first = event_of(await frames.__anext__())
        assert first["type"] == "response.created"
        rid = first["response"]["id"]
        following = await other.retrieve(request("GET", query="stream=true&starting_after=0"), rid, "r")
        followed: list[dict[str, Any]] = []

        async def collect() -> None:
            async for frame in following.body_iterator:
                followed.append(event_of(frame))

        follow = asyncio.create_task(collect())
        await asyncio.sleep(0.1)
        # While it runs, the other replica streams what the computing one stored so far: two words.
        assert not follow.done() and followed[0]["type"] == "response.in_progress"
        words = [event["delta"] for event in followed if event["type"] == "response.output_text.delta"]
        assert words == ["Hello", " there"]
        decode.streams[0].release()
        rest = [first, *[event_of(frame) async for frame in frames]]
        await asyncio.wait_for(follow, 5)
        assert followed == rest[1:] and rest[-1]["type"] == "response.completed"
        assert [event["sequence_number"] for event in rest] == list(range(len(rest)))
        again = await events_of(await other.retrieve(request("GET", query="stream=true&starting_after=3"), rid, "r"))
        assert again == rest[4:]
        # Stored whole three times (queued, in progress, its end); in between only the new events crossed, each
        # once: the snapshots together weigh about what the events do, not what every prefix of them does.
        appends = handle.methods["append_events"]
        assert handle.methods["put"].calls == 3 and appends.calls >= 3
        assert appends.sent_bytes < 3 * len(pickle.dumps(rest)) + 2000 * appends.calls

    run(scenario)


def test_the_keeper_drops_a_late_snapshot_and_cancels_a_run_nobody_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(response_keeper, "CANCEL_WAIT_S", 0.05)

    def entry(status: str) -> StoredResponse:
        body = {"id": "resp_1", "status": status, "output": [], "usage": None}
        return StoredResponse("resp_1", "alice", body, (), 100)

    async def scenario() -> None:
        keeper = ResponseKeeper()
        await keeper.put(entry("in_progress"))
        watching = asyncio.create_task(keeper.watch("alice", "resp_1"))
        await asyncio.sleep(0)  # the watch waits
        await keeper.put(entry("completed"))
        assert await watching is False  # the run ended: nothing to cancel
        assert await keeper.watch("alice", "resp_1") is False  # a watch that comes after the end answers at once
        await keeper.put(entry("in_progress"))  # sent before the end, arrived after it
        found = await keeper.get("alice", "resp_1")
        assert found is not None and found.body["status"] == "completed"
        # A cancel of a completed response answers it as it is; an unknown or another tenant's is None.
        cancelled = await keeper.cancel("alice", "resp_1")
        assert cancelled is not None and cancelled.body["status"] == "completed"
        assert await keeper.cancel("bob", "resp_1") is None and await keeper.cancel("alice", "resp_2") is None
        # Running with nobody watching it (its replica restarted): cancelled by the keeper after the wait.
        await keeper.put(replace_id(entry("in_progress"), "resp_3"))
        cancelled = await keeper.cancel("alice", "resp_3")
        assert cancelled is not None and cancelled.body["status"] == "cancelled" and not keeper._runs

    run(scenario)


def replace_id(entry: StoredResponse, response_id: str) -> StoredResponse:
    return StoredResponse(response_id, entry.tenant, {**entry.body, "id": response_id}, (), entry.num_bytes)


def test_a_keeper_that_is_away_costs_the_stored_response_not_the_answer(caplog: pytest.LogCaptureFixture) -> None:
    async def away(entry: StoredResponse) -> None:
        raise RuntimeError("the responses replica is restarting")

    async def scenario() -> None:
        one, other, decode, handle = replicas()
        handle.methods["put"] = Method(away)
        answered = await answer(one, decode, {"model": "tiny", "input": "List files.", "max_output_tokens": 8})
        assert answered["status"] == "completed" and answered["output"]
        assert (await other.retrieve(request("GET"), answered["id"], "r")).status_code == 404

    with caplog.at_level("WARNING", logger="rayturn.api.shared_responses"):
        run(scenario)
    assert "was not stored: RuntimeError: the responses replica is restarting" in caplog.text


def test_a_background_response_runs_though_its_client_went_while_it_was_being_stored() -> None:
    async def scenario() -> None:
        one, other, decode, handle = replicas()
        gate, stored = asyncio.Event(), []

        async def slow_put(entry: StoredResponse) -> None:
            await gate.wait()
            stored.append(entry.body["status"])
            await handle.keeper.put(entry)

        handle.methods["put"] = Method(slow_put)
        creating = asyncio.create_task(one.create(request("POST", BODY), "r1"))
        await settle()
        creating.cancel()  # as Serve cancels the handler of a client that went
        await settle()
        assert creating.cancelled() and len(one.runs) == 1
        gate.set()
        await settle()
        decode.streams[0].release()
        await settle()
        assert stored == ["queued", "in_progress", "completed"] and len(one.runs) == 0
        [rid] = {key[1] for key in handle.keeper.store._entries}
        assert body_of(await other.retrieve(request("GET"), rid, "r"))["status"] == "completed"

    run(scenario)


def test_a_cancel_from_the_other_replica_stops_a_run_whose_queued_state_was_stored_late(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(response_keeper, "CANCEL_WAIT_S", 1.0)

    async def scenario() -> None:
        one, other, decode, handle = replicas()
        gate = asyncio.Event()

        async def slow_put(entry: StoredResponse) -> None:
            await gate.wait()
            await handle.keeper.put(entry)

        handle.methods["put"] = Method(slow_put)
        creating = asyncio.create_task(one.create(request("POST", BODY), "r1"))
        await settle()  # a watch sent now would find nothing stored, and answer at once
        gate.set()
        rid = body_of(await creating)["id"]
        await settle()
        decode.streams[0].release(1)
        await settle()
        cancelled = body_of(await other.cancel(request("POST"), rid, "r2"))
        # Stopped by its own replica, not given up on by the keeper after the wait.
        assert cancelled["status"] == "cancelled" and decode.streams[0].cancelled and len(one.runs) == 0

    run(scenario)


def test_a_run_whose_replica_stopped_is_stored_failed_and_a_live_slow_one_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(response_keeper, "WATCH_EVERY_S", 0.02)
    monkeypatch.setattr(response_keeper, "LOST_AFTER_S", 0.2)
    monkeypatch.setattr(shared_responses, "FOLLOW_EVERY_S", 0.01)
    monkeypatch.setattr(shared_responses, "SNAPSHOT_EVERY_S", 0.0)

    async def scenario() -> None:
        decode = ScriptedDecode()
        settings = IngressSettings(model="tiny", served_model_name="tiny", page_size=16)
        keeper = ResponseKeeper()
        handles = KeeperHandle(keeper), KeeperHandle(keeper)
        one, other = (ServingResponses(CallPipeline(decode, None, None, settings), handle) for handle in handles)
        created = await one.create(request("POST", {**BODY, "stream": True}), "r1")
        await settle()
        decode.streams[0].release(2)
        await settle()
        rid = event_of(await created.body_iterator.__anext__())["response"]["id"]
        # Slow but alive: its replica watches it, so it stays in progress past the loss limit.
        await asyncio.sleep(0.5)
        assert body_of(await other.retrieve(request("GET"), rid, "r"))["status"] == "in_progress"
        assert handles[0].methods["watch"].calls > 5  # answered "nothing happened" and watched again
        following = await other.retrieve(request("GET", query="stream=true&starting_after=0"), rid, "r")
        followed = asyncio.create_task(events_of(following))
        handles[0].stopped = True  # its replica stops: no watch, snapshot or end reaches the keeper again
        failed = body_of(await other.retrieve(request("GET"), rid, "r"))
        assert failed["status"] == "in_progress"  # not yet: the keeper heard from it a moment ago
        await asyncio.sleep(0.5)
        failed = body_of(await other.retrieve(request("GET"), rid, "r"))
        assert failed["status"] == "failed" and failed["output"] == [] and failed["usage"] is None
        assert failed["error"] == {"code": "server_error", "message": response_keeper.LOST_MESSAGE}
        Response.model_validate(failed)
        # A follower's stream ends as a failed run's does, numbered on from the events stored.
        events = await asyncio.wait_for(followed, 5)
        assert events[-1]["type"] == "response.failed" and events[-1]["response"]["status"] == "failed"
        assert [event["sequence_number"] for event in events] == list(range(1, len(events) + 1))
        words = [event["delta"] for event in events if event["type"] == "response.output_text.delta"]
        assert words == ["Hello", " there"]
        # Settled: a continuation is told it has no answer (not to wait for it), a cancel that it no longer runs.
        continued = {"model": "tiny", "input": "Again.", "previous_response_id": rid}
        refused = body_of(await other.create(request("POST", continued), "r2"))
        assert refused["error"]["code"] == "previous_response_unanswered" and "failed" in refused["error"]["message"]
        refused = body_of(await other.cancel(request("POST"), rid, "r3"))
        assert refused["error"]["code"] == "response_not_running" and "is failed" in refused["error"]["message"]
        # What the stopped replica sends once it is heard again does not undo the failure.
        handles[0].stopped = False
        decode.streams[0].release()
        await asyncio.sleep(0.1)
        assert len(one.runs) == 0
        assert body_of(await other.retrieve(request("GET"), rid, "r"))["status"] == "failed"

    run(scenario)


def test_a_replica_keeping_its_own_responses_never_counts_its_runs_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """With one ingress replica nobody watches its runs in the keeper (it holds it): a long run stays running."""
    monkeypatch.setattr(response_keeper, "LOST_AFTER_S", 0.05)

    async def scenario() -> None:
        api, decode = serving()
        assert not api.store.shared
        rid = body_of(await api.create(request("POST", BODY), "r1"))["id"]
        await settle()
        decode.streams[0].release(1)
        await asyncio.sleep(0.3)
        assert body_of(await api.retrieve(request("GET"), rid, "r"))["status"] == "in_progress"
        # A continuation asks the keeper itself how the run stands: still in progress.
        follow_up = {"model": "tiny", "input": "More.", "previous_response_id": rid}
        refused = body_of(await api.create(request("POST", follow_up), "r2"))
        assert refused["error"]["code"] == "previous_response_in_progress"
        decode.streams[0].release()
        await settle()
        assert body_of(await api.retrieve(request("GET"), rid, "r"))["status"] == "completed"

    run(scenario)


def test_the_keeper_extends_a_streamed_run_only_where_its_events_end() -> None:
    def entry(status: str, events: tuple[dict[str, Any], ...] = ()) -> StoredResponse:
        body = {"id": "resp_1", "status": status, "output": [], "usage": None}
        return StoredResponse("resp_1", "alice", body, (), 100, events, (), True)

    def event(number: int) -> dict[str, Any]:
        return {"type": "response.output_text.delta", "sequence_number": number, "delta": "x"}

    async def scenario() -> None:
        keeper = ResponseKeeper()
        running = {"id": "resp_1", "status": "in_progress", "output": [], "usage": None}
        assert await keeper.append_events("alice", "resp_1", running, 0, [event(0)]) is False  # nothing to extend
        await keeper.put(entry("in_progress"))
        assert await keeper.append_events("alice", "resp_1", running, 0, [event(0), event(1)]) is True
        assert await keeper.append_events("alice", "resp_1", running, 2, [event(2)]) is True
        assert await keeper.append_events("alice", "resp_1", running, 5, [event(5)]) is False  # a snapshot lost
        assert await keeper.append_events("bob", "resp_1", running, 3, [event(3)]) is False
        found = await keeper.get("alice", "resp_1")
        assert found is not None and [e["sequence_number"] for e in found.events] == [0, 1, 2]
        assert found.num_bytes > 100 and found.streamed
        await keeper.put(entry("completed", found.events))
        assert await keeper.append_events("alice", "resp_1", running, 3, [event(3)]) is True  # ended: dropped
        ended = await keeper.get("alice", "resp_1")
        assert ended is not None and ended.body["status"] == "completed" and len(ended.events) == 3

    run(scenario)


def test_a_snapshot_the_keeper_cannot_extend_is_stored_whole() -> None:
    class Refusing:
        async def append_events(self, *args: Any) -> bool:
            return False

    async def scenario() -> None:
        run_ = SimpleNamespace(tenant="alice", response_id="resp_1", body={"status": "in_progress"}, events=[1, 2])
        stored: list[int] = []

        async def whole() -> None:
            stored.append(len(run_.events))

        snapshots = shared_responses.Snapshots()
        await snapshots.store(Refusing(), run_, whole)  # type: ignore[arg-type]
        assert stored == [2] and snapshots.sent == 2

    run(scenario)
