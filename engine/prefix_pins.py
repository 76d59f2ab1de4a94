"""Prefix pins: retention contracts, "keep the first N prompt tokens cached for T seconds".

Clients say how long a prompt prefix should stay cached (Anthropic
``cache_control`` breakpoints, OpenAI ``prompt_cache_retention``); the serving
layer turns that into a ``Retention`` on the call, and the engine keeps it:

1. What is kept: the prompt's full pages among its first ``num_tokens``
   tokens (a partial page is never kept), from the call's finish for
   ``ttl_s`` seconds: on the device where the call ran, and in the KV store
   when one is attached (3). On the device each of those pages is
   referenced, so eviction never takes them (nor does a session offload,
   which only evicts pages nobody references); when the TTL lapses they are
   ordinary cached pages again.
2. Only device memory pressure moves a pinned prefix before its TTL. When
   an allocation falls short, pages are freed in this order: idle sessions'
   holds (``session_holds.py``), pinned prefixes moved to the KV store,
   queued requests' prefix reservations (``reservations.py``), and last,
   pinned prefixes dropped. Moving a prefix means: make sure the store holds
   every one of its pages (writing what it lacks), soft-pin them there for
   the remaining TTL, and only then release the device pages. A prefix the
   store does not take whole (no store attached, the store failing or full)
   stays on the device until the last step, after every session hold and
   every reservation. Within a step the prefix expiring soonest goes first,
   and a prefix whose pages all have other holders (running sequences) is
   skipped: releasing it would free nothing.
3. In the store: with a store attached, a call's pinned pages are also
   soft-pinned there for the TTL once its pages are saved, so the store's
   eviction keeps them too and a later call (on any replica) loads them.
   Store pins count against the tenant's store quota: a tenant whose quota
   is full of pins gets its new pages refused, which only costs compute.
4. Asking again extends: a later call that retains the same prefix keeps it
   until the later of the two expiries, on the device and in the store. A
   pin that extends a shorter pinned prefix of the same tenant and lasts at
   least as long takes its place.
5. Per tenant: page hashes are salted by the tenant (``cache_salt``), so a
   pin keeps one tenant's pages and never makes another tenant's identical
   prompt hit; the store pins only the tenant's own objects. A call's own
   salt (``page_hash.salted``) keys its pins apart, but they count as its
   tenant's in the cap below.
6. Bounded: pinned pages take at most ``MAX_PINNED_PAGE_FRACTION`` of the
   device cache (half), and at most ``MAX_PINNED_PREFIXES`` prefixes are
   pinned. A new pin that goes over releases pins of the tenant holding the
   most pinned pages, its one expiring soonest first (which may be the new
   one), so one tenant's pins push out another's only while that other holds
   more; a prefix longer than the page cap is pinned up to the cap. A pin
   released by the cap keeps its store pin.

A pinned prefix on the device::

    call with a Retention finishes --pin--> pinned: a reference on each page
       ^      |  (a later call: expiry = max(old, new))   |            |
       |      | TTL lapsed, over the cap                  | pressure,  | pressure, last resort
       |      v                                           | store has  | (no store, or it
       |  cached, evictable <------------------------------+ them:      | refused the pages)
       |      ^                        pinned in the store   moved      |
       |      +---------------------------------------------------------+  dropped
       +---- a later call loads them from the store and pins them again

Everything runs on the engine's thread, so nothing here locks.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from .page_hash import PageHash, salt_owner
from .page_pool import Page, PagePool

MAX_PINNED_PAGE_FRACTION = 0.5
MAX_PINNED_PREFIXES = 4096


@dataclass(frozen=True, slots=True)
class Retention:
    """Keep the call's first ``num_tokens`` prompt tokens (their full pages) cached for ``ttl_s`` seconds."""

    num_tokens: int
    ttl_s: float

    def __post_init__(self) -> None:
        if isinstance(self.num_tokens, bool) or not isinstance(self.num_tokens, int) or self.num_tokens < 1:
            raise ValueError(f"Retention num_tokens must be an integer >= 1, got {self.num_tokens!r}")
        if isinstance(self.ttl_s, bool) or not isinstance(self.ttl_s, int | float) or not 0 < self.ttl_s < math.inf:
            raise ValueError(f"Retention ttl_s must be > 0 and finite, got {self.ttl_s!r}")


class PinStore(Protocol):
    """What pins need of the KV store (``KVTransfer``)."""

    def store_now(self, hashes: list[PageHash], pages: list[Page], tenant: str) -> tuple[int, int]: ...

    def pin_in_store(self, hashes: list[PageHash], ttl_s: float, tenant: str, wait: bool = False) -> None: ...


@dataclass(slots=True)
class _Pin:
    hashes: tuple[PageHash, ...]  # of ``pages``, in order
    pages: tuple[Page, ...]
    tenant: str
    expires_at_s: float  # on the pins' clock


class PrefixPins:
    """The engine's pinned prefixes, keyed by the hash of their last page (a chained hash names the whole prefix)."""

    def __init__(
        self,
        pool: PagePool,
        page_size: int,
        store: PinStore | None = None,
        max_prefixes: int = MAX_PINNED_PREFIXES,
        max_page_fraction: float = MAX_PINNED_PAGE_FRACTION,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_prefixes < 1:
            raise ValueError(f"max_prefixes must be >= 1, got {max_prefixes}")
        if not 0 <= max_page_fraction <= 1:
            raise ValueError(f"max_page_fraction must be in [0, 1], got {max_page_fraction}")
        self.pool = pool
        self.page_size = page_size
        self.store = store
        self.max_prefixes = max_prefixes
        self.max_pages = int(pool.num_pages * max_page_fraction)
        self.clock = clock
        self._wanted: dict[str, Retention] = {}  # by request id, from arrival to finish
        self._pins: dict[PageHash, _Pin] = {}
        self._pins_per_page: Counter[int] = Counter()  # page id -> pins referencing it
        self._next_expiry_s = math.inf  # no pin lapses before this
        self.expired = 0
        self.moved_to_store = 0
        self.dropped_by_pressure = 0
        self.released_over_cap = 0

    # -- a request's retention --------------------------------------------

    def expect(self, request_id: str, retention: Retention | None) -> None:
        """Remember what the request asks to retain, for its finish."""
        if retention is not None:
            self._wanted[request_id] = retention

    def forget(self, request_id: str) -> None:
        """The request went without finishing (aborted): nothing to pin."""
        self._wanted.pop(request_id, None)

    def finish(self, request_id: str, hashes: Sequence[PageHash], num_prompt_tokens: int, tenant: str) -> int:
        """The request finished with these full pages computed: pin what it asked to retain; returns pages pinned."""
        retention = self._wanted.pop(request_id, None)
        if retention is None:
            return 0
        num_pages = min(retention.num_tokens, num_prompt_tokens) // self.page_size
        return self.pin(hashes[:num_pages], retention.ttl_s, tenant)

    # -- pins -------------------------------------------------------------

    def pin(self, hashes: Sequence[PageHash], ttl_s: float, tenant: str = "") -> int:
        """Pin the cached prefix of ``tenant``'s ``hashes`` for ``ttl_s`` from now, here and in the store; returns
        the pages pinned here."""
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if not hashes:
            return 0
        if self.store is not None:
            self.store.pin_in_store(list(hashes), ttl_s, tenant)
        expires_at_s = self.clock() + ttl_s
        pages = self.pool.cached_prefix(hashes[: self.max_pages])
        if not pages:
            return 0
        key = hashes[len(pages) - 1]
        pin = self._pins.get(key)
        if pin is not None:
            pin.expires_at_s = max(pin.expires_at_s, expires_at_s)
        else:
            self.pool.touch(pages)
            self._pins[key] = _Pin(tuple(hashes[: len(pages)]), tuple(pages), tenant, expires_at_s)
            self._pins_per_page.update(page.page_id for page in pages)
            self._next_expiry_s = min(self._next_expiry_s, expires_at_s)
            for shorter_key in hashes[: len(pages) - 1]:  # shorter pins this one outlasts are redundant
                shorter = self._pins.get(shorter_key)
                if shorter is not None and shorter.expires_at_s <= expires_at_s:
                    self._release(shorter_key)
        self._keep_cap()
        return len(pages) if key in self._pins else 0

    def expire(self) -> int:
        """Release the pins whose TTL has passed; returns how many."""
        now_s = self.clock()
        if now_s < self._next_expiry_s:
            return 0
        lapsed = [key for key, pin in self._pins.items() if pin.expires_at_s <= now_s]
        for key in lapsed:
            self._release(key)
        self._next_expiry_s = min((pin.expires_at_s for pin in self._pins.values()), default=math.inf)
        self.expired += len(lapsed)
        return len(lapsed)

    def move_to_store(self, num_pages: int) -> int:
        """Memory pressure: release pins the store holds whole (saving what it lacks, pinning them there for
        the remaining TTL), soonest expiry first, until ``num_pages`` pages became free; returns the pages freed."""
        store = self.store
        if store is None:
            return 0
        num_free_before = self.pool.num_free_pages
        refused: set[PageHash] = set()
        while self.pool.num_free_pages - num_free_before < num_pages:
            key = self._next_to_release(refused)
            if key is None:
                break
            pin = self._pins[key]
            num_stored, _ = store.store_now(list(pin.hashes), list(pin.pages), pin.tenant)
            if num_stored < len(pin.hashes):
                refused.add(key)  # the device holds the only whole copy: kept until the last resort
                continue
            remaining_s = pin.expires_at_s - self.clock()
            if remaining_s > 0:
                store.pin_in_store(list(pin.hashes), remaining_s, pin.tenant, wait=True)
            self._release(key)
            self.moved_to_store += 1
        return self.pool.num_free_pages - num_free_before

    def reclaim(self, num_pages: int) -> int:
        """Memory pressure, last resort: release pins, soonest expiry first, until ``num_pages`` pages became free;
        returns the pages freed."""
        num_free_before = self.pool.num_free_pages
        while self.pool.num_free_pages - num_free_before < num_pages:
            key = self._next_to_release(set())
            if key is None:
                break
            self._release(key)
            self.dropped_by_pressure += 1
        return self.pool.num_free_pages - num_free_before

    def stats(self) -> dict[str, int]:
        return {
            "pinned_prefixes": len(self._pins),
            "pinned_pages": len(self._pins_per_page),
            "pins_expired": self.expired,
            "pins_moved_to_store": self.moved_to_store,
            "pins_released_by_pressure": self.dropped_by_pressure,
            "pins_released_over_cap": self.released_over_cap,
        }

    def _next_to_release(self, skip: set[PageHash]) -> PageHash | None:
        """The pin expiring soonest whose release frees a page now (one only it references), outside ``skip``."""
        freeing = [
            (pin.expires_at_s, key)
            for key, pin in self._pins.items()
            if key not in skip and any(page.ref_count == 1 for page in pin.pages)
        ]
        return min(freeing)[1] if freeing else None

    def _keep_cap(self) -> None:
        """Over a cap, the tenant holding the most pinned pages gives up its pin expiring soonest: one tenant's
        pins push out another's only while that other holds more."""
        while len(self._pins) > self.max_prefixes or len(self._pins_per_page) > self.max_pages:
            held: Counter[str] = Counter()
            for pin in self._pins.values():
                held[salt_owner(pin.tenant)] += len(pin.pages)
            heaviest = max(held, key=lambda tenant: held[tenant])
            key = min(
                (k for k, pin in self._pins.items() if salt_owner(pin.tenant) == heaviest),
                key=lambda k: self._pins[k].expires_at_s,
            )
            self._release(key)
            self.released_over_cap += 1

    def _release(self, key: PageHash) -> None:
        pin = self._pins.pop(key)
        self._forget_pages(pin.pages)
        self.pool.free(reversed(pin.pages))

    def _forget_pages(self, pages: Iterable[Page]) -> None:
        for page in pages:
            self._pins_per_page[page.page_id] -= 1
            if self._pins_per_page[page.page_id] <= 0:
                del self._pins_per_page[page.page_id]


def reclaim_in_order(reclaimers: Sequence[Callable[[int], int]], num_pages: int) -> int:
    """Memory pressure: ask each of ``reclaimers`` in turn for the pages still short; returns the pages freed."""
    freed = 0
    for reclaim in reclaimers:
        if freed >= num_pages:
            break
        freed += reclaim(num_pages - freed)
    return freed
