"""The response store every ingress replica reads and writes: ``previous_response_id`` across replicas.

Serve's proxy hands each call to any ingress replica, so with more than one
a continuation, a ``GET``, an item reference or a cancel would otherwise
reach a replica that never saw the response. With ``server.ingress_replicas``
above 1 the application runs one more deployment, ``responses``, one replica
of ``ResponseKeeper``, and every ingress replica keeps its responses there;
with one ingress replica the same keeper lives in that replica's process.

A background response is computed by the replica its create call reached.
That replica keeps its state in the keeper as it goes: queued, in progress,
its new events about once a second while it streams (each event crosses
once), and its end. So any replica
answers ``GET`` (a streamed one is followed from the keeper), lists its input
items, and refuses to continue it until it ended. A cancel reaching another
replica asks the keeper, which wakes the computing replica's watch; that
replica stops the run and stores it cancelled, and the cancel is answered
with that. When no answer comes within ``response_keeper.CANCEL_WAIT_S``
(the computing replica is gone), the keeper stores the response cancelled.
The watch also tells the keeper that the computing replica lives: a run it
stopped hearing of (that replica stopped) is stored failed, so a client
polling it learns so rather than reading ``in_progress`` until it expires.

``Responses`` is what the ingress holds: the keeper, local or behind a Serve
handle, behind the same coroutines.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from .background_responses import BackgroundRun, BackgroundRuns
from .protocol import JSON
from .response_keeper import ResponseKeeper
from .response_store import DEFAULT_TTL_S, RUNNING, StoredResponse
from .responses_items import referenced_ids, resolve_references

logger = logging.getLogger(__name__)

# How often a replica following another's streamed background response reads the keeper again.
FOLLOW_EVERY_S = 0.5
# How often the computing replica stores a streamed background response's events while it runs.
SNAPSHOT_EVERY_S = 1.0
# How long the computing replica waits to watch its run again after the keeper did not answer.
WATCH_RETRY_S = 1.0


class Responses:
    """The ingress replica's way to the keeper: one of its own, or the application's ``responses`` deployment."""

    def __init__(self, keeper: Any = None) -> None:
        self.shared = keeper is not None
        self._keeper = keeper if self.shared else ResponseKeeper(watched=False)
        self.ttl_s = DEFAULT_TTL_S  # the keeper's store, local or shared, is built with the defaults

    async def _call(self, method: str, *args: object) -> Any:
        if self.shared:
            return await getattr(self._keeper, method).remote(*args)
        return await getattr(self._keeper, method)(*args)

    async def put(self, entry: StoredResponse) -> None:
        """Keep ``entry``; the keeper away, the call it answers is answered all the same, its response not kept."""
        try:
            await self._call("put", entry)
        except Exception as err:
            logger.warning("response %s was not stored: %s: %s", entry.response_id, type(err).__name__, err)

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        return await self._call("get", tenant, response_id)

    async def append_events(self, tenant: str, response_id: str, body: JSON, start: int, events: list[JSON]) -> bool:
        """A streamed run's new events (``ResponseKeeper.append_events``); the keeper away, True: its end, stored
        whole, will hold them."""
        try:
            appended: bool = await self._call("append_events", tenant, response_id, body, start, events)
        except Exception as err:
            logger.warning("events of %s were not stored: %s: %s", response_id, type(err).__name__, err)
            return True
        return appended

    async def delete(self, tenant: str, response_id: str) -> bool:
        return await self._call("delete", tenant, response_id)

    async def watch(self, tenant: str, response_id: str) -> bool | None:
        return await self._call("watch", tenant, response_id)

    async def cancel(self, tenant: str, response_id: str) -> StoredResponse | None:
        return await self._call("cancel", tenant, response_id)

    async def relay_cancel(self, run: BackgroundRun, runs: BackgroundRuns, queued: asyncio.Task[None]) -> None:
        """Watch ``run`` in the keeper until it ended, and stop it when a cancel of it reaches another replica.
        The watch goes once ``queued`` stored the run: a keeper with no running entry answers a watch at once.
        A keeper that is away is asked again (its answers are how it knows this replica still computes it)."""
        await asyncio.wait([queued])
        while run.running:
            try:
                cancel = await self.watch(run.tenant, run.response_id)
            except Exception as err:
                logger.debug("watch of %s failed: %s: %s", run.response_id, type(err).__name__, err)
                await asyncio.sleep(WATCH_RETRY_S)
                continue
            if cancel is None:  # nothing happened: watch again
                continue
            if cancel:
                await runs.cancel(run)
            return

    async def resolve(self, body: object, tenant: str) -> object:
        """``body`` with its item references replaced by the tenant's stored items (a 400 naming one unknown)."""
        item_ids = referenced_ids(body)
        found: dict[str, JSON] = await self._call("find_items", tenant, item_ids) if item_ids else {}
        return resolve_references(body, found.get)

    async def follow(self, entry: StoredResponse, after: int) -> AsyncIterator[JSON]:
        """A stored response's events after sequence number ``after``, read again from the keeper while the
        replica computing it keeps storing them, until it ended."""
        sent = after + 1
        while True:
            new = entry.events[sent:]
            for event in new:
                yield event
            sent += len(new)
            if entry.body["status"] not in RUNNING:
                return
            await asyncio.sleep(FOLLOW_EVERY_S)
            again = await self.get(entry.tenant, entry.response_id)
            if again is None:  # deleted meanwhile
                return
            entry = again


class Snapshots:
    """When and what the computing replica stores of a streamed run while it runs: about every
    ``SNAPSHOT_EVERY_S``, its latest body and the events since the last time."""

    def __init__(self) -> None:
        self._last = time.monotonic()
        self.sent = 0  # events the keeper holds

    async def store(self, responses: Responses, run: BackgroundRun, whole: Callable[[], Awaitable[None]]) -> None:
        """Add the run's new events to its entry; ``whole`` stores the entry anew when the keeper has no such
        entry to extend (it restarted, or an earlier snapshot was lost)."""
        if not await responses.append_events(run.tenant, run.response_id, run.body, self.sent, run.events[self.sent :]):
            await whole()
        self.sent = len(run.events)

    def due(self) -> bool:
        now = time.monotonic()
        if now - self._last < SNAPSHOT_EVERY_S:
            return False
        self._last = now
        return True
