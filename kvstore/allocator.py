"""Byte-range allocation inside one segment: an O(1) page tier over a first-fit range tier.

The master of the KV store keeps no data, only metadata: for each worker's segment it hands out
byte ranges for KV pages and other objects. Almost every request is for one KV page of one model,
and all pages of a model have the same size, so that case must be cheap. The allocator therefore
has two tiers:

* **Page tier** — a LIFO free list of page blocks (``page_block_bytes``: ``page_bytes`` rounded up
  to ``alignment``). A request whose rounded size equals ``page_block_bytes`` pops a block in O(1);
  freeing such an allocation pushes the block back in O(1). Blocks on this list are never merged
  with their neighbours, which is what keeps the hot path O(1). The list is a ``dict`` used as an
  insertion-ordered set: ``popitem()`` is a LIFO pop and a block can also be removed by offset.
* **Range tier** — every other byte that is free, as disjoint ranges sorted by offset and
  coalesced with their free neighbours on free (``bisect`` finds the neighbours in O(log n)).
  Requests of other sizes are served first fit from here, and so are page requests when the page
  list is empty (a new block is carved off the lowest range that fits).

Invariants (checked by :meth:`SegmentAllocator.check_invariants`):

1. Every byte of ``[0, capacity_bytes)`` is exactly one of: allocated, inside a block on the page
   free list, inside a free range.
2. Free ranges are non-empty, sorted, disjoint and never adjacent (adjacent ones are merged).
3. Every boundary between these pieces is a multiple of ``alignment`` (only ``capacity_bytes``
   itself may be unaligned), so every offset handed out is aligned.
4. ``used_bytes`` is the sum of the rounded sizes of all allocations.

Because the page tier never merges, free space parked on the page list is invisible to the range
tier. When a non-page request does not fit, or a :meth:`~SegmentAllocator.reserve` hits a parked
block, the page list is first drained back into the range tier (O(k log n) for k parked blocks,
only on that slow path) and the request is retried. A page request that finds the page list empty
and no range large enough returns ``None``: the segment is full or too fragmented, and the caller
(the master) must evict.
"""

from __future__ import annotations

import bisect

__all__ = ["SegmentAllocator"]


def _round_up(num_bytes: int, alignment: int) -> int:
    return (num_bytes + alignment - 1) & ~(alignment - 1)


class SegmentAllocator:
    """Allocates aligned byte ranges in ``[0, capacity_bytes)``; see the module docstring."""

    def __init__(self, capacity_bytes: int, page_bytes: int | None = None, alignment: int = 64) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a positive power of two, got {alignment}")
        if page_bytes is not None and page_bytes <= 0:
            raise ValueError(f"page_bytes must be positive or None, got {page_bytes}")
        self._capacity_bytes = capacity_bytes
        self._alignment = alignment
        self._page_bytes = page_bytes
        self._page_block_bytes = None if page_bytes is None else _round_up(page_bytes, alignment)
        self._allocated: dict[int, int] = {}  # offset -> rounded size
        self._free_pages: dict[int, None] = {}  # offsets of parked page blocks, in push order
        self._range_starts: list[int] = [0]  # sorted; parallel to _range_ends
        self._range_ends: list[int] = [capacity_bytes]
        self._used_bytes = 0

    # -- properties ---------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    @property
    def page_bytes(self) -> int | None:
        return self._page_bytes

    @property
    def alignment(self) -> int:
        return self._alignment

    @property
    def used_bytes(self) -> int:
        """Sum of the rounded sizes of all live allocations."""
        return self._used_bytes

    @property
    def free_bytes(self) -> int:
        return self._capacity_bytes - self._used_bytes

    @property
    def usage(self) -> float:
        """``used_bytes / capacity_bytes``, in ``[0, 1]``."""
        return self._used_bytes / self._capacity_bytes

    @property
    def num_allocations(self) -> int:
        return len(self._allocated)

    @property
    def num_free_page_blocks(self) -> int:
        """Blocks parked on the page free list."""
        return len(self._free_pages)

    # -- public operations ----------------------------------------------------------------------

    def allocate(self, num_bytes: int) -> int | None:
        """Return the offset of a new allocation of ``num_bytes`` (rounded up), or ``None`` if it does not fit."""
        if num_bytes <= 0:
            raise ValueError(f"num_bytes must be positive, got {num_bytes}")
        size_bytes = (num_bytes + self._alignment - 1) & -self._alignment
        if size_bytes == self._page_block_bytes:
            if self._free_pages:  # the hot path, inline
                block, _ = self._free_pages.popitem()
                self._allocated[block] = size_bytes
                self._used_bytes += size_bytes
                return block
            offset = self._pop_page_block()
        else:
            offset = self._take_first_fit(size_bytes)
            if offset is None and self._free_pages:
                self._drain_page_blocks()
                offset = self._take_first_fit(size_bytes)
        if offset is not None:
            self._mark_allocated(offset, size_bytes)
        return offset

    def free(self, offset: int, num_bytes: int) -> None:
        """Release an allocation; ``num_bytes`` must be the size it was allocated (or reserved) with."""
        if num_bytes <= 0:
            raise ValueError(f"num_bytes must be positive, got {num_bytes}")
        size_bytes = (num_bytes + self._alignment - 1) & -self._alignment
        allocated_bytes = self._allocated.get(offset)
        if allocated_bytes is None:
            raise ValueError(f"free of offset {offset}: no allocation starts there (double free or bad offset)")
        if allocated_bytes != size_bytes:
            raise ValueError(
                f"free of offset {offset} with num_bytes={num_bytes} (rounded {size_bytes}), "
                f"but {allocated_bytes} bytes are allocated there"
            )
        del self._allocated[offset]
        self._used_bytes -= size_bytes
        if size_bytes == self._page_block_bytes:
            self._free_pages[offset] = None
        else:
            self._insert_free_range(offset, offset + size_bytes)

    def reserve(self, offset: int, num_bytes: int) -> None:
        """Mark ``[offset, offset + num_bytes)`` (rounded up) as allocated, e.g. when a restarted master
        rebuilds its state from what segment owners advertise. The range may lie in the free ranges,
        on the page free list, or across both; ValueError if any of it is allocated or out of bounds."""
        if num_bytes <= 0:
            raise ValueError(f"num_bytes must be positive, got {num_bytes}")
        size_bytes = _round_up(num_bytes, self._alignment)
        end = offset + size_bytes
        if offset < 0 or end > self._capacity_bytes or offset % self._alignment:
            raise ValueError(
                f"reserve of [{offset}, {end}) is out of bounds or unaligned "
                f"(capacity_bytes={self._capacity_bytes}, alignment={self._alignment})"
            )
        carved = self._carve_range(offset, end)
        if not carved and self._free_pages:
            self._drain_page_blocks()
            carved = self._carve_range(offset, end)
        if not carved:
            raise ValueError(f"reserve of [{offset}, {end}) overlaps an existing allocation")
        self._mark_allocated(offset, size_bytes)

    def check_invariants(self) -> None:
        """Raise RuntimeError if the bookkeeping is inconsistent (O(n log n); for tests and debugging)."""
        pieces = sorted(
            [(start, start + size, "allocated") for start, size in self._allocated.items()]
            + [(start, start + (self._page_block_bytes or 0), "page block") for start in self._free_pages]
            + [(start, end, "free range") for start, end in zip(self._range_starts, self._range_ends)]
        )
        cursor = 0
        for start, end, kind in pieces:
            if start != cursor or end <= start:
                raise RuntimeError(f"{kind} [{start}, {end}) does not continue the tiling at {cursor}")
            if start % self._alignment:
                raise RuntimeError(f"{kind} [{start}, {end}) is not aligned to {self._alignment}")
            cursor = end
        if cursor != self._capacity_bytes:
            raise RuntimeError(f"pieces cover [0, {cursor}), not [0, {self._capacity_bytes})")
        for end, next_start in zip(self._range_ends, self._range_starts[1:]):
            if end >= next_start:
                raise RuntimeError(f"free ranges touch or overlap at {end}: they should have been merged")
        if self._used_bytes != sum(self._allocated.values()):
            raise RuntimeError(f"used_bytes={self._used_bytes} but allocations sum to {sum(self._allocated.values())}")

    # -- page tier ------------------------------------------------------------------------------

    def _pop_page_block(self) -> int | None:
        if self._free_pages:
            offset, _ = self._free_pages.popitem()
            return offset
        assert self._page_block_bytes is not None
        return self._take_first_fit(self._page_block_bytes)

    def _drain_page_blocks(self) -> None:
        """Return every parked page block to the range tier, merging it with its neighbours."""
        assert self._page_block_bytes is not None
        while self._free_pages:
            offset, _ = self._free_pages.popitem()
            self._insert_free_range(offset, offset + self._page_block_bytes)

    # -- range tier -----------------------------------------------------------------------------

    def _mark_allocated(self, offset: int, size_bytes: int) -> None:
        self._allocated[offset] = size_bytes
        self._used_bytes += size_bytes

    def _take_first_fit(self, size_bytes: int) -> int | None:
        """Cut ``size_bytes`` off the front of the lowest free range that is large enough."""
        for index, (start, end) in enumerate(zip(self._range_starts, self._range_ends)):
            if end - start >= size_bytes:
                if end - start == size_bytes:
                    del self._range_starts[index], self._range_ends[index]
                else:
                    self._range_starts[index] = start + size_bytes
                return start
        return None

    def _carve_range(self, start: int, end: int) -> bool:
        """Remove ``[start, end)`` from the free ranges if one range contains all of it."""
        index = bisect.bisect_right(self._range_starts, start) - 1
        if index < 0 or self._range_ends[index] < end:
            return False
        range_start, range_end = self._range_starts[index], self._range_ends[index]
        del self._range_starts[index], self._range_ends[index]
        # Re-insert the pieces on either side, in offset order, at the same index.
        if end < range_end:
            self._range_starts.insert(index, end)
            self._range_ends.insert(index, range_end)
        if range_start < start:
            self._range_starts.insert(index, range_start)
            self._range_ends.insert(index, start)
        return True

    def _insert_free_range(self, start: int, end: int) -> None:
        """Add ``[start, end)`` (known to be free of every other piece) and merge it with touching ranges."""
        index = bisect.bisect_left(self._range_starts, start)
        merges_left = index > 0 and self._range_ends[index - 1] == start
        merges_right = index < len(self._range_starts) and self._range_starts[index] == end
        if merges_left and merges_right:
            self._range_ends[index - 1] = self._range_ends[index]
            del self._range_starts[index], self._range_ends[index]
        elif merges_left:
            self._range_ends[index - 1] = end
        elif merges_right:
            self._range_starts[index] = start
        else:
            self._range_starts.insert(index, start)
            self._range_ends.insert(index, end)
