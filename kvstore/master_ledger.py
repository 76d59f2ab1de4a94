"""The master's books: objects, the segments their replicas sit in, bytes per tenant, counters.

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

from .master_types import Counters, Location, ObjectMeta, ObjectState, SegmentInfo


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
        self._deferred: list[tuple[float, Location, str, bool]] = []

    def count(self, name: str, tenant: str, amount: int = 1) -> None:
        """Bump a counter store-wide and for one tenant."""
        setattr(self.counters, name, getattr(self.counters, name) + amount)
        per_tenant = self.tenant_counters.setdefault(tenant, Counters())
        setattr(per_tenant, name, getattr(per_tenant, name) + amount)

    def add(self, key: bytes, meta: ObjectMeta) -> None:
        """Enter a new object; its bytes count against its tenant from now on."""
        self.objects[key] = meta
        self.tenant_bytes[meta.tenant] = self.tenant_bytes.get(meta.tenant, 0) + meta.num_bytes

    def forget(self, key: bytes, meta: ObjectMeta) -> None:
        """Drop an object; its space stays taken while a grant may still name it: a leased replica's until the
        lease ends, a pending put's until its deadline (its writer's grant expires before that)."""
        del self.objects[key]
        self.tenant_bytes[meta.tenant] = self.tenant_bytes.get(meta.tenant, 0) - meta.num_bytes
        now = self.clock()
        pending_until_s = meta.put_deadline_s if meta.state is ObjectState.PENDING else 0.0
        until_s = max(meta.lease_until_s, pending_until_s)
        for location in meta.replicas:
            if until_s > now:
                self._deferred.append((until_s, location, meta.tenant, meta.lease_until_s > now))
            else:
                self.free(location)

    def free(self, location: Location) -> None:
        segment = self.segments.get(location.segment_id)
        if segment is not None:
            segment.allocator.free(location.offset, location.num_bytes)

    def release_due(self, now_s: float) -> None:
        """Free the deferred space whose grants are over by ``now_s``."""
        still_leased = []
        for entry in self._deferred:
            until_s, location, tenant, leased = entry
            if until_s <= now_s:
                if leased:
                    self.count("lease_expiries", tenant)
                self.free(location)
            else:
                still_leased.append(entry)
        self._deferred = still_leased

    def drop_segment(self, segment_id: str) -> None:
        """Forget a segment and every replica on it (its owner is gone)."""
        if self.segments.pop(segment_id, None) is None:
            return
        for key, meta in list(self.objects.items()):
            kept = [loc for loc in meta.replicas if loc.segment_id != segment_id]
            if len(kept) != len(meta.replicas):
                meta.replicas = kept
                if not kept:
                    self.forget(key, meta)
        self._deferred = [entry for entry in self._deferred if entry[1].segment_id != segment_id]

    def stats(self) -> dict[str, Any]:
        counters = _as_dict(self.counters)
        return {
            "objects": len(self.objects),
            "complete_objects": sum(1 for m in self.objects.values() if m.state is ObjectState.COMPLETE),
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
