"""Where this routing process sent each session's last call, and how much of that call's prompt it had.

Replica stats lag the calls they describe: the engine refreshes its figures
every half second and Serve ships them every ``stats_period_s``, while an
agent's tool loop sends a session's next call a fraction of a second after the
last one ends. Routed on stats alone, that next call compares replicas as they
were a few calls ago: the pages its last call computed are listed nowhere yet,
and a shared system prompt that the session's own replica has not reported
outweighs the session's affinity on a replica that has. So each router keeps a
trail per session, the replica its last call went to (as Serve confirms it in
``on_request_routed``), when, and the prompt's full pages; a later call of the
session counts the pages it shares with that prompt as resident on that
replica, whatever the stats say yet. Page hashes are chained, so a prompt
holding the trail's last page holds all the pages before it.

A session's trail::

    none --call routed--> (replica, routed at, pages) --call routed--> replaced
      ^                              |
      +-- its replica left, or LRU past MAX_TRAILED_SESSIONS

The trails also count, per replica, the sessions routed there within the last
``ACTIVE_SESSION_S`` (``recent_sessions``): a session nobody has seen yet goes
to the replica following the fewest, which the replicas' own reports show only
a stats period or more later (a burst of new sessions would otherwise all land
where the reports last looked emptiest, or by hash: six on one replica, two on
the other).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# Sessions a routing process keeps a trail for (about 100 bytes each), most recently routed kept.
MAX_TRAILED_SESSIONS = 65_536

# A session whose last call is at most this old counts as one its replica follows: the agent may be waiting
# on a tool or on its human, and comes back there.
ACTIVE_SESSION_S = 300.0


@dataclass(frozen=True, slots=True)
class Trail:
    """A session's last routed call: its replica, when (epoch seconds), and its prompt's full pages as the
    count and the ``page_hash_key`` of the last one."""

    replica_id: str
    routed_at_s: float
    num_pages: int
    last_page_key: str

    def shared_pages(self, page_keys: Sequence[str]) -> int:
        """How many leading pages of ``page_keys`` the trail's prompt had: all of its pages when the
        prompt holds the last one where the trail's prompt had it, else none known."""
        if self.num_pages == 0 or len(page_keys) < self.num_pages:
            return 0
        return self.num_pages if page_keys[self.num_pages - 1] == self.last_page_key else 0


class SessionTrails:
    """Session id -> its ``Trail``, bounded; one per routing process."""

    def __init__(self, max_sessions: int = MAX_TRAILED_SESSIONS, active_s: float = ACTIVE_SESSION_S) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        if not active_s > 0:
            raise ValueError(f"active_s must be > 0, got {active_s}")
        self.max_sessions = max_sessions
        self.active_s = active_s
        self._trails: OrderedDict[str, Trail] = OrderedDict()  # least recently routed first
        # The trails routed within ``active_s`` (at most), in the same order, and how many lead to each replica.
        self._active: OrderedDict[str, Trail] = OrderedDict()
        self._active_by_replica: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._trails)

    def get(self, session_id: str | None) -> Trail | None:
        return self._trails.get(session_id) if session_id else None

    def record(self, session_id: str | None, replica_id: str, page_keys: Sequence[str], routed_at_s: float) -> None:
        """The session's call (with these prompt pages) went to ``replica_id`` at ``routed_at_s``."""
        if not session_id:
            return
        last_page_key = page_keys[-1] if page_keys else ""
        trail = Trail(replica_id, routed_at_s, len(page_keys), last_page_key)
        self._trails[session_id] = trail
        self._trails.move_to_end(session_id)
        self._deactivate(session_id)
        self._active[session_id] = trail
        self._active_by_replica[replica_id] += 1
        while len(self._trails) > self.max_sessions:
            evicted, _ = self._trails.popitem(last=False)
            self._deactivate(evicted)

    def recent_sessions(self, now_s: float) -> Counter[str]:
        """Replica id -> how many sessions this router sent a call there within the last ``active_s``, as
        of ``now_s`` (epoch seconds); a session counts only at the replica its last call went to."""
        while self._active:
            session_id, trail = next(iter(self._active.items()))
            if trail.routed_at_s >= now_s - self.active_s:
                break
            self._deactivate(session_id)
        return +self._active_by_replica

    def forget_replicas(self, live_replica_ids: set[str]) -> None:
        """Drop the trails that lead to replicas no longer running."""
        for session_id in [s for s, trail in self._trails.items() if trail.replica_id not in live_replica_ids]:
            del self._trails[session_id]
            self._deactivate(session_id)

    def _deactivate(self, session_id: str) -> None:
        trail = self._active.pop(session_id, None)
        if trail is not None:
            self._active_by_replica[trail.replica_id] -= 1


def with_trail(
    resident: Mapping[str, tuple[int, int]], trail: Trail | None, page_keys: Sequence[str]
) -> dict[str, tuple[int, int]]:
    """``resident`` (replica -> (device pages, host pages) of the prompt's prefix, from stats) with the
    pages the session's last call left on its replica counted on that replica's device."""
    merged = dict(resident)
    if trail is None or trail.replica_id not in merged:
        return merged
    shared = trail.shared_pages(page_keys)
    device_pages, host_pages = merged[trail.replica_id]
    if shared > device_pages:
        merged[trail.replica_id] = (shared, max(0, device_pages + host_pages - shared))
    return merged
