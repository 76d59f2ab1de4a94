"""The KV store master's state: metadata only, no bytes.

Keys map to replicas (segment id, offset, length) in segments that workers
contribute. One object's life cycle::

                put_start              put_end
    (absent) ------------> PENDING ------------> COMPLETE --remove / evict--> (absent)
                              |                     |
                put_revoke, or no put_end           | leased: not evicted, its space
                within put_timeout_s  --> (absent)  | freed only when the lease ends

Space management: a put that does not fit evicts first, segments past the
high watermark are brought back to the low one on every ``tick``, and a tenant
over its quota loses its own objects before it is refused (``master_space``).
The books themselves, and space that waits out a grant, are ``master_ledger``'s.

Segment owners heartbeat; a segment that falls silent loses its replicas,
so a lost page reads as a miss, never as someone else's bytes. After a
master restart the state comes back from the last snapshot, and owners, who
notice the new ``epoch`` in heartbeat replies, re-advertise what they hold
(``master_adopt``).

Time comes from an injected clock so the whole life cycle is unit-testable.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from . import master_adopt, master_snapshot
from .allocator import SegmentAllocator
from .master_ledger import Ledger
from .master_space import SpaceManager
from .master_types import Counters, Location, MasterConfig, ObjectMeta, ObjectState, PutPlan, Replica, SegmentInfo


class MasterState:
    def __init__(self, config: MasterConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or MasterConfig()
        self.clock = clock
        self.epoch = secrets.token_hex(8)  # changes on every restart: owners re-advertise
        self._ledger = Ledger(clock)
        self._space = SpaceManager(self._ledger, self.config)

    @property
    def segments(self) -> dict[str, SegmentInfo]:
        return self._ledger.segments

    @property
    def objects(self) -> dict[bytes, ObjectMeta]:
        return self._ledger.objects

    @property
    def tenant_bytes(self) -> dict[str, int]:
        return self._ledger.tenant_bytes

    @property
    def counters(self) -> Counters:
        return self._ledger.counters

    @property
    def tenant_counters(self) -> dict[str, Counters]:
        return self._ledger.tenant_counters

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
        self._ledger.room_gains += 1
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

    def advertise(self, segment_id: str, held: Iterable[Sequence[Any]]) -> int:
        """Adopt objects an owner holds (key, tenant, offset, num_bytes[, digest]); returns how many were new.

        What it advertises at an offset is what the bytes there are: a stale replica there is dropped.
        """
        return master_adopt.advertise(self._ledger, segment_id, held)

    def adopt(self, segment_id: str, held: Iterable[Sequence[Any]]) -> int:
        """Take in objects at the places given (a snapshot's, or an owner's) where nothing else is; how many."""
        return master_adopt.adopt(self._ledger, segment_id, held)

    def drop_segment(self, segment_id: str) -> None:
        """Forget a segment and every replica on it (its owner is gone)."""
        self._ledger.drop_segment(segment_id)

    # -- puts -------------------------------------------------------------

    def put_start(
        self,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        tenant: str,
        replicas: int = 1,
        preferred_segment_id: str | None = None,
        pin_ttl_s: float | None = None,
        digests: Sequence[int] | None = None,
    ) -> list[PutPlan]:
        """Plans for each key; ``digests`` (each value's identity digest, as the writer computed it) go to the objects
        so that readers can check what lands."""
        if len(keys) != len(sizes):
            raise ValueError(f"{len(keys)} keys but {len(sizes)} sizes")
        if digests is not None and len(digests) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(digests)} digests")
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        now = self.clock()
        deadline_s = now + self.config.put_timeout_s
        plans = []
        objects, space = self.objects, self._space
        has_quota = tenant in self.config.tenant_quota_bytes
        for index, (key, num_bytes) in enumerate(zip(keys, sizes)):
            if num_bytes <= 0:
                raise ValueError(f"object size must be > 0, got {num_bytes}")
            meta = objects.get(key)
            if meta is not None and meta.tenant != tenant:  # another tenant's key: never shared, never replaced
                self._ledger.count("put_failures", tenant)
                plans.append(PutPlan("conflict"))
                continue
            if meta is not None:  # duplicate put: a success, nothing to write
                self._ledger.touch(key, meta, now)
                plans.append(PutPlan("exists"))
                continue
            if has_quota and not space.make_quota_room(tenant, num_bytes):
                self._ledger.count("put_failures", tenant)
                plans.append(PutPlan("quota"))
                continue
            placed = space.place(num_bytes, replicas, preferred_segment_id)
            if not placed:
                self._ledger.count("put_failures", tenant)
                plans.append(PutPlan("no_space"))
                continue
            meta = ObjectMeta(
                tenant,
                num_bytes,
                ObjectState.PENDING,
                placed,
                now,
                put_deadline_s=deadline_s,
                pin_ttl_on_complete_s=pin_ttl_s,
                digest=None if digests is None else digests[index],
            )
            self._ledger.add(key, meta)
            plans.append(PutPlan("write", tuple(map(Location._make, placed))))
        return plans

    def put_end(self, keys: Sequence[bytes]) -> list[bool]:
        """Commit written objects; False for a key whose put was reclaimed or revoked meanwhile."""
        now = self.clock()
        done = []
        puts: dict[str, int] = {}  # per tenant, counted once per call
        objects, pending, complete = self.objects, ObjectState.PENDING, self._ledger.complete
        for key in keys:
            meta = objects.get(key)
            if meta is None or meta.state is not pending:
                done.append(meta is not None)
                continue
            complete(key, meta, now)
            if meta.pin_ttl_on_complete_s is not None:
                meta.pin_until_s = now + meta.pin_ttl_on_complete_s
            puts[meta.tenant] = puts.get(meta.tenant, 0) + 1
            done.append(True)
        for tenant, count in puts.items():
            self._ledger.count("puts", tenant, count)
        return done

    def put_revoke(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            meta = self.objects.get(key)
            if meta is not None and meta.state is ObjectState.PENDING:
                self._ledger.count("put_failures", meta.tenant)
                self._ledger.forget(key, meta)

    # -- reads ------------------------------------------------------------

    def get_locations(
        self, keys: Sequence[bytes], reader_node_id: str | None = None, reader_tenant: str = "default"
    ) -> list[list[Location] | None]:
        """Replicas of each complete object of ``reader_tenant`` (same-node first), each read under a fresh lease.

        Another tenant's object is a miss, as if absent: a tenant never reads, nor learns of, another's pages.
        """
        found = self.leased_replicas(keys, reader_node_id, reader_tenant)
        return [None if replicas is None else list(map(Location._make, replicas)) for replicas in found]

    def leased_replicas(
        self, keys: Sequence[bytes], reader_node_id: str | None, reader_tenant: str
    ) -> list[Sequence[Replica] | None]:
        """``get_locations``, as the plain tuples the master keeps."""
        now = self.clock()
        lease_until_s = now + self.config.lease_ttl_s
        objects, complete, touch = self.objects, ObjectState.COMPLETE, self._ledger.touch
        out: list[Sequence[Replica] | None] = []
        hits = misses = 0
        for key in keys:  # a thousand keys a call: kept lean
            meta = objects.get(key)
            if meta is None or meta.state is not complete or not meta.replicas or meta.tenant != reader_tenant:
                misses += 1
                out.append(None)
                continue
            hits += 1
            touch(key, meta, now)
            if meta.lease_until_s < lease_until_s:
                meta.lease_until_s = lease_until_s
            replicas: Sequence[Replica] = meta.replicas
            if len(replicas) > 1:
                replicas = sorted(replicas, key=lambda replica: self.segments[replica[0]].node_id != reader_node_id)
            out.append(replicas)
        if hits:
            self._ledger.count("hits", reader_tenant, hits)
        if misses:
            self._ledger.count("misses", reader_tenant, misses)
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
                self._ledger.forget(key, meta)
                removed += 1
        return removed

    def pin(self, keys: Sequence[bytes], ttl_s: float | None, tenant: str | None = None) -> None:
        """Soft pin for ``ttl_s`` seconds (never shortening one), or a hard pin (until unpinned) when ``ttl_s``
        is None; with ``tenant``, only that tenant's objects (another tenant's key is left as it is)."""
        now = self.clock()
        for key in keys:
            meta = self.objects.get(key)
            if meta is None or (tenant is not None and meta.tenant != tenant):
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

    # -- housekeeping -----------------------------------------------------

    def tick(self) -> None:
        """Periodic work: reclaim stale puts, end leases, drop silent segments, keep watermarks."""
        now = self.clock()
        for key in list(self._ledger.pending):
            meta = self.objects[key]
            if meta.put_deadline_s <= now:
                self._ledger.count("reclaimed_puts", meta.tenant)
                self._ledger.count("put_failures", meta.tenant)
                self._ledger.forget(key, meta)
        self._ledger.release_due(now)
        for segment in list(self.segments.values()):
            if now - segment.last_heartbeat_s > self.config.heartbeat_timeout_s:
                self.drop_segment(segment.segment_id)
        self._space.keep_watermarks()

    def stats(self) -> dict[str, Any]:
        return {"epoch": self.epoch, **self._ledger.stats()}

    # -- persistence ------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Complete objects and segments as plain data (msgpack-able); pending puts are not kept."""
        return master_snapshot.snapshot(self)

    def restore(self, snapshot: Mapping[str, Any]) -> None:
        """Rebuild from a snapshot; segments must heartbeat within the timeout or are dropped."""
        master_snapshot.restore(self, snapshot)
