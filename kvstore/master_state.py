"""The KV store master's state: metadata only, no bytes.

Keys map to replicas (segment id, offset, length) in segments that workers
contribute. One object's life cycle::

                put_start              put_end
    (absent) ------------> PENDING ------------> COMPLETE --remove / evict--> (absent)
                              |                     |
                put_revoke, or no put_end           | leased: not evicted, its space
                within put_timeout_s  --> (absent)  | freed only when the lease ends

Space management: a put that does not fit evicts first (approximate LRU over
complete, unleased, unpinned objects on that segment), and any segment past
the high watermark is brought back to the low one on the next ``tick``, so
eviction never lags until the pool is full. Per-tenant quotas evict the
tenant's own objects before refusing it.

Segment owners heartbeat; a segment that falls silent loses its replicas,
so a lost page reads as a miss, never as someone else's bytes. After a
master restart the state comes back from the last snapshot, and owners, who
notice the new ``epoch`` in heartbeat replies, re-advertise what they hold.

Time comes from an injected clock so the whole life cycle is unit-testable.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .allocator import SegmentAllocator
from .master_types import (
    Counters,
    Location,
    MasterConfig,
    ObjectMeta,
    ObjectState,
    PutPlan,
    SegmentInfo,
    parse_address,
)

__all__ = ["Location", "MasterConfig", "MasterState", "ObjectState", "PutPlan", "parse_address"]


class MasterState:
    def __init__(self, config: MasterConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or MasterConfig()
        self.clock = clock
        self.epoch = secrets.token_hex(8)  # changes on every restart: owners re-advertise
        self.segments: dict[str, SegmentInfo] = {}
        self.objects: dict[bytes, ObjectMeta] = {}
        self.tenant_bytes: dict[str, int] = {}
        self.counters = Counters()
        self.tenant_counters: dict[str, Counters] = {}
        # Space of removed replicas that a grant may still name: (until, replica, tenant, leased), freed at
        # ``until`` (a read lease's end, or a revoked put's deadline: its write grant expires before that).
        self._deferred: list[tuple[float, Location, str, bool]] = []

    def _count(self, name: str, tenant: str, amount: int = 1) -> None:
        """Bump a counter store-wide and for one tenant."""
        setattr(self.counters, name, getattr(self.counters, name) + amount)
        per_tenant = self.tenant_counters.setdefault(tenant, Counters())
        setattr(per_tenant, name, getattr(per_tenant, name) + amount)

    # -- segments ---------------------------------------------------------

    def register_segment(
        self,
        segment_id: str,
        node_id: str,
        shm_name: str,
        capacity_bytes: int,
        ucx_address: tuple[str, int] | None,
        page_bytes: int | None = None,
    ) -> str:
        known = self.segments.get(segment_id)
        if known is not None:  # a re-registration after a master restart keeps the allocator
            known.last_heartbeat_s = self.clock()
            known.ucx_address = ucx_address
            known.confirmed = True
            return self.epoch
        self.segments[segment_id] = SegmentInfo(
            segment_id=segment_id,
            node_id=node_id,
            shm_name=shm_name,
            ucx_address=ucx_address,
            allocator=SegmentAllocator(capacity_bytes, page_bytes),
            last_heartbeat_s=self.clock(),
        )
        return self.epoch

    def heartbeat(self, segment_id: str) -> str | None:
        """The epoch, or None when the segment is unknown here (the owner must register again)."""
        segment = self.segments.get(segment_id)
        if segment is None:
            return None
        segment.last_heartbeat_s = self.clock()
        return self.epoch

    def advertise(self, segment_id: str, held: Iterable[tuple[bytes, str, int, int]]) -> int:
        """Adopt objects an owner holds (key, tenant, offset, num_bytes); returns how many were new."""
        segment = self.segments.get(segment_id)
        if segment is None:
            raise ValueError(f"unknown segment {segment_id!r}: register it first")
        adopted = 0
        now = self.clock()
        for key, tenant, offset, num_bytes in held:
            location = Location(segment_id, offset, num_bytes)
            meta = self.objects.get(key)
            if meta is not None and (meta.num_bytes != num_bytes or location in meta.replicas or meta.tenant != tenant):
                continue
            try:
                segment.allocator.reserve(offset, num_bytes)
            except ValueError:
                continue  # overlaps space the snapshot already gave away: stale, skip it
            if meta is None:
                self.objects[key] = ObjectMeta(tenant, num_bytes, ObjectState.COMPLETE, [location], now)
                self.tenant_bytes[tenant] = self.tenant_bytes.get(tenant, 0) + num_bytes
            else:
                meta.replicas.append(location)
            adopted += 1
        return adopted

    def drop_segment(self, segment_id: str) -> None:
        """Forget a segment and every replica on it (its owner is gone)."""
        if self.segments.pop(segment_id, None) is None:
            return
        for key, meta in list(self.objects.items()):
            kept = [loc for loc in meta.replicas if loc.segment_id != segment_id]
            if len(kept) != len(meta.replicas):
                meta.replicas = kept
                if not kept:
                    self._forget(key, meta)
        self._deferred = [entry for entry in self._deferred if entry[1].segment_id != segment_id]

    # -- puts -------------------------------------------------------------

    def put_start(
        self,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        tenant: str,
        replicas: int = 1,
        preferred_segment_id: str | None = None,
        pin_ttl_s: float | None = None,
    ) -> list[PutPlan]:
        if len(keys) != len(sizes):
            raise ValueError(f"{len(keys)} keys but {len(sizes)} sizes")
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        now = self.clock()
        plans = []
        for key, num_bytes in zip(keys, sizes):
            if num_bytes <= 0:
                raise ValueError(f"object size must be > 0, got {num_bytes}")
            meta = self.objects.get(key)
            if meta is not None and meta.tenant != tenant:  # another tenant's key: never shared, never replaced
                self._count("put_failures", tenant)
                plans.append(PutPlan("conflict"))
                continue
            if meta is not None:  # duplicate put: a success, nothing to write
                meta.last_access_s = now
                plans.append(PutPlan("exists"))
                continue
            if not self._make_quota_room(tenant, num_bytes):
                self._count("put_failures", tenant)
                plans.append(PutPlan("quota"))
                continue
            locations = self._place(num_bytes, replicas, preferred_segment_id)
            if not locations:
                self._count("put_failures", tenant)
                plans.append(PutPlan("no_space"))
                continue
            self.objects[key] = ObjectMeta(
                tenant,
                num_bytes,
                ObjectState.PENDING,
                list(locations),
                now,
                put_deadline_s=now + self.config.put_timeout_s,
                pin_ttl_on_complete_s=pin_ttl_s,
            )
            self.tenant_bytes[tenant] = self.tenant_bytes.get(tenant, 0) + num_bytes
            plans.append(PutPlan("write", tuple(locations)))
        return plans

    def put_end(self, keys: Sequence[bytes]) -> list[bool]:
        """Commit written objects; False for a key whose put was reclaimed or revoked meanwhile."""
        now = self.clock()
        done = []
        for key in keys:
            meta = self.objects.get(key)
            if meta is None or meta.state is not ObjectState.PENDING:
                done.append(meta is not None)
                continue
            meta.state = ObjectState.COMPLETE
            meta.last_access_s = now
            if meta.pin_ttl_on_complete_s is not None:
                meta.pin_until_s = now + meta.pin_ttl_on_complete_s
            self._count("puts", meta.tenant)
            done.append(True)
        return done

    def put_revoke(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            meta = self.objects.get(key)
            if meta is not None and meta.state is ObjectState.PENDING:
                self._count("put_failures", meta.tenant)
                self._forget(key, meta)

    def _place(self, num_bytes: int, replicas: int, preferred: str | None) -> list[Location]:
        """Allocate up to ``replicas`` copies on different segments, preferring different nodes.

        A copy goes to the first segment (the writer's own first) that stays under the high
        watermark with it, else to any with room, and only when none has room does a segment evict:
        space on a store node beats evicting the writer's own pages.
        """
        chosen: list[Location] = []
        used_nodes: set[str] = set()
        for _ in range(replicas):
            candidates = [
                s
                for s in self.segments.values()
                if s.confirmed and all(loc.segment_id != s.segment_id for loc in chosen)
            ]
            candidates.sort(key=lambda s: (s.segment_id != preferred, s.node_id in used_nodes, s.allocator.usage))
            placed = self._allocate_somewhere(candidates, num_bytes)
            if placed is None:
                break  # best effort: fewer replicas than asked
            segment, offset = placed
            chosen.append(Location(segment.segment_id, offset, num_bytes))
            used_nodes.add(segment.node_id)
            if segment.allocator.usage > self.config.high_watermark:
                self._evict(segment)
        return chosen

    def _allocate_somewhere(self, candidates: list[SegmentInfo], num_bytes: int) -> tuple[SegmentInfo, int] | None:
        high = self.config.high_watermark
        roomy = [s for s in candidates if s.allocator.used_bytes + num_bytes <= high * s.allocator.capacity_bytes]
        for segment in roomy + [s for s in candidates if s not in roomy]:
            offset = segment.allocator.allocate(num_bytes)
            if offset is not None:
                return segment, offset
        for segment in candidates:  # nowhere has room: evict, then allocate
            self._evict(segment, need_bytes=num_bytes)
            offset = segment.allocator.allocate(num_bytes)
            if offset is not None:
                return segment, offset
        return None

    # -- reads ------------------------------------------------------------

    def get_locations(
        self, keys: Sequence[bytes], reader_node_id: str | None = None, reader_tenant: str = "default"
    ) -> list[list[Location] | None]:
        """Replicas of each complete object of ``reader_tenant`` (same-node first), each read under a fresh lease.

        Another tenant's object is a miss, as if absent: a tenant never reads, nor learns of, another's pages.
        """
        now = self.clock()
        lease_until_s = now + self.config.lease_ttl_s
        objects, complete = self.objects, ObjectState.COMPLETE
        out: list[list[Location] | None] = []
        hits = misses = 0
        for key in keys:  # a thousand keys a call: kept lean
            meta = objects.get(key)
            if meta is None or meta.state is not complete or not meta.replicas or meta.tenant != reader_tenant:
                misses += 1
                out.append(None)
                continue
            hits += 1
            meta.last_access_s = now
            if meta.lease_until_s < lease_until_s:
                meta.lease_until_s = lease_until_s
            replicas = meta.replicas
            if len(replicas) > 1:
                replicas = sorted(replicas, key=lambda loc: self.segments[loc.segment_id].node_id != reader_node_id)
            out.append(list(replicas))
        if hits:
            self._count("hits", reader_tenant, hits)
        if misses:
            self._count("misses", reader_tenant, misses)
        return out

    def exists(self, keys: Sequence[bytes], tenant: str) -> list[bool]:
        """Whether each key is a complete object of ``tenant`` (another tenant's object: False)."""
        return [self._complete(key, tenant) for key in keys]

    def longest_prefix(self, keys: Sequence[bytes], tenant: str) -> int:
        """How many leading keys are complete objects of ``tenant``."""
        count = 0
        for key in keys:
            if not self._complete(key, tenant):
                break
            count += 1
        return count

    def _complete(self, key: bytes, tenant: str) -> bool:
        meta = self.objects.get(key)
        return meta is not None and meta.state is ObjectState.COMPLETE and bool(meta.replicas) and meta.tenant == tenant

    # -- removal, pins ----------------------------------------------------

    def remove(self, keys: Sequence[bytes]) -> int:
        removed = 0
        for key in keys:
            meta = self.objects.get(key)
            if meta is not None:
                self._forget(key, meta)
                removed += 1
        return removed

    def pin(self, keys: Sequence[bytes], ttl_s: float | None) -> None:
        """Soft pin for ``ttl_s`` seconds, or a hard pin (until unpinned) when ``ttl_s`` is None."""
        now = self.clock()
        for key in keys:
            meta = self.objects.get(key)
            if meta is None:
                continue
            if ttl_s is None:
                meta.hard_pinned = True
            else:
                meta.pin_until_s = max(meta.pin_until_s, now + ttl_s)

    def unpin(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            meta = self.objects.get(key)
            if meta is not None:
                meta.hard_pinned = False
                meta.pin_until_s = 0.0

    # -- space ------------------------------------------------------------

    def _forget(self, key: bytes, meta: ObjectMeta) -> None:
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
                self._free(location)

    def _free(self, location: Location) -> None:
        segment = self.segments.get(location.segment_id)
        if segment is not None:
            segment.allocator.free(location.offset, location.num_bytes)

    def _evict(self, segment: SegmentInfo, need_bytes: int = 0) -> int:
        """Evict LRU-first from one segment until it is under the low watermark and ``need_bytes`` fit."""
        allocator = segment.allocator
        target_used = min(
            int(allocator.capacity_bytes * self.config.low_watermark), allocator.capacity_bytes - need_bytes
        )
        if allocator.used_bytes <= target_used:
            return 0
        now = self.clock()
        candidates = [
            (meta.last_access_s, key, meta)
            for key, meta in self.objects.items()
            if meta.evictable(now) and any(loc.segment_id == segment.segment_id for loc in meta.replicas)
        ]
        candidates.sort(key=lambda item: item[0])
        evicted = 0
        for _, key, meta in candidates:
            if allocator.used_bytes <= target_used:
                break
            self._evict_replica(key, meta, segment.segment_id)
            evicted += 1
        return evicted

    def _evict_replica(self, key: bytes, meta: ObjectMeta, segment_id: str) -> None:
        self._count("evictions", meta.tenant)
        if len(meta.replicas) == 1:
            self._forget(key, meta)
            return
        location = next(loc for loc in meta.replicas if loc.segment_id == segment_id)
        meta.replicas.remove(location)
        self._free(location)

    def _make_quota_room(self, tenant: str, num_bytes: int) -> bool:
        quota = self.config.tenant_quota_bytes.get(tenant)
        if quota is None:
            return True
        if num_bytes > quota:
            return False
        now = self.clock()
        over = self.tenant_bytes.get(tenant, 0) + num_bytes - quota
        if over <= 0:
            return True
        own = sorted(
            ((m.last_access_s, k, m) for k, m in self.objects.items() if m.tenant == tenant and m.evictable(now)),
            key=lambda item: item[0],
        )
        for _, key, meta in own:
            if over <= 0:
                break
            over -= meta.num_bytes
            self._count("evictions", tenant)
            self._forget(key, meta)
        return over <= 0

    # -- housekeeping -----------------------------------------------------

    def tick(self) -> None:
        """Periodic work: reclaim stale puts, end leases, drop silent segments, keep watermarks."""
        now = self.clock()
        for key, meta in list(self.objects.items()):
            if meta.state is ObjectState.PENDING and meta.put_deadline_s <= now:
                self._count("reclaimed_puts", meta.tenant)
                self._count("put_failures", meta.tenant)
                self._forget(key, meta)
        still_leased = []
        for entry in self._deferred:
            until_s, location, tenant, leased = entry
            if until_s <= now:
                if leased:
                    self._count("lease_expiries", tenant)
                self._free(location)
            else:
                still_leased.append(entry)
        self._deferred = still_leased
        for segment in list(self.segments.values()):
            if now - segment.last_heartbeat_s > self.config.heartbeat_timeout_s:
                self.drop_segment(segment.segment_id)
        for segment in self.segments.values():
            if segment.allocator.usage > self.config.high_watermark:
                self._evict(segment)

    def stats(self) -> dict[str, Any]:
        counters = _as_dict(self.counters)
        return {
            "epoch": self.epoch,
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

    # -- persistence ------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Complete objects and segments as plain data (msgpack-able); pending puts are not kept."""
        return {
            "version": 1,
            "segments": [{**s.public(), "page_bytes": s.allocator.page_bytes} for s in self.segments.values()],
            "objects": [
                [
                    key,
                    meta.tenant,
                    meta.num_bytes,
                    [[loc.segment_id, loc.offset, loc.num_bytes] for loc in meta.replicas],
                    meta.hard_pinned,
                ]
                for key, meta in self.objects.items()
                if meta.state is ObjectState.COMPLETE
            ],
        }

    def restore(self, snapshot: Mapping[str, Any]) -> None:
        """Rebuild from a snapshot; segments must heartbeat within the timeout or are dropped."""
        if snapshot.get("version") != 1:
            raise ValueError(f"unsupported snapshot version {snapshot.get('version')!r}")
        for seg in snapshot["segments"]:
            self.register_segment(
                seg["segment_id"],
                seg["node_id"],
                seg["shm_name"],
                seg["capacity_bytes"],
                parse_address(seg["ucx_address"]),
                seg.get("page_bytes"),
            )
            self.segments[seg["segment_id"]].confirmed = False
        for key, tenant, _num_bytes, replicas, hard_pinned in snapshot["objects"]:
            for segment_id, offset, length in replicas:
                self.advertise(segment_id, [(key, tenant, offset, length)])
            if key in self.objects:
                self.objects[key].hard_pinned = bool(hard_pinned)


def _as_dict(counters: Counters) -> dict[str, int]:
    return {name: getattr(counters, name) for name in Counters.__dataclass_fields__}
