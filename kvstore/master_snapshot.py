"""The master's state as plain data (msgpack-able), and back.

A snapshot keeps segments and complete objects; pending puts are not kept
(their writers learn at ``put_end`` that they failed). Restored segments take
nothing new until their owners register again, and owners then re-advertise
what they hold, which fills in anything the snapshot missed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .master_types import ObjectState, parse_address

if TYPE_CHECKING:
    from .master_state import MasterState

SNAPSHOT_VERSION = 2
_READABLE_VERSIONS = (1, 2)  # version 1 objects carry no digest


def snapshot(state: MasterState) -> dict[str, Any]:
    """Complete objects and segments as plain data; pending puts are not kept."""
    return {
        "version": SNAPSHOT_VERSION,
        "segments": [{**s.public(), "page_bytes": s.allocator.page_bytes} for s in state.segments.values()],
        "objects": [
            [
                key,
                meta.tenant,
                meta.num_bytes,
                [list(replica) for replica in meta.replicas],
                meta.hard_pinned,
                meta.digest,
            ]
            for key, meta in state.objects.items()
            if meta.state is ObjectState.COMPLETE
        ],
    }


def restore(state: MasterState, snapshot: Mapping[str, Any]) -> None:
    """Rebuild ``state`` from a snapshot; segments must heartbeat within the timeout or are dropped."""
    if snapshot.get("version") not in _READABLE_VERSIONS:
        raise ValueError(f"unsupported snapshot version {snapshot.get('version')!r}")
    for seg in snapshot["segments"]:
        state.register_segment(
            seg["segment_id"],
            seg["node_id"],
            seg["shm_name"],
            seg["capacity_bytes"],
            parse_address(seg["ucx_address"]),
            seg.get("page_bytes"),
        )
        state.segments[seg["segment_id"]].confirmed = False
    for key, tenant, _num_bytes, replicas, hard_pinned, *digest in snapshot["objects"]:
        for segment_id, offset, length in replicas:
            state.adopt(segment_id, [(key, tenant, offset, length, *digest)])
        if key in state.objects:
            state.objects[key].hard_pinned = bool(hard_pinned)
