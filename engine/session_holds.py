"""Per-session page holds: an agent session's KV pages between its calls.

Between two calls of a session (a tool run: seconds; a human: minutes) its
pages can stay on the device, held (a reference on each, so they cannot be
evicted) until a TTL lapses; or move to the KV store, freeing the device
pages (offload), and come back before the session does (prewarm). A policy
elsewhere decides when; this module is the mechanism. A session's pages::

                        finish ("turn"), hold
    cached, evictable  ------------------------------->  held: a reference on each
          |            <-------------------------------  page until the TTL lapses
          |             release, TTL lapsed, memory          |          ^
          |             pressure, session forgotten (LRU)    | offload  | prewarm: load what
          | offload                                          v          | is missing, hold
          +--------------------------------------> in the store only ---+
                                                   (evicted here, hashes kept)

An engine about to stop hands every recorded session's cached pages to the
store (``hand_off``), so the sessions' next calls elsewhere load them.

Offload first saves what the store lacks, then evicts every page of the
session that the store confirms it holds and that nothing else needs: pages
referenced by running sequences or other sessions' holds, and pages other
recorded sessions share (a common system prompt), stay.

A request carrying a session id records, when it finishes, the hashes of the
full pages it computed and holds them (kind "turn"), replacing the session's
previous hold. A hold covers the longest cached prefix of those hashes.

Holds only borrow memory nobody else needs: when an allocation falls short,
``reclaim`` releases whole holds, "turn" and "prewarm" before "tool" (a tool
result is back in seconds, a human takes minutes), oldest first within a
kind. Recorded sessions are a bounded LRU; forgetting one releases its hold.
Everything runs on the engine's thread, so nothing here locks.
"""

from __future__ import annotations

import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .page_hash import PageHash
from .page_pool import Page, PagePool

HOLD_KINDS = ("tool", "turn", "prewarm")
# Memory pressure releases lower ranks first.
_RELEASE_RANK = {"turn": 0, "prewarm": 0, "tool": 1}
MAX_RECORDED_SESSIONS = 4096

# Makes sure the store has these cached pages of a tenant (the session's ``cache_salt``):
# (how many leading ones it holds afterwards, how many were written).
SavePages = Callable[[list[PageHash], list[Page], str], tuple[int, int]]
# Loads from the store the tenant's pages of this prefix missing here; returns how many landed.
LoadPages = Callable[[list[PageHash], str], int]


@dataclass(frozen=True, slots=True)
class SessionMove:
    """What one offload or prewarm did."""

    pages: int  # offload: pages evicted here; prewarm: pages loaded
    resident_pages: int  # leading recorded pages cached here afterwards
    bytes_moved: int  # between the device and the store (offload: what it had to write)
    seconds: float  # wall time of the move


@dataclass(frozen=True, slots=True)
class _Recorded:
    """A session's last finished pages, and the tenant (cache salt) they belong to in the store."""

    hashes: list[PageHash]
    tenant: str = ""


_NOTHING_RECORDED = _Recorded([])


@dataclass(frozen=True, slots=True)
class _Hold:
    kind: str
    pages: tuple[Page, ...]
    expires_at_s: float  # on the holds' clock


class SessionHolds:
    """Recorded page hashes per session, and the holds on their cached pages."""

    def __init__(
        self,
        pool: PagePool,
        bytes_per_page: int,
        max_sessions: int = MAX_RECORDED_SESSIONS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.pool = pool
        self.bytes_per_page = bytes_per_page
        self.max_sessions = max_sessions
        self.clock = clock
        self._sessions: OrderedDict[str, _Recorded] = OrderedDict()  # least recently used first
        self._sharers: Counter[PageHash] = Counter()  # recorded sessions per page hash
        self._holds: OrderedDict[str, _Hold] = OrderedDict()  # oldest hold first
        self._next_expiry_s = math.inf  # no hold lapses before this
        self.expired_holds = 0
        self.pressure_releases = 0
        self.offloaded_pages = 0
        self.prewarmed_pages = 0

    def record(self, session_id: str, hashes: Sequence[PageHash], ttl_s: float, tenant: str = "") -> int:
        """A session's request finished with these full pages (hashed with ``tenant``'s salt): remember them and
        hold them (kind "turn")."""
        self._forget_hashes(self._sessions.get(session_id, _NOTHING_RECORDED).hashes)
        self._sessions[session_id] = _Recorded(list(hashes), tenant)
        self._sharers.update(set(hashes))
        self._sessions.move_to_end(session_id)
        while len(self._sessions) > self.max_sessions:
            forgotten, forgotten_record = self._sessions.popitem(last=False)
            self._forget_hashes(forgotten_record.hashes)
            self.release(forgotten)
        return self.hold(session_id, ttl_s, "turn")

    def _forget_hashes(self, hashes: Sequence[PageHash]) -> None:
        for page_hash in set(hashes):
            self._sharers[page_hash] -= 1
            if self._sharers[page_hash] <= 0:
                del self._sharers[page_hash]

    def hold(self, session_id: str, ttl_s: float, kind: str = "tool") -> int:
        """(Re)hold the cached prefix of the session's pages for ``ttl_s`` from now; returns the pages held."""
        _check_hold(ttl_s, kind)
        hashes = self._recorded(session_id).hashes
        pages = self.pool.cached_prefix(hashes)
        self.pool.touch(pages)  # before the old hold goes, so pages in both are never free in between
        self.release(session_id)
        if pages:
            expires_at_s = self.clock() + ttl_s
            self._holds[session_id] = _Hold(kind, tuple(pages), expires_at_s)
            self._next_expiry_s = min(self._next_expiry_s, expires_at_s)
        return len(pages)

    def release(self, session_id: str) -> int:
        """Drop the session's hold (its pages stay cached, evictable); returns the pages it held."""
        hold = self._holds.pop(session_id, None)
        if hold is None:
            return 0
        self.pool.free(reversed(hold.pages))
        return len(hold.pages)

    def expire(self) -> int:
        """Release the holds whose TTL has passed; returns how many."""
        now_s = self.clock()
        if now_s < self._next_expiry_s:
            return 0
        lapsed = [session_id for session_id, hold in self._holds.items() if hold.expires_at_s <= now_s]
        for session_id in lapsed:
            self.release(session_id)
        self._next_expiry_s = min((hold.expires_at_s for hold in self._holds.values()), default=math.inf)
        self.expired_holds += len(lapsed)
        return len(lapsed)

    def reclaim(self, num_pages: int) -> int:
        """Release whole holds until ``num_pages`` pages became free or none is left; returns the pages freed.

        A released page becomes free only if no sequence or other hold still references it.
        """
        num_free_before = self.pool.num_free_pages
        in_release_order = sorted(self._holds.items(), key=lambda item: _RELEASE_RANK[item[1].kind])  # stable sort
        for session_id, _ in in_release_order:
            if self.pool.num_free_pages - num_free_before >= num_pages:
                break
            self.release(session_id)
            self.pressure_releases += 1
        return self.pool.num_free_pages - num_free_before

    def offload(self, session_id: str, save: SavePages) -> SessionMove:
        """Have ``save`` put the session's cached pages in the store, then evict every one nobody references."""
        started_s = time.perf_counter()
        cached = {}
        recorded = self._recorded(session_id)
        for page_hash in recorded.hashes:
            page = self.pool.lookup(page_hash)
            if page is not None:
                cached[page_hash] = page
        num_stored, num_saved = save(list(cached), list(cached.values()), recorded.tenant)
        self.release(session_id)
        stored = list(cached.items())[:num_stored]
        unreferenced = [page for page_hash, page in stored if page.ref_count == 0 and self._sharers[page_hash] <= 1]
        self.pool.evict(unreferenced)
        self.offloaded_pages += len(unreferenced)
        return SessionMove(
            pages=len(unreferenced),
            resident_pages=self.residency(session_id)[0],
            bytes_moved=num_saved * self.bytes_per_page,
            seconds=time.perf_counter() - started_s,
        )

    def hand_off(self, save: SavePages, until_s: float) -> int:
        """Have ``save`` put every recorded session's cached pages in the store, the most recently used session
        first, until the holds' clock reaches ``until_s``; returns the pages written. For an engine that is about
        to stop: nothing is released or evicted here."""
        num_written = 0
        for session_id in reversed(self._sessions):
            if self.clock() >= until_s:
                break
            recorded = self._sessions[session_id]
            pages = self.pool.cached_prefix(recorded.hashes)
            if pages:
                num_written += save(recorded.hashes[: len(pages)], pages, recorded.tenant)[1]
        return num_written

    def prewarm(self, session_id: str, ttl_s: float, load: LoadPages, kind: str = "prewarm") -> SessionMove:
        """Have ``load`` bring back the session's pages missing here, then hold the cached prefix (kind "prewarm",
        or "tool" for a call that is on its way)."""
        _check_hold(ttl_s, kind)
        started_s = time.perf_counter()
        recorded = self._recorded(session_id)
        num_loaded = load(recorded.hashes, recorded.tenant) if recorded.hashes else 0
        self.prewarmed_pages += num_loaded
        num_held = self.hold(session_id, ttl_s, kind)
        return SessionMove(
            pages=num_loaded,
            resident_pages=num_held,
            bytes_moved=num_loaded * self.bytes_per_page,
            seconds=time.perf_counter() - started_s,
        )

    def residency(self, session_id: str) -> tuple[int, int]:
        """(leading recorded pages cached here now, recorded pages); (0, 0) for an unknown session."""
        hashes = self._sessions.get(session_id, _NOTHING_RECORDED).hashes
        return len(self.pool.cached_prefix(hashes)), len(hashes)

    def stats(self) -> dict[str, int]:
        return {
            "held_sessions": len(self._holds),
            "held_pages": len({page.page_id for hold in self._holds.values() for page in hold.pages}),
            "expired_holds": self.expired_holds,
            "pressure_releases": self.pressure_releases,
            "offloaded_pages": self.offloaded_pages,
            "prewarmed_pages": self.prewarmed_pages,
        }

    def _recorded(self, session_id: str) -> _Recorded:
        """The session's record (no hashes if unknown), marking it recently used."""
        recorded = self._sessions.get(session_id)
        if recorded is None:
            return _NOTHING_RECORDED
        self._sessions.move_to_end(session_id)
        return recorded


def _check_hold(ttl_s: float, kind: str) -> None:
    if kind not in HOLD_KINDS:
        raise ValueError(f"hold kind must be one of {', '.join(HOLD_KINDS)}; got {kind!r}")
    if not ttl_s >= 0:
        raise ValueError(f"ttl_s must be >= 0, got {ttl_s}")
