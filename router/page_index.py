"""Which replicas report which pages: one index per routing process, kept up to date report by report.

A routing decision needs, for every candidate replica, the longest prefix of
the prompt it holds (``scoring.resident_prefix_pages``). Walking the prompt
once per replica costs replicas x shared prefix pages, and agents share long
system prompts, so this index walks it once for all of them: each page key
maps to a bit mask of the replicas that hold it (device or host), and the
prompt's masks are ANDed page after page until no replica is left. The walk
runs in C (``map`` + ``accumulate`` + ``takewhile``), so a decision costs
tens of nanoseconds per prompt page, whatever the number of replicas.

Reports replace each other whole (``update``); only the keys that changed
touch the index. A replica's bit is its own while it reports and is reused
after it leaves (``remove``).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from itertools import accumulate, repeat, takewhile

from rayturn.router.replica_stats import ReplicaStats

_NOTHING: frozenset[str] = frozenset()


class PageIndex:
    """Page key -> mask of the replicas that hold it; answers the resident prefix of every replica at once."""

    def __init__(self) -> None:
        self._bit_of: dict[str, int] = {}
        # The keys each replica's last report put in the index: (device keys, host-only keys).
        self._reported: dict[str, tuple[frozenset[str], frozenset[str]]] = {}
        self._holders: dict[str, int] = {}

    def update(self, replica_id: str, stats: ReplicaStats | None) -> None:
        """Index the replica's latest report (None: it holds nothing known)."""
        device = stats.cached_page_hashes if stats is not None else _NOTHING
        host_only = stats.host_page_hashes - device if stats is not None else _NOTHING
        bit = self._bit_of.get(replica_id) or self._new_bit(replica_id)
        old_device, old_host_only = self._reported.get(replica_id, (_NOTHING, _NOTHING))
        old_held, held = old_device | old_host_only, device | host_only
        holders = self._holders
        for key in old_held - held:
            mask = holders[key] & ~bit
            if mask:
                holders[key] = mask
            else:
                del holders[key]
        for key in held - old_held:
            holders[key] = holders.get(key, 0) | bit
        self._reported[replica_id] = (device, host_only)

    def remove(self, replica_id: str) -> None:
        """Forget a replica that left; its bit goes to the next replica that reports."""
        if replica_id in self._bit_of:
            self.update(replica_id, None)
            del self._bit_of[replica_id], self._reported[replica_id]

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self._bit_of

    def resident_prefixes(self, page_keys: Sequence[str], replica_ids: Iterable[str]) -> dict[str, tuple[int, int]]:
        """(device pages, host pages) of the longest prefix of the prompt each replica holds, as
        ``scoring.resident_prefix_pages`` finds it from the replica's stats; (0, 0) for a replica not indexed."""
        resident = dict.fromkeys(replica_ids, (0, 0))
        candidates = 0
        for replica_id in resident:
            candidates |= self._bit_of.get(replica_id, 0)
        if not candidates or not page_keys:
            return resident
        # masks[j]: the candidates that hold the prompt's first j pages; the walk stops when none does.
        pages_held = map(self._holders.get, page_keys, repeat(0))
        masks = list(takewhile(bool, accumulate(pages_held, operator.and_, initial=candidates)))
        # Masks only lose bits, so each value is one run: a replica's prefix ends where its bit leaves.
        prefix_by_bit: dict[int, int] = {}
        previous, start = candidates, 0
        for mask in dict.fromkeys(masks):
            start = masks.index(mask, start)
            _assign(prefix_by_bit, previous & ~mask, start - 1)
            previous = mask
        _assign(prefix_by_bit, previous, len(masks) - 1)
        for replica_id in resident:
            bit = self._bit_of.get(replica_id)
            pages = prefix_by_bit.get(bit, 0) if bit is not None else 0
            if pages:
                host_only = self._reported[replica_id][1]
                host_pages = sum(map(host_only.__contains__, page_keys[:pages])) if host_only else 0
                resident[replica_id] = (pages - host_pages, host_pages)
        return resident

    def _new_bit(self, replica_id: str) -> int:
        taken = 0
        for bit in self._bit_of.values():
            taken |= bit
        bit = (taken + 1) & ~taken  # the lowest bit not taken
        self._bit_of[replica_id] = bit
        return bit


def _assign(prefix_by_bit: dict[int, int], mask: int, num_pages: int) -> None:
    """Every replica bit in ``mask`` holds a prefix of ``num_pages`` pages."""
    while mask:
        bit = mask & -mask
        prefix_by_bit[bit] = num_pages
        mask ^= bit
