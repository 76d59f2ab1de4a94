"""The master's books: objects, the segments their replicas sit in, bytes per tenant, counters.

Two indexes keep the master's periodic and eviction work proportional to
what it touches, not to the million objects it may hold: the pending puts,
oldest first (a tick reclaims the overdue ones without a scan), and per
segment the keys with a replica there, least recently used first (eviction
walks its head instead of sorting every object). Every change of an
object's replicas or last access goes through ``add``, ``add_replica``,
``touch``, ``complete``, ``remove_replica`` and ``forget``; a replica
dropped behind their back leaves a stale key in its segment's order, which
``least_recent``'s readers skip.

Forgetting an object frees its replicas' space at once, unless a grant
may still name that space: then it stays taken until the grant can no
longer be used, so nothing new is written where a reader may be copying
or a revoked writer may still land a late write::

    forget --no live grant--> free
       |
       +--leased, or a pending put--> deferred --release_due, at ``until``--> free
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .master_types import Counters, ObjectMeta, ObjectState, Replica, SegmentInfo


class Ledger:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.segments: dict[str, SegmentInfo] = {}
        self.objects: dict[bytes, ObjectMeta] = {}
        self.tenant_bytes: dict[str, int] = {}
        self.counters = Counters()
        self.tenant_counters: dict[str, Counters] = {}
        # Space of removed replicas that a grant may still name: (until, replica, tenant, leased), freed at
        # ``until`` (a read lease's end, or a revoked put's deadline: its write grant expires before that).
        self._deferred: list[tuple[float, Replica, str, bool]] = []
        # Keys of pending puts in the order they started: their deadlines' order, the put timeout being one.
        self.pending: dict[bytes, None] = {}
        # Per segment id, the keys with a replica there, least recently used first.
        self._recency: dict[str, dict[bytes, None]] = {}
        # How many times a segment gained room (space freed, a segment registered or confirmed) or one was
        # dropped: a placement remembered before is stale (``master_space``).
        self.room_gains = 0

    def count(self, name: str, tenant: str, amount: int = 1) -> None:
        """Bump a counter store-wide and for one tenant."""
        setattr(self.counters, name, getattr(self.counters, name) + amount)
        per_tenant = self.tenant_counters.get(tenant)
        if per_tenant is None:
            per_tenant = self.tenant_counters[tenant] = Counters()
        setattr(per_tenant, name, getattr(per_tenant, name) + amount)

    def add(self, key: bytes, meta: ObjectMeta) -> None:
        """Enter a new object; its bytes count against its tenant from now on."""
        self.objects[key] = meta
        self.tenant_bytes[meta.tenant] = self.tenant_bytes.get(meta.tenant, 0) + meta.num_bytes
        if meta.state is ObjectState.PENDING:
            self.pending[key] = None
        for segment_id, _, _ in meta.replicas:
            self._recency.setdefault(segment_id, {})[key] = None

    def add_replica(self, key: bytes, meta: ObjectMeta, replica: Replica) -> None:
        """One more replica of a known object."""
        meta.replicas = (*meta.replicas, replica)
        self._recency.setdefault(replica[0], {})[key] = None

    def touch(self, key: bytes, meta: ObjectMeta, now_s: float) -> None:
        """The object was just used: last in line for eviction on every segment it is on."""
        meta.last_access_s = now_s
        recency = self._recency
        for segment_id, _, _ in meta.replicas:
            order = recency.setdefault(segment_id, {})
            order.pop(key, None)
            order[key] = None

    def complete(self, key: bytes, meta: ObjectMeta, now_s: float) -> None:
        """A pending put's bytes are written: the object is complete, and just used."""
        meta.state = ObjectState.COMPLETE
        self.pending.pop(key, None)
        self.touch(key, meta, now_s)

    def remove_replica(self, key: bytes, meta: ObjectMeta, replica: Replica) -> None:
        """Drop one replica of an object that keeps others, and free its space."""
        index = meta.replicas.index(replica)
        meta.replicas = meta.replicas[:index] + meta.replicas[index + 1 :]
        self._recency.get(replica[0], {}).pop(key, None)
        self.free(replica)

    def unlist(self, segment_id: str, key: bytes) -> None:
        """Take a stale key (see ``least_recent``) out of the segment's order."""
        self._recency.get(segment_id, {}).pop(key, None)

    def least_recent(self, segment_id: str) -> list[bytes]:
        """Keys with a replica on the segment, least recently used first (a copy: evicting changes the order).
        A key may be stale: no longer an object, or no longer on the segment."""
        return list(self._recency.get(segment_id, ()))

    def forget(self, key: bytes, meta: ObjectMeta) -> None:
        """Drop an object; its space stays taken while a grant may still name it: a leased replica's until the
        lease ends, a pending put's until its deadline (its writer's grant expires before that)."""
        del self.objects[key]
        self.tenant_bytes[meta.tenant] = self.tenant_bytes.get(meta.tenant, 0) - meta.num_bytes
        self.pending.pop(key, None)
        for segment_id, _, _ in meta.replicas:
            self._recency.get(segment_id, {}).pop(key, None)
        pending_until_s = meta.put_deadline_s if meta.state is ObjectState.PENDING else 0.0
        until_s = max(meta.lease_until_s, pending_until_s)
        now = self.clock() if until_s > 0.0 else 0.0  # never read, never leased: no grant names it
        for replica in meta.replicas:
            if until_s > now:
                self._deferred.append((until_s, replica, meta.tenant, meta.lease_until_s > now))
            else:
                self.free(replica)

    def free(self, replica: Replica) -> None:
        self.room_gains += 1
        segment_id, offset, num_bytes = replica
        segment = self.segments.get(segment_id)
        if segment is not None:
            segment.allocator.free(offset, num_bytes)

    def release_due(self, now_s: float) -> None:
        """Free the deferred space whose grants are over by ``now_s``."""
        still_leased = []
        for entry in self._deferred:
            until_s, replica, tenant, leased = entry
            if until_s <= now_s:
                if leased:
                    self.count("lease_expiries", tenant)
                self.free(replica)
            else:
                still_leased.append(entry)
        self._deferred = still_leased

    def drop_segment(self, segment_id: str) -> None:
        """Forget a segment and every replica on it (its owner is gone)."""
        if self.segments.pop(segment_id, None) is None:
            return
        self.room_gains += 1
        self._recency.pop(segment_id, None)
        for key, meta in list(self.objects.items()):
            kept = tuple(replica for replica in meta.replicas if replica[0] != segment_id)
            if len(kept) != len(meta.replicas):
                meta.replicas = kept
                if not kept:
                    self.forget(key, meta)
        self._deferred = [entry for entry in self._deferred if entry[1][0] != segment_id]

    def stats(self) -> dict[str, Any]:
        counters = _as_dict(self.counters)
        return {
            "objects": len(self.objects),
            "complete_objects": len(self.objects) - len(self.pending),
            "tenant_bytes": dict(self.tenant_bytes),
            "tenants": {tenant: _as_dict(counters) for tenant, counters in self.tenant_counters.items()},
            "segments": {
                sid: {
                    "node_id": s.node_id,
                    "capacity_bytes": s.allocator.capacity_bytes,
                    "used_bytes": s.allocator.used_bytes,
                    "usage": round(s.allocator.usage, 4),
                }
                for sid, s in self.segments.items()
            },
            **counters,
        }


def _as_dict(counters: Counters) -> dict[str, int]:
    return {name: getattr(counters, name) for name in Counters.__dataclass_fields__}
