"""Where new replicas go, and what is evicted to make room.

A put that does not fit evicts first (approximate LRU over complete,
unleased, unpinned objects on that segment), and any segment past the high
watermark is brought back to the low one (``keep_watermarks``, on every
tick), so eviction never lags until the pool is full. A tenant over its
quota has its own least recently used objects evicted before it is refused.
"""

from __future__ import annotations

from .master_ledger import Ledger
from .master_types import Location, MasterConfig, ObjectMeta, SegmentInfo


class SpaceManager:
    def __init__(self, ledger: Ledger, config: MasterConfig) -> None:
        self._ledger = ledger
        self._config = config

    def place(self, num_bytes: int, replicas: int, preferred: str | None) -> list[Location]:
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
                for s in self._ledger.segments.values()
                if s.confirmed and all(loc.segment_id != s.segment_id for loc in chosen)
            ]
            candidates.sort(key=lambda s: (s.segment_id != preferred, s.node_id in used_nodes, s.allocator.usage))
            placed = self._allocate_somewhere(candidates, num_bytes)
            if placed is None:
                break  # best effort: fewer replicas than asked
            segment, offset = placed
            chosen.append(Location(segment.segment_id, offset, num_bytes))
            used_nodes.add(segment.node_id)
            if segment.allocator.usage > self._config.high_watermark:
                self.evict(segment)
        return chosen

    def _allocate_somewhere(self, candidates: list[SegmentInfo], num_bytes: int) -> tuple[SegmentInfo, int] | None:
        high = self._config.high_watermark
        roomy = [s for s in candidates if s.allocator.used_bytes + num_bytes <= high * s.allocator.capacity_bytes]
        for segment in roomy + [s for s in candidates if s not in roomy]:
            offset = segment.allocator.allocate(num_bytes)
            if offset is not None:
                return segment, offset
        for segment in candidates:  # nowhere has room: evict, then allocate
            self.evict(segment, need_bytes=num_bytes)
            offset = segment.allocator.allocate(num_bytes)
            if offset is not None:
                return segment, offset
        return None

    def keep_watermarks(self) -> None:
        """Bring every segment past the high watermark back to the low one."""
        for segment in self._ledger.segments.values():
            if segment.allocator.usage > self._config.high_watermark:
                self.evict(segment)

    def evict(self, segment: SegmentInfo, need_bytes: int = 0) -> int:
        """Evict LRU-first from one segment until it is under the low watermark and ``need_bytes`` fit."""
        allocator = segment.allocator
        target_used = min(
            int(allocator.capacity_bytes * self._config.low_watermark), allocator.capacity_bytes - need_bytes
        )
        if allocator.used_bytes <= target_used:
            return 0
        now = self._ledger.clock()
        candidates = [
            (meta.last_access_s, key, meta)
            for key, meta in self._ledger.objects.items()
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
        self._ledger.count("evictions", meta.tenant)
        if len(meta.replicas) == 1:
            self._ledger.forget(key, meta)
            return
        location = next(loc for loc in meta.replicas if loc.segment_id == segment_id)
        meta.replicas.remove(location)
        self._ledger.free(location)

    def make_quota_room(self, tenant: str, num_bytes: int) -> bool:
        """Whether ``num_bytes`` more fit ``tenant``'s quota, evicting its own LRU objects to make them fit."""
        quota = self._config.tenant_quota_bytes.get(tenant)
        if quota is None:
            return True
        if num_bytes > quota:
            return False
        now = self._ledger.clock()
        over = self._ledger.tenant_bytes.get(tenant, 0) + num_bytes - quota
        if over <= 0:
            return True
        own = sorted(
            (
                (m.last_access_s, k, m)
                for k, m in self._ledger.objects.items()
                if m.tenant == tenant and m.evictable(now)
            ),
            key=lambda item: item[0],
        )
        for _, key, meta in own:
            if over <= 0:
                break
            over -= meta.num_bytes
            self._ledger.count("evictions", tenant)
            self._ledger.forget(key, meta)
        return over <= 0
