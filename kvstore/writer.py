"""The write path of a KV store client: a put's two phases (start, bytes written, end or revoke).

    put_start at the master --> a plan per key: "exists" (done) or "write" to these locations, with a grant
        per segment --> bytes written: into the client's own segment directly, into another owner's over
        UCX (the owner checks the grant) --> put_end for what was written, put_revoke for what failed

Every page carries the identity digest of its bytes (``digest``) from ``put_start`` on, so a reader can
tell its bytes from another page's. While the master does not answer, a put gives up after
``PUT_TIMEOUT_S`` and its keys count as not stored; uncommitted puts are reclaimed after the master's put timeout.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from .access import WriteGrant
from .bytes_view import as_bytes_view
from .connection import PUT_TIMEOUT_S, MasterConnection, MasterUnavailable, RemoteClient
from .digest import buffer_digests
from .held_index import HeldIndex
from .master_types import Location, PutStart
from .metrics import KVMetrics
from .peers import PeerDirectory
from .segment import Segment
from .ucx_transport import TransportError

logger = logging.getLogger(__name__)


class Writer:
    """Puts pages as one tenant's, from the client whose segment is ``segment_id``."""

    def __init__(
        self,
        master: MasterConnection,
        segment: Segment,
        segment_id: str,
        held: HeldIndex,
        peers: PeerDirectory,
        remote: RemoteClient,
        metrics: KVMetrics,
    ) -> None:
        self.master = master
        self.segment = segment
        self.segment_id = segment_id
        self.held = held
        self._peers = peers
        self._remote = remote
        self.metrics = metrics

    def put(
        self, keys: Sequence[bytes], values: Sequence[Any], replicas: int, pin_ttl_s: float | None, owner: str
    ) -> list[bool]:
        """True per key stored (or already there)."""
        views = [as_bytes_view(v) for v in values]
        digests = buffer_digests(views)
        try:
            started: PutStart = self.master.call(
                "put_start",
                list(keys),
                [v.nbytes for v in views],
                owner,
                replicas,
                self.segment_id,
                pin_ttl_s,
                digests,
                timeout_s=PUT_TIMEOUT_S,
            )
        except MasterUnavailable as err:
            logger.warning("kv put of %d keys not stored: %s", len(keys), err)
            for _ in keys:
                self.metrics.put_failure()
            return [False] * len(keys)
        plans = started.plans
        to_write = [i for i, plan in enumerate(plans) if plan.status == "write"]
        written: list[bytes] = []
        failed: list[bytes] = []
        by_segment: dict[str, list[tuple[int, Location]]] = defaultdict(list)
        for i in to_write:
            for location in plans[i].locations:
                by_segment[location.segment_id].append((i, location))
        failed_indices: set[int] = set()
        for segment_id, items in by_segment.items():
            try:
                grant = started.grants[segment_id]
                self._write_segment(segment_id, [keys[i] for i, _ in items], items, views, owner, grant)
            except (TransportError, OSError, ValueError) as err:
                logger.warning("kv put to segment %s failed: %s", segment_id, err)
                failed_indices.update(i for i, _ in items)
        for i in to_write:
            (failed if i in failed_indices else written).append(keys[i])
        committed: dict[bytes, bool] = {}
        try:
            if failed:
                self.master.call("put_revoke", failed, timeout_s=PUT_TIMEOUT_S)
            if written:
                committed = dict(zip(written, self.master.call("put_end", written, timeout_s=PUT_TIMEOUT_S)))
        except MasterUnavailable as err:  # uncommitted puts are reclaimed after the master's put timeout
            logger.warning("kv put of %d keys not committed: %s", len(written), err)
        result = []
        for key, plan in zip(keys, plans):
            ok = plan.status == "exists" or committed.get(key, False)
            result.append(ok)
            if not ok:
                self.metrics.put_failure()
        return result

    def _write_segment(
        self,
        segment_id: str,
        keys: list[bytes],
        items: list[tuple[int, Location]],
        views: list[memoryview],
        tenant: str,
        grant: WriteGrant,
    ) -> None:
        if segment_id == self.segment_id:
            for key, (i, location) in zip(keys, items):
                self.segment.write(location.offset, views[i])
                self.held.record(key, tenant, location.offset, location.num_bytes)
            return
        peer = self._peers.get(segment_id)
        if peer is None or peer.ucx_address is None:
            raise TransportError(f"segment {segment_id} is unknown or has no UCX address")
        ranges = [(location.offset, location.num_bytes) for _, location in items]
        self._remote.write(peer.ucx_address, keys, ranges, [views[i] for i, _ in items], tenant, grant)
        self.metrics.bytes_out(sum(n for _, n in ranges))
