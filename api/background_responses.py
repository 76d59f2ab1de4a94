"""Responses made with ``background: true``: computed after the answer to ``POST /v1/responses`` went out.

The create call answers at once with the response ``queued`` (or, streamed,
with its events as they come); a task on the ingress replica computes it,
whatever becomes of that connection. While it runs it is found here, under
its tenant: ``GET /v1/responses/{id}`` shows it ``in_progress``, and
``?stream=true&starting_after=N`` follows a streamed one from the event
after sequence number N. ``POST /v1/responses/{id}/cancel`` stops it. Once
it ended (``completed``, ``incomplete``, ``failed`` or ``cancelled``) it is in
the response store, with its events when it was streamed, and leaves here.

A replica runs at most ``max_running`` background responses at once (a 429
past that), so a client cannot queue unbounded work it never waits for. A
replica's restart loses those still running. With several ingress replicas the
others see a run through the response store they share (``shared_responses``),
which stores one that lost its replica failed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from .errors import invalid_request, rate_limited
from .protocol import JSON
from .response_store import RUNNING
from .responses_bodies import ResponseFrame
from .responses_stream import sse_event
from .serving import NO_CACHE

logger = logging.getLogger(__name__)

DEFAULT_MAX_RUNNING = 128


def starting_after(value: str | None) -> int:
    """The ``starting_after`` query parameter: the sequence number after which to stream (-1: none given)."""
    if value is None:
        return -1
    if not (value.isascii() and value.isdigit()) or len(value) > 18:
        message = f"Invalid 'starting_after': expected an event's sequence number (an integer >= 0), got {value!r}."
        raise invalid_request(message, param="starting_after")
    return int(value)


def stream_query(value: str | None) -> bool:
    """The ``stream`` query parameter of ``GET /v1/responses/{id}``."""
    if value is None or value in ("false", "0"):
        return False
    if value in ("true", "1"):
        return True
    raise invalid_request(f"Invalid 'stream': expected true or false, got {value!r}.", param="stream")


def event_stream(events: AsyncIterator[JSON]) -> StreamingResponse:
    """A background response's events as a stream (no replica header: the call is its task's)."""
    return StreamingResponse(sse_events(events), media_type="text/event-stream", headers=NO_CACHE)


async def sse_events(events: AsyncIterator[JSON]) -> AsyncIterator[str]:
    async for event in events:
        yield sse_event(event)


class BackgroundRun:
    """One background response while it runs: its latest body, its events so far (streamed), the task."""

    def __init__(
        self, tenant: str, frame: ResponseFrame, *, streamed: bool, input_items: tuple[JSON, ...] = ()
    ) -> None:
        self.tenant = tenant
        self.frame = frame
        self.streamed = streamed
        self.input_items = input_items  # what ``GET /v1/responses/{id}/input_items`` lists while it runs
        self.body = frame.body("queued", [])
        self.events: list[JSON] = []
        self.task: asyncio.Task[None] | None = None
        # Done once its end is stored and it left the runs.
        self.saved: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._changed = asyncio.Event()

    @property
    def response_id(self) -> str:
        return self.frame.response_id

    @property
    def running(self) -> bool:
        return self.body["status"] in RUNNING

    def update(self, body: JSON) -> None:
        self.body = body
        self._changed.set()

    def push(self, event: JSON) -> None:
        self.events.append(event)
        self._changed.set()

    def cancelled(self) -> None:
        """Mark the run cancelled (its output so far dropped: a cut answer is not one to continue)."""
        self.update(self.frame.body("cancelled", []))

    async def follow(self, after: int) -> AsyncIterator[JSON]:
        """The events after sequence number ``after``, live, until the run ends."""
        sent = after + 1
        while True:
            self._changed.clear()
            while sent < len(self.events):
                yield self.events[sent]
                sent += 1
            if not self.running:
                return
            await self._changed.wait()


class BackgroundRuns:
    """The background responses one ingress replica is computing, by (tenant, response id)."""

    def __init__(self, max_running: int = DEFAULT_MAX_RUNNING) -> None:
        self.max_running = max_running
        self._runs: dict[tuple[str, str], BackgroundRun] = {}

    def __len__(self) -> int:
        return len(self._runs)

    def add(self, run: BackgroundRun) -> None:
        """Hold ``run``; a 429 when ``max_running`` already run."""
        if len(self._runs) >= self.max_running:
            message = f"This replica is computing {len(self._runs)} background responses, its most; retry shortly."
            raise rate_limited(message)
        self._runs[(run.tenant, run.response_id)] = run

    def get(self, tenant: str, response_id: str) -> BackgroundRun | None:
        return self._runs.get((tenant, response_id))

    def discard(self, run: BackgroundRun) -> None:
        self._runs.pop((run.tenant, run.response_id), None)

    def saved(self, run: BackgroundRun, saving: asyncio.Future[None]) -> None:
        """``run``'s end stored (``saving`` done): it leaves the runs."""
        if not saving.cancelled() and saving.exception() is not None:
            logger.warning("background response %s was not stored: %r", run.response_id, saving.exception())
        self.discard(run)
        run.saved.set_result(None)

    async def cancel(self, run: BackgroundRun) -> None:
        """Stop ``run``'s task (the decode replica stops its sequence) and mark it cancelled; returns once its end
        is stored, so the caller is answered after every replica can read it."""
        if run.running:
            run.cancelled()
            if run.task is not None and not run.task.done():
                run.task.cancel()
        await asyncio.shield(run.saved)
