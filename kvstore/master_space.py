"""Where new replicas go, and what is evicted to make room.

A put that does not fit evicts first (LRU over complete, unleased,
unpinned objects on that segment, in the ledger's order of last use), and
any segment past the high watermark is brought back to the low one
(``keep_watermarks``, on every tick), so eviction never lags until the pool
is full. A tenant over its quota has its own least recently used objects
evicted before it is refused.

Most puts place one copy of one page size, and between two of them other
segments only fill up, unless space is freed or the segments change (the
ledger counts both: ``room_gains``). So where the previous single copy of
that size for that writer went is tried first, and the segments are only
scanned again when that is no longer first.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from .master_ledger import Ledger
from .master_types import MasterConfig, Replica, SegmentInfo


class SpaceManager:
    def __init__(self, ledger: Ledger, config: MasterConfig) -> None:
        self._ledger = ledger
        self._config = config
        self._last_single: _LastPlacement | None = None

    def place(self, num_bytes: int, replicas: int, preferred: str | None) -> tuple[Replica, ...]:
        """Allocate up to ``replicas`` copies on different segments, preferring different nodes.

        A copy goes to the first segment (the writer's own first) that stays under the high
        watermark with it, else to any with room, and only when none has room does a segment evict:
        space on a store node beats evicting the writer's own pages.
        """
        if replicas == 1:
            placed = self._allocate_as_last(num_bytes, preferred)
            if placed is not None:
                segment, offset = placed
                if segment.allocator.usage > self._config.high_watermark:
                    self.evict(segment)
                return ((segment.segment_id, offset, num_bytes),)
        chosen: list[Replica] = []
        used_nodes: set[str] = set()
        for _ in range(replicas):
            chosen_ids = {segment_id for segment_id, _, _ in chosen}
            placed = self._allocate_first_roomy(num_bytes, preferred, chosen_ids, used_nodes, remember=replicas == 1)
            if placed is None:
                candidates = [
                    s for s in self._ledger.segments.values() if s.confirmed and s.segment_id not in chosen_ids
                ]
                candidates.sort(key=lambda s: _order(s, preferred, used_nodes))
                placed = self._allocate_somewhere(candidates, num_bytes)
            if placed is None:
                break  # best effort: fewer replicas than asked
            segment, offset = placed
            chosen.append((segment.segment_id, offset, num_bytes))
            used_nodes.add(segment.node_id)
            if segment.allocator.usage > self._config.high_watermark:
                self.evict(segment)
        return tuple(chosen)

    def _allocate_as_last(self, num_bytes: int, preferred: str | None) -> tuple[SegmentInfo, int] | None:
        """A single copy where the previous one went, when that is still the first roomy segment.

        Unless the ledger's ``room_gains`` moved, no other segment has gained room since the previous
        choice, so the segment it chose is still first while it has room and its order stays below the
        runner-up's (the runner-up's then, which can only have filled up since).
        """
        last = self._last_single
        if last is None or last.num_bytes != num_bytes or last.preferred != preferred:
            return None
        segment = last.segment
        if last.room_gains != self._ledger.room_gains or not segment.confirmed:
            return None
        allocator = segment.allocator
        used_bytes, capacity_bytes = allocator.used_bytes, allocator.capacity_bytes
        if used_bytes + num_bytes > self._config.high_watermark * capacity_bytes:
            return None
        # ``_order`` of a single copy (no node holds one yet), inline: this runs for nearly every page put.
        if not (segment.segment_id != preferred, False, used_bytes / capacity_bytes) < last.runner_up:
            return None
        offset = allocator.allocate(num_bytes)
        return (segment, offset) if offset is not None else None

    def _allocate_first_roomy(
        self,
        num_bytes: int,
        preferred: str | None,
        chosen_ids: set[str],
        used_nodes: set[str],
        remember: bool = False,
    ) -> tuple[SegmentInfo, int] | None:
        """The common case in one pass, without sorting: the segment ``_allocate_somewhere`` tries first when
        one has room under the high watermark. None when none has, or it cannot allocate (fragmented).
        With ``remember``, the choice and the runner-up's order are kept for ``_allocate_as_last``."""
        first: SegmentInfo | None = None
        first_order = runner_up = _LAST_IN_ORDER
        high_watermark = self._config.high_watermark
        for segment in self._ledger.segments.values():
            allocator = segment.allocator
            used_bytes, capacity_bytes = allocator.used_bytes, allocator.capacity_bytes
            if (
                used_bytes + num_bytes <= high_watermark * capacity_bytes
                and segment.confirmed
                and segment.segment_id not in chosen_ids
            ):
                order = (segment.segment_id != preferred, segment.node_id in used_nodes, used_bytes / capacity_bytes)
                if order < first_order:
                    first, first_order, runner_up = segment, order, first_order
                elif order < runner_up:
                    runner_up = order
        if first is None:
            return None
        offset = first.allocator.allocate(num_bytes)
        if offset is None:
            return None
        if remember:
            self._last_single = _LastPlacement(first, num_bytes, preferred, runner_up, self._ledger.room_gains)
        return first, offset

    def _roomy(self, segment: SegmentInfo, num_bytes: int) -> bool:
        """Whether the segment stays under the high watermark with ``num_bytes`` more."""
        allocator = segment.allocator
        return allocator.used_bytes + num_bytes <= self._config.high_watermark * allocator.capacity_bytes

    def _allocate_somewhere(self, candidates: list[SegmentInfo], num_bytes: int) -> tuple[SegmentInfo, int] | None:
        roomy: list[SegmentInfo] = []
        crowded: list[SegmentInfo] = []
        for segment in candidates:
            (roomy if self._roomy(segment, num_bytes) else crowded).append(segment)
        for segment in roomy + crowded:
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
        objects, segment_id = self._ledger.objects, segment.segment_id
        evictions: dict[str, int] = {}  # per tenant, counted once per call
        for key in self._ledger.least_recent(segment_id):
            if allocator.used_bytes <= target_used:
                break
            meta = objects.get(key)
            location = None
            if meta is not None:
                for replica in meta.replicas:
                    if replica[0] == segment_id:
                        location = replica
                        break
            if meta is None or location is None:
                self._ledger.unlist(segment_id, key)
            elif meta.evictable(now):
                if len(meta.replicas) == 1:
                    self._ledger.forget(key, meta)
                else:
                    self._ledger.remove_replica(key, meta, location)
                evictions[meta.tenant] = evictions.get(meta.tenant, 0) + 1
        for tenant, count in evictions.items():
            self._ledger.count("evictions", tenant, count)
        return sum(evictions.values())

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


# An order after every segment's (``_order``): no segment has it.
_LAST_IN_ORDER = (True, True, float("inf"))


@dataclass(slots=True)
class _LastPlacement:
    """Where a put's previous single copy went, and what it took to be first there."""

    segment: SegmentInfo
    num_bytes: int
    preferred: str | None
    runner_up: tuple[bool, bool, float]
    # The ledger's ``room_gains`` then.
    room_gains: int


def _order(segment: SegmentInfo, preferred: str | None, used_nodes: AbstractSet[str]) -> tuple[bool, bool, float]:
    """Where a new replica goes first: the preferred segment, then segments on nodes without a copy yet, then
    the least used."""
    return (segment.segment_id != preferred, segment.node_id in used_nodes, segment.allocator.usage)
