"""Taking in objects that already sit in a segment: a snapshot's, or what an owner re-advertises.

After a master restart the state comes back from the last snapshot, and owners, who notice the new
``epoch`` in heartbeat replies, re-advertise what they hold. The owner sees every write to its segment,
so what it advertises at an offset is what the bytes there are: a complete object that the master
(restored from an older snapshot) still places at the same offset of that segment is stale, and loses
that replica.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .master_ledger import Ledger
from .master_types import ObjectMeta, ObjectState


def advertise(ledger: Ledger, segment_id: str, held: Iterable[Sequence[Any]]) -> int:
    """Adopt objects an owner holds (key, tenant, offset, num_bytes[, digest]); returns how many were new."""
    if segment_id not in ledger.segments:
        raise ValueError(f"unknown segment {segment_id!r}: register it first")
    held = [tuple(entry) for entry in held]
    key_at_offset: dict[int, bytes] = {}
    for key, _tenant, offset, *_ in held:
        key_at_offset.setdefault(offset, key)  # two keys at one offset: the first named wins, as in ``adopt``
    _drop_overwritten(ledger, segment_id, key_at_offset)
    return adopt(ledger, segment_id, held)


def adopt(ledger: Ledger, segment_id: str, held: Iterable[Sequence[Any]]) -> int:
    """Take in objects at the places given (a snapshot's, or an owner's) where nothing else is; how many."""
    segment = ledger.segments[segment_id]
    adopted = 0
    now = ledger.clock()
    for key, tenant, offset, num_bytes, *rest in held:
        digest = rest[0] if rest else None
        replica = (segment_id, offset, num_bytes)
        meta = ledger.objects.get(key)
        if meta is not None and (meta.num_bytes != num_bytes or replica in meta.replicas or meta.tenant != tenant):
            continue
        try:
            segment.allocator.reserve(offset, num_bytes)
        except ValueError:
            continue  # overlaps space the snapshot already gave away: stale, skip it
        if meta is None:
            ledger.add(key, ObjectMeta(tenant, num_bytes, ObjectState.COMPLETE, (replica,), now, digest=digest))
        else:
            ledger.add_replica(key, meta, replica)
        adopted += 1
    return adopted


def _drop_overwritten(ledger: Ledger, segment_id: str, key_at_offset: Mapping[int, bytes]) -> None:
    """Forget replicas on ``segment_id`` whose offset its owner says now holds another key's bytes."""
    for key in ledger.least_recent(segment_id):  # the keys with a replica there (some stale)
        meta = ledger.objects.get(key)
        if meta is None or meta.state is not ObjectState.COMPLETE:
            continue
        stale = [
            replica
            for replica in meta.replicas
            if replica[0] == segment_id and key_at_offset.get(replica[1], key) != key
        ]
        for replica in stale:  # freed: the key whose bytes are there now reserves them next
            ledger.remove_replica(key, meta, replica)
        if stale and not meta.replicas:
            ledger.forget(key, meta)
