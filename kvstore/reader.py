"""A client's read path: ask the master where a batch's objects are, then land each from its nearest replica.

The master answers with every replica of every object, best first (see
``KVMaster.get_locations``), and a read grant per segment. Each object is
tried at its replicas in order: the client's own segment, a same-node
segment the transport maps from shared memory, or over UCX. A segment whose
owner cannot be reached is left alone for ``UNREACHABLE_REST_S``.

What lands is checked against the object's identity digest
(``digest.page_digests``, one batch per get), which its writer computed and
the master keeps: bytes that are not the object's (an offset reused while
the master's metadata was stale, a read that outlived its lease) read as a
miss, never as the page. A master that does not answer
within its timeout makes the whole batch a miss (``MasterUnavailable``).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .access import ReadGrant
from .connection import MasterConnection, MasterUnavailable, RemoteClient
from .digest import page_digests
from .landing import Targets, copy_out
from .metrics import KVMetrics
from .peers import PeerDirectory
from .segment import Segment
from .transports import Transport
from .ucx_transport import PeerTimedOut, PeerUnreachable, TransportError

logger = logging.getLogger(__name__)

# A segment whose owner could not be reached, or did not answer in time, is not asked again for this long
# (the master drops a silent owner's segment within its heartbeat timeout): each try would cost a timeout.
UNREACHABLE_REST_S = 10.0


class Reader:
    def __init__(
        self,
        master: MasterConnection,
        segment: Segment,
        segment_id: str,
        node_id: str,
        peers: PeerDirectory,
        transport: Transport,
        remote: RemoteClient,
        metrics: KVMetrics,
    ) -> None:
        self._master = master
        self._segment = segment
        self._segment_id = segment_id
        self._node_id = node_id
        self._peers = peers
        self._transport = transport
        self._remote = remote
        self._metrics = metrics
        self._unreachable: dict[str, float] = {}  # segment id -> monotonic time to try it again

    def get_batch(self, keys: Sequence[bytes], tenant: str) -> list[bytes | None]:
        """The values of ``tenant``'s objects; None for a miss."""
        try:
            located = self._locate(keys, tenant)
        except MasterUnavailable as err:
            logger.warning("kv get of %d keys answered as misses: %s", len(keys), err)
            return [None] * len(keys)
        buffers = [np.empty(max(size, 0), dtype=np.uint8) for size in located.best[:, 2].tolist()]
        landed = self._read(keys, tenant, located, Targets(buffers, len(keys)))
        return [buf.tobytes() if ok else None for buf, ok in zip(buffers, landed)]

    def get_into(self, keys: Sequence[bytes], buffers: Any, tenant: str) -> list[bool]:
        """Land each of ``tenant``'s objects in the caller's buffer (``KVStoreClient.get_into``); False for a miss."""
        targets = Targets(buffers, len(keys))
        try:
            located = self._locate(keys, tenant)
        except MasterUnavailable as err:
            logger.warning("kv get of %d keys answered as misses: %s", len(keys), err)
            return [False] * len(keys)
        _check_sizes(keys, located, targets)
        return self._read(keys, tenant, located, targets)

    def locate_prefix(self, keys: Sequence[bytes], tenant: str) -> LocatedPrefix:
        """The leading keys that are ``tenant``'s objects, and where they are: one master call (``KVStoreClient``)."""
        if not keys:
            return LocatedPrefix([], tenant, None)
        try:
            located = self._located(self._master.call("locate_prefix", list(keys), self._node_id, tenant))
        except MasterUnavailable as err:
            logger.warning("kv locate_prefix answered as a miss: %s", err)
            return LocatedPrefix([], tenant, None)
        return LocatedPrefix(list(keys[: len(located.best)]), tenant, located)

    def get_prefix_into(self, prefix: LocatedPrefix, buffers: Any) -> list[bool]:
        """Land the first ``len(buffers)`` objects of a located prefix in ``buffers``, as ``get_into`` does, with no
        further master call unless the grants have run out."""
        count = len(buffers)
        if count > len(prefix.keys):
            raise ValueError(f"{count} buffers for a located prefix of {len(prefix.keys)} objects")
        targets = Targets(buffers, count)
        if prefix.located is None or not count:
            return [False] * count
        keys, located = prefix.keys[:count], prefix.located.head(count)
        _check_sizes(keys, located, targets)
        return self._read(keys, prefix.tenant, located, targets)

    def _locate(self, keys: Sequence[bytes], tenant: str) -> _Located:
        return self._located(self._master.call("get_locations", list(keys), self._node_id, tenant))

    @staticmethod
    def _located(answer: list[Any]) -> _Located:
        segment_ids, best, more, grants, digests = answer
        rows = np.frombuffer(best, dtype=np.int64).reshape(-1, 3)
        read_grants = [ReadGrant.from_wire(grant) for grant in grants]
        more_replicas = {entry[0]: entry[1:] for entry in more}
        return _Located(segment_ids, rows, more_replicas, read_grants, np.frombuffer(digests, dtype=np.int64))

    def _read(self, keys: Sequence[bytes], tenant: str, located: _Located, targets: Targets) -> list[bool]:
        """Land every object the master located; asks once more, for what is left, when the attempts outlived
        the grants (a dead owner costs a connect timeout), so the other replicas are read under fresh ones."""
        done = np.zeros(len(keys), dtype=bool)
        self._read_replicas(located, targets, done)
        if not done.all() and located.expired() and (located.best[~done, 0] >= 0).any():
            try:
                located = self._locate(keys, tenant)
            except MasterUnavailable as err:
                logger.warning("kv get: no fresh grants for the rest of the batch: %s", err)
            else:
                self._read_replicas(located, targets, done)
        self._check_digests(keys, located, targets, done)
        return done.tolist()

    def _check_digests(self, keys: Sequence[bytes], located: _Located, targets: Targets, done: np.ndarray) -> None:
        """Turn every landed object whose bytes do not match its digest into a miss."""
        checked = np.flatnonzero(done & (located.digests >= 0))
        if not checked.size:
            return
        landed = page_digests(targets.addresses[checked], targets.sizes[checked])
        for i in checked[landed != located.digests[checked]].tolist():
            done[i] = False
            self._metrics.wrong_page()
            logger.warning("kv read of %s landed bytes that are not its own: read as a miss", keys[i].hex()[:16])

    def _read_replicas(self, located: _Located, targets: Targets, done: np.ndarray) -> None:
        """Try each object not ``done`` at its replicas in order until one read lands; one batch per segment and
        attempt.

        The first attempt (every key's best replica) is grouped and
        coalesced with numpy, so a thousand-page batch costs a few
        Python-level steps, not a thousand.
        """
        best = located.best
        segments = np.where(done, -1, best[:, 0])
        for segment_index in np.unique(segments[segments >= 0]).tolist():
            indices = np.flatnonzero(segments == segment_index)
            if self._read_segment(located, segment_index, best[indices, 1:], indices, targets):
                done[indices] = True
        column = 0  # where the attempt's replica sits in ``located.more`` entries
        while True:
            by_segment: dict[int, list[int]] = defaultdict(list)
            for i, entry in located.more.items():
                if not done[i] and column < len(entry):
                    by_segment[entry[column]].append(i)
            if not by_segment:
                return
            for segment_index, retry in by_segment.items():
                ranges = np.array([located.more[i][column + 1 : column + 3] for i in retry], dtype=np.int64)
                indices = np.array(retry, dtype=np.int64)
                if self._read_segment(located, segment_index, ranges, indices, targets):
                    done[indices] = True
            column += 3

    def _read_segment(
        self, located: _Located, segment_index: int, ranges: np.ndarray, indices: np.ndarray, targets: Targets
    ) -> bool:
        """Land ``ranges`` ([n, 2] offset, num_bytes) of one segment in the targets ``indices``.

        False if that segment cannot serve them.
        """
        segment_id = located.segment_ids[segment_index]
        num_bytes = int(ranges[:, 1].sum())
        if self._unreachable.get(segment_id, 0.0) > time.monotonic():
            return False
        try:
            if not np.array_equal(ranges[:, 1], targets.sizes[indices]):
                raise ValueError("a replica's size differs from its buffer's")
            if segment_id == self._segment_id:
                copy_out(self._segment, ranges, targets.addresses[indices])
                self._metrics.pages_read("host", len(indices))
                return True
            peer = self._peers.get(segment_id)
            if peer is None:
                return False
            shared = self._transport.shared_segment(segment_id, peer)
            if shared is not None:
                copy_out(shared, ranges, targets.addresses[indices])
                self._metrics.bytes_in(num_bytes)
                self._metrics.pages_read("node", len(indices))
                return True
            if peer.ucx_address is None:
                return False
            pairs = [(offset, size) for offset, size in ranges.tolist()]
            grant = located.grants[segment_index]
            self._remote.read(peer.ucx_address, pairs, [targets.array(i) for i in indices.tolist()], grant)
            self._metrics.bytes_in(num_bytes)
            self._metrics.pages_read("remote", len(indices))
            return True
        except (PeerUnreachable, PeerTimedOut) as err:
            logger.warning(
                "kv read from segment %s failed, not asking it for %.0f s: %s", segment_id, UNREACHABLE_REST_S, err
            )
            now_s = time.monotonic()
            self._unreachable = {sid: until_s for sid, until_s in self._unreachable.items() if until_s > now_s}
            self._unreachable[segment_id] = now_s + UNREACHABLE_REST_S
            return False
        except (TransportError, OSError, ValueError) as err:
            logger.warning("kv read from segment %s failed: %s", segment_id, err)
            return False


def _check_sizes(keys: Sequence[bytes], located: _Located, targets: Targets) -> None:
    """ValueError naming the first located object whose buffer is not its size (a miss has no size to match)."""
    best = located.best
    wrong = np.flatnonzero((best[:, 0] >= 0) & (best[:, 2] != targets.sizes))
    if wrong.size:
        i = int(wrong[0])
        raise ValueError(f"buffer {i} has {targets.sizes[i]} bytes; object {keys[i].hex()[:16]} has {best[i, 2]}")


@dataclass(frozen=True, slots=True)
class _Located:
    """The master's answer for a batch: see ``KVMaster.get_locations``."""

    segment_ids: list[str]
    best: np.ndarray  # [n, 3] int64: segment index (-1: miss), offset, num_bytes
    more: dict[int, list[int]]  # key index -> further replicas, flat triples
    grants: list[ReadGrant]  # per segment index: the read grant for its ranges
    digests: np.ndarray  # [n] int64: each object's identity digest (-1: not known)

    def expired(self) -> bool:
        """Whether a grant of this answer has run out (its leases are then about to)."""
        return any(grant.expires_at < time.time() for grant in self.grants)

    def head(self, count: int) -> _Located:
        """The answer for the first ``count`` keys only (the grants cover them as they covered all)."""
        if count == len(self.best):
            return self
        more = {i: entry for i, entry in self.more.items() if i < count}
        return _Located(self.segment_ids, self.best[:count], more, self.grants, self.digests[:count])


@dataclass(frozen=True, slots=True)
class LocatedPrefix:
    """The leading keys of a lookup that are stored objects of ``tenant``, with the master's answer for them
    (``KVStoreClient.locate_prefix``); ``located`` is None when the master did not answer (no keys then)."""

    keys: list[bytes]
    tenant: str
    located: _Located | None

    @property
    def num_keys(self) -> int:
        return len(self.keys)
