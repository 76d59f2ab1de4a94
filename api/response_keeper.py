"""``ResponseKeeper``: the response store behind coroutines, as the ``responses`` deployment runs it for every
ingress replica (``shared_responses``), with the signals that let one replica cancel a run another computes.

It imports only the store, so its replica starts without the model's libraries.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from .response_store import RUNNING, ResponseStore, StoredResponse

if TYPE_CHECKING:
    from .protocol import JSON

# How long a cancel waits for the replica computing the response to store its end.
CANCEL_WAIT_S = 10.0


class _Run:
    """A running response's signals in the keeper: a cancel was asked; it ended."""

    def __init__(self) -> None:
        self.wake = asyncio.Event()  # a cancel was asked, or the response ended
        self.ended = asyncio.Event()


class ResponseKeeper:
    """A ``ResponseStore`` behind coroutines, with the signals that let one replica cancel another's run."""

    def __init__(self, store: ResponseStore | None = None) -> None:
        self.store = ResponseStore() if store is None else store
        self._runs: dict[tuple[str, str], _Run] = {}

    async def put(self, entry: StoredResponse) -> None:
        key = (entry.tenant, entry.response_id)
        running = entry.body["status"] in RUNNING
        current = self.store.get(*key)
        if running and current is not None and current.body["status"] not in RUNNING:
            return  # a snapshot sent before the run's end, arriving after it
        self.store.put(entry)
        if not running and (run := self._runs.pop(key, None)) is not None:
            run.ended.set()
            run.wake.set()

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        return self.store.get(tenant, response_id)

    async def find_items(self, tenant: str, item_ids: Sequence[str]) -> dict[str, JSON]:
        """The tenant's stored items of those ids that are kept."""
        found = {item_id: self.store.find_item(tenant, item_id) for item_id in item_ids}
        return {item_id: item for item_id, item in found.items() if item is not None}

    async def delete(self, tenant: str, response_id: str) -> bool:
        return self.store.delete(tenant, response_id)

    async def watch(self, tenant: str, response_id: str) -> bool:
        """Wait until a cancel of the running response is asked (True) or it ended (False)."""
        found = self.store.get(tenant, response_id)
        if found is None or found.body["status"] not in RUNNING:  # ended before the watch came
            return False
        run = self._runs.setdefault((tenant, response_id), _Run())
        await run.wake.wait()
        return not run.ended.is_set()

    async def cancel(self, tenant: str, response_id: str) -> StoredResponse | None:
        """Ask the computing replica to stop a running response and wait for its end; None when unknown."""
        found = self.store.get(tenant, response_id)
        if found is None or found.body["status"] not in RUNNING:
            return found
        run = self._runs.setdefault((tenant, response_id), _Run())
        run.wake.set()
        try:
            await asyncio.wait_for(run.ended.wait(), CANCEL_WAIT_S)
        except TimeoutError:  # nobody computes it any more: it is cancelled here
            await self.put(replace(found, body={**found.body, "status": "cancelled", "output": [], "usage": None}))
        return self.store.get(tenant, response_id)
