"""What an owner's segment holds: key -> range, kept consistent with the bytes.

Every write into a segment goes through its owner (its own puts, or its UCX
server), so the owner sees each one and drops any entry whose range the new
bytes overlap. The index then never names bytes that were overwritten, and
re-advertising it to a restarted master cannot hand out wrong data.
"""

from __future__ import annotations

import bisect
import threading


class HeldIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._offsets: list[int] = []  # sorted starts of held ranges
        self._by_offset: dict[int, tuple[bytes, str, int]] = {}  # offset -> (key, tenant, num_bytes)

    def record(self, key: bytes, tenant: str, offset: int, num_bytes: int) -> None:
        with self._lock:
            self._drop_overlapping(offset, num_bytes)
            bisect.insort(self._offsets, offset)
            self._by_offset[offset] = (key, tenant, num_bytes)

    def _drop_overlapping(self, offset: int, num_bytes: int) -> None:
        end = offset + num_bytes
        index = bisect.bisect_left(self._offsets, offset)
        if index > 0:  # the range starting before ours may reach into it
            previous = self._offsets[index - 1]
            if previous + self._by_offset[previous][2] > offset:
                index -= 1
        while index < len(self._offsets) and self._offsets[index] < end:
            del self._by_offset[self._offsets[index]]
            del self._offsets[index]

    def items(self) -> list[tuple[bytes, str, int, int]]:
        """(key, tenant, offset, num_bytes) of everything held."""
        with self._lock:
            return [(key, tenant, offset, size) for offset, (key, tenant, size) in self._by_offset.items()]

    def __len__(self) -> int:
        return len(self._offsets)
