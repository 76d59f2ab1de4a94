"""Prefix reservations: the cached pages of requests that wait for admission, kept from eviction.

A request that arrives while the engine is busy waits in the queue. Its
prompt's prefix may be cached here (from the session's earlier calls, or just
loaded from the KV store), but until admission nothing references those
pages: every allocation for someone else (a running sequence's growth, a
prewarm) may evict them, and the request then computes what was cached when
it arrived. Under load that makes idle sessions' holds, which are referenced,
outrank calls that have actually arrived.

So a queued request references its cached prefix (a reservation) from
arrival until admission, when the sequence's own references replace it, or
until it is aborted. Memory pressure takes reservations back last, after
every session hold, the youngest request's first (the oldest is admitted
next). Everything runs on the engine's thread, so nothing here locks.
"""

from __future__ import annotations

from collections import OrderedDict

from .page_pool import Page, PagePool


class PrefixReservations:
    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self._pages: OrderedDict[str, list[Page]] = OrderedDict()  # by request id, oldest first
        self.reserved_pages = 0  # pages ever reserved
        self.dropped = 0  # reservations taken back under memory pressure

    def __len__(self) -> int:
        return len(self._pages)

    def reserve(self, request_id: str, pages: list[Page]) -> None:
        """Reference ``pages`` (the request's cached prefix) until ``release``."""
        if not pages:
            return
        self.release(request_id)
        self.pool.touch(pages)
        self._pages[request_id] = pages
        self.reserved_pages += len(pages)

    def release(self, request_id: str) -> None:
        """Drop a request's reservation (admitted or aborted); a no-op if it has none."""
        pages = self._pages.pop(request_id, None)
        if pages is not None:
            self.pool.free(reversed(pages))

    def reclaim(self, num_pages: int) -> int:
        """Drop reservations, youngest first, until ``num_pages`` pages became free; returns the pages freed.

        A reservation whose pages all have other references too (queued
        requests sharing one system prompt) would free nothing: it stays.
        """
        num_free_before = self.pool.num_free_pages
        for request_id in reversed(list(self._pages)):
            if self.pool.num_free_pages - num_free_before >= num_pages:
                break
            pages = self._pages[request_id]
            if all(page.ref_count > 1 for page in pages):
                continue
            del self._pages[request_id]
            self.pool.free(reversed(pages))
            self.dropped += 1
        return self.pool.num_free_pages - num_free_before

    def stats(self) -> dict[str, int]:
        return {
            "reserved_requests": len(self._pages),
            "reserved_pages_total": self.reserved_pages,
            "reservations_dropped": self.dropped,
        }
