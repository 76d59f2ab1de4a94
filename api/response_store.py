"""Responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}``: in the ingress replica with one,
else in the ``responses`` deployment every ingress replica shares (``shared_responses``).

Each entry holds a response's body, its conversation as chat messages
(the history it continued, its input, its answer; never the instructions,
which OpenAI does not carry over either) and the items it was made from
(``responses_items``), under its tenant: a lookup under another tenant finds
nothing, a response's or an item's. Entries live in memory only, so a restart
of the replica holding them forgets them. A background response is kept while
it runs too (its status, and its events so far when streamed).

Bounded three ways, all cheap: at most ``max_entries`` entries and
``max_bytes`` bytes (the JSON size of what an entry retains, counted as if
it shared nothing with its predecessor, so the bound holds), evicting the
least recently used entry of the tenant that holds the most (entries or
bytes, whichever bound was passed), so one tenant's traffic pushes out
another's responses only while that other holds more; and an entry unused
for ``ttl_s`` expires. Using
an entry renews it, so least recently used is also first to expire, and
expired entries are always found at the front.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .protocol import JSON

DEFAULT_MAX_ENTRIES = 4096
DEFAULT_MAX_BYTES = 256 << 20
DEFAULT_TTL_S = 3600.0
# The statuses of a response that is still being computed (a background one).
RUNNING = ("queued", "in_progress")


def json_size(value: object) -> int:
    """What ``value`` counts towards a stored entry's ``num_bytes``: the length of its JSON text."""
    return len(json.dumps(value, ensure_ascii=False))


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response_id: str
    tenant: str
    body: JSON
    # The conversation so far as chat messages, answer included: what a continuation's history is.
    messages: tuple[JSON, ...]
    num_bytes: int
    # A streamed background response's events, to stream again (``GET ...?stream=true``); else none.
    events: tuple[JSON, ...] = ()
    # The items it was made from: the responses' it continues (input and output), then its input.
    items: tuple[JSON, ...] = ()
    # Made with ``background`` and ``stream`` both true: its events can be streamed again.
    streamed: bool = False

    def held_items(self) -> tuple[JSON, ...]:
        """The items an item reference can name: those it was made from and its output."""
        return (*self.items, *self.body["output"])


class ResponseStore:
    """An LRU of stored responses keyed by (tenant, response id), bounded in entries, bytes and idle time."""

    def __init__(
        self,
        *,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        # (tenant, response id) -> (entry, when it was last used); least recently used first.
        self._entries: OrderedDict[tuple[str, str], tuple[StoredResponse, float]] = OrderedDict()
        self.num_bytes = 0
        # tenant -> [entries, bytes] it holds
        self._held: defaultdict[str, list[int]] = defaultdict(lambda: [0, 0])
        # (tenant, item id) -> [the item, how many entries hold it]; entries continuing others share items.
        self._items: dict[tuple[str, str], list[Any]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        """Keep ``entry``; one larger than ``max_bytes`` on its own is not kept."""
        key = (entry.tenant, entry.response_id)
        self._drop(key)
        self._expire()
        if entry.num_bytes > self.max_bytes:
            return
        self._entries[key] = (entry, self._clock())
        self.num_bytes += entry.num_bytes
        self._held[entry.tenant][0] += 1
        self._held[entry.tenant][1] += entry.num_bytes
        for item in entry.held_items():
            held = self._items.setdefault((entry.tenant, item["id"]), [item, 0])
            held[0] = item  # an id sent again with another item names the latest
            held[1] += 1
        while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
            by_bytes = self.num_bytes > self.max_bytes
            heaviest = max(self._held, key=lambda tenant: self._held[tenant][1 if by_bytes else 0])
            self._drop(next(key for key in self._entries if key[0] == heaviest))

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The tenant's entry, renewed; None when unknown, expired or another tenant's."""
        self._expire()
        key = (tenant, response_id)
        found = self._entries.get(key)
        if found is None:
            return None
        self._entries[key] = (found[0], self._clock())
        self._entries.move_to_end(key)
        return found[0]

    def find_item(self, tenant: str, item_id: str) -> JSON | None:
        """The tenant's stored item of that id (an input or output item of a stored response), or None."""
        self._expire()
        held = self._items.get((tenant, item_id))
        return None if held is None else held[0]

    def delete(self, tenant: str, response_id: str) -> bool:
        self._expire()
        return self._drop((tenant, response_id))

    def _drop(self, key: tuple[str, str]) -> bool:
        found = self._entries.pop(key, None)
        if found is None:
            return False
        self.num_bytes -= found[0].num_bytes
        held = self._held[key[0]]
        held[0] -= 1
        held[1] -= found[0].num_bytes
        if held[0] == 0:
            del self._held[key[0]]
        for item in found[0].held_items():
            item_key = (key[0], item["id"])
            self._items[item_key][1] -= 1
            if self._items[item_key][1] == 0:
                del self._items[item_key]
        return True

    def _expire(self) -> None:
        deadline = self._clock() - self.ttl_s
        while self._entries:
            key, (_, used_s) = next(iter(self._entries.items()))
            if used_s > deadline:
                return
            self._drop(key)
