"""``ResponseKeeper``: the response store behind coroutines, as the ``responses`` deployment runs it for every
ingress replica (``shared_responses``), with the signals that let one replica cancel a run another computes.

The replica computing a background response watches it here until it ended,
one ``watch`` call at a time, each answered within ``WATCH_EVERY_S``: a cancel
was asked, it ended, or nothing happened (it watches again). So the keeper
hears from that replica at least that often. A response still running that
nobody stored or watched for ``LOST_AFTER_S`` lost its replica (it stopped:
its restart loses the runs it computed) and is stored ``failed`` with a
``server_error``, rather than shown in progress until it expires. An end,
once stored, stays: what the computing replica sends after a cancel or a loss
was settled without it is dropped.

It also keeps the sessions' energy totals (``session_energy``), so a session's
``session_joules`` counts its calls on every ingress replica.

It imports only the store, so its replica starts without the model's libraries.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from .response_store import RUNNING, ResponseStore, StoredResponse, json_size
from .session_energy import SessionEnergy

if TYPE_CHECKING:
    from .protocol import JSON

# How long a cancel waits for the replica computing the response to store its end.
CANCEL_WAIT_S = 10.0
# How long one watch waits before it answers that nothing happened.
WATCH_EVERY_S = 5.0
# How long a running response may go unwatched and unstored before its replica counts as gone.
LOST_AFTER_S = 30.0
# Sessions whose energy totals are kept, over every ingress replica (the most recent).
MAX_SHARED_SESSIONS = 65536
LOST_MESSAGE = "The ingress replica computing this response stopped before it ended; create the response again."


class _Run:
    """A running response's signals in the keeper: a cancel was asked; it ended."""

    def __init__(self) -> None:
        self.wake = asyncio.Event()  # a cancel was asked, or the response ended
        self.ended = asyncio.Event()


class ResponseKeeper:
    """A ``ResponseStore`` behind coroutines, with the signals that let one replica cancel another's run."""

    def __init__(self, store: ResponseStore | None = None, *, watched: bool = True) -> None:
        """``watched``: every running response's computing replica watches it here (``shared_responses``), so
        one nobody watches is lost; False for the keeper an ingress replica holds for itself (nobody watches)."""
        self.store = ResponseStore() if store is None else store
        self.watched = watched
        self._runs: dict[tuple[str, str], _Run] = {}
        self._heard: dict[tuple[str, str], float] = {}  # when a running response's replica last called
        self.session_energy = SessionEnergy(MAX_SHARED_SESSIONS)

    async def add_session_joules(self, session_id: str, energy_j: float) -> float:
        """Add a call's joules to its session (named with its tenant); returns the session's total."""
        return self.session_energy.add(session_id, energy_j)

    async def put(self, entry: StoredResponse) -> None:
        key = (entry.tenant, entry.response_id)
        running = entry.body["status"] in RUNNING
        current = self.store.get(*key)
        if current is not None and current.body["status"] not in RUNNING:
            return  # ended already: a snapshot sent before its end, or an end settled here (cancelled, lost)
        self.store.put(entry)
        if running:
            self._heard[key] = time.monotonic()
        else:
            self._ended(key)

    def _ended(self, key: tuple[str, str]) -> None:
        self._heard.pop(key, None)
        if (run := self._runs.pop(key, None)) is not None:
            run.ended.set()
            run.wake.set()

    def _live(self, found: StoredResponse | None) -> StoredResponse | None:
        """``found``, or, running with no word from its replica for ``LOST_AFTER_S``, stored failed."""
        if not self.watched or found is None or found.body["status"] not in RUNNING:
            return found
        key = (found.tenant, found.response_id)
        now = time.monotonic()
        if now - self._heard.setdefault(key, now) <= LOST_AFTER_S:
            return found
        return self._end_here(found, "failed", {"code": "server_error", "message": LOST_MESSAGE})

    def _end_here(self, found: StoredResponse, status: str, error: JSON | None = None) -> StoredResponse | None:
        """Store a running response ended by the keeper itself (its replica no longer answers for it), its output
        dropped; a follower's stream of a failed one ends with ``response.failed``, as a failed run's does. One
        that ended (or went) meanwhile is answered as it stands."""
        key = (found.tenant, found.response_id)
        current = self.store.get(*key)
        if current is None or current.body["status"] not in RUNNING:
            return current
        body = {**current.body, "status": status, "error": error, "output": [], "usage": None}
        events = current.events
        if current.streamed and status == "failed":
            events = (*events, {"type": "response.failed", "sequence_number": len(events), "response": body})
        self.store.put(replace(current, body=body, events=events))
        self._ended(key)
        return self.store.get(*key)

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        return self._live(self.store.get(tenant, response_id))

    async def append_events(
        self, tenant: str, response_id: str, body: JSON, start: int, events: Sequence[JSON]
    ) -> bool:
        """A streamed run's snapshot: its latest body, and its events from number ``start`` on (those before were
        sent already), so each event crosses once. False when the entry is not what it extends (gone, or its
        events do not end at ``start``): the caller then stores it whole."""
        key = (tenant, response_id)
        current = self.store.get(*key)
        if current is not None and current.body["status"] not in RUNNING:
            return True  # ended already: nothing to add
        if current is None or len(current.events) != start or body["status"] not in RUNNING:
            return False
        num_bytes = current.num_bytes + json_size(list(events))
        self.store.put(replace(current, body=body, events=(*current.events, *events), num_bytes=num_bytes))
        self._heard[key] = time.monotonic()
        return True

    async def find_items(self, tenant: str, item_ids: Sequence[str]) -> dict[str, JSON]:
        """The tenant's stored items of those ids that are kept."""
        found = {item_id: self.store.find_item(tenant, item_id) for item_id in item_ids}
        return {item_id: item for item_id, item in found.items() if item is not None}

    async def delete(self, tenant: str, response_id: str) -> bool:
        return self.store.delete(tenant, response_id)

    async def watch(self, tenant: str, response_id: str) -> bool | None:
        """The computing replica's watch of its running response: a cancel was asked (True), it ended (False),
        or nothing happened within ``WATCH_EVERY_S`` (None: watch again)."""
        key = (tenant, response_id)
        found = self.store.get(tenant, response_id)
        if found is None or found.body["status"] not in RUNNING:  # ended before the watch came
            return False
        self._heard[key] = time.monotonic()
        run = self._runs.setdefault(key, _Run())
        try:
            await asyncio.wait_for(run.wake.wait(), WATCH_EVERY_S)
        except TimeoutError:
            return None
        return not run.ended.is_set()

    async def cancel(self, tenant: str, response_id: str) -> StoredResponse | None:
        """Ask the computing replica to stop a running response and wait for its end; None when unknown."""
        found = self._live(self.store.get(tenant, response_id))
        if found is None or found.body["status"] not in RUNNING:
            return found
        run = self._runs.setdefault((tenant, response_id), _Run())
        run.wake.set()
        try:
            await asyncio.wait_for(run.ended.wait(), CANCEL_WAIT_S)
        except TimeoutError:  # nobody computes it any more: it is cancelled here
            return self._end_here(found, "cancelled")
        return self.store.get(tenant, response_id)
