"""The KV store client: a worker's segment, its UCX server, and the API.

    client = KVStoreClient.connect(master_name="rayturn-kv", segment_bytes=256 << 20, tenant="default")
    client.put_batch(keys, values, replicas=1, pin_ttl_s=None)
    client.get_into(keys, buffers)

Connecting contributes a segment (POSIX shared memory) and serves it over
UCX. A put asks the master for placements (two-phase), writes the bytes —
into its own segment directly, into another owner's through that owner's UCX
server (so owners see every write to their memory) — and commits. A get asks
for replica locations under a read lease and reads from the nearest: its own
segment, a same-node segment straight out of shared memory, or over UCX.
``transport="ucx"`` forces UCX for everything not in the client's own segment.

A heartbeat thread keeps the segment registered; when the master's epoch
changes (it restarted), the client fetches the store secret again, registers
again and re-advertises what its segment holds.

Every call acts for one tenant (the client's own unless ``tenant=`` names
another, as a server does for each call's tenant): puts store objects as
that tenant's, and reads and lookups see only that tenant's objects. Reads
and writes of other owners' segments carry the master's grants for exactly
their ranges (``access``).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from .access import ReadGrant, SegmentGate, WriteGrant
from .connection import MasterConnection, RayMaster, RemoteClient, RemoteServer, WriteCallback
from .held_index import HeldIndex
from .landing import Targets, copy_out
from .master_state import Location, parse_address
from .master_types import PutStart
from .metrics import KVMetrics
from .segment import Segment, as_bytes_view, cleanup_stale_segments, owner_alive
from .ucx_transport import PeerUnreachable, TransportError, UcxClient, UcxServer, init_ucx

ServerFactory = Callable[[memoryview, WriteCallback, SegmentGate], RemoteServer]

logger = logging.getLogger(__name__)

TRANSPORTS = ("auto", "ucx")
# A segment whose owner could not be reached is not asked again for this long (the master drops a
# silent owner's segment within its heartbeat timeout): each try would cost a connect timeout.
UNREACHABLE_REST_S = 10.0


@dataclass(frozen=True, slots=True)
class _Peer:
    node_id: str
    shm_name: str
    ucx_address: tuple[str, int] | None


class KVStoreClient:
    def __init__(
        self,
        master: MasterConnection,
        segment: Segment,
        tenant: str,
        node_id: str,
        *,
        transport: str = "auto",
        page_bytes: int | None = None,
        heartbeat_interval_s: float = 1.0,
        server_factory: ServerFactory | None = None,
        remote_client: RemoteClient | None = None,
    ) -> None:
        """Production callers use ``connect``; the factories exist so unit tests can run in one process."""
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.master = master
        self.segment = segment
        self.tenant = tenant
        self.node_id = node_id
        self.transport = transport
        self.segment_id = f"{node_id[:12]}-{uuid.uuid4().hex[:12]}"
        self.held = HeldIndex()
        self.metrics = KVMetrics(self.segment_id, tenant)
        make_server = server_factory or (lambda buffer, on_write, gate: UcxServer(buffer, gate=gate, on_write=on_write))
        self.gate = SegmentGate(master.auth, self.segment_id)  # its epoch is set when the segment registers
        self._server = make_server(segment.buffer, self._on_remote_write, self.gate)
        self.ucx_address = self._server.start()
        self._remote: RemoteClient = remote_client or UcxClient(auth=master.auth)
        self._peers: dict[str, _Peer] = {}
        self._unreachable: dict[str, float] = {}  # segment id -> monotonic time to try it again
        self._attached: dict[str, Segment] = {}
        self._page_bytes = page_bytes
        self._epoch = self._register()
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(
            target=self._heartbeat_loop, args=(heartbeat_interval_s,), name="kv-heartbeat", daemon=True
        )
        self._heartbeat.start()

    @classmethod
    def connect(
        cls,
        master_name: str = "rayturn-kv",
        segment_bytes: int = 256 << 20,
        tenant: str = "default",
        *,
        namespace: str | None = None,
        transport: str = "auto",
        ucx_host: str = "127.0.0.1",
        ucx_port: int = 0,
        ucx_config: Mapping[str, str] | None = None,
        page_bytes: int | None = None,
        heartbeat_interval_s: float = 1.0,
    ) -> KVStoreClient:
        """Join the store run by the named master (inside a Ray session), contributing a segment.

        ``ucx_host``/``ucx_port`` are where this worker's segment is served (port 0: any free
        one); ``ucx_config`` sets UCX options such as ``{"TLS": "rc,tcp,self", "NET_DEVICES":
        "mlx5_0:1"}`` and must come before this process first uses UCX.
        """
        if segment_bytes <= 0:
            raise ValueError(f"segment_bytes must be > 0, got {segment_bytes}")
        if ucx_config:
            init_ucx(ucx_config)
        master = ray.get_actor(master_name, namespace=namespace)
        removed = cleanup_stale_segments()
        if removed:
            logger.info("removed %d stale KV segments left by dead processes", len(removed))
        segment = Segment.create(segment_bytes)
        node_id = ray.get_runtime_context().get_node_id()
        return cls(
            RayMaster(master),
            segment,
            tenant,
            node_id,
            transport=transport,
            page_bytes=page_bytes,
            heartbeat_interval_s=heartbeat_interval_s,
            server_factory=lambda buffer, on_write, gate: UcxServer(
                buffer, gate=gate, host=ucx_host, port=ucx_port, on_write=on_write
            ),
        )

    # -- membership -------------------------------------------------------

    def _register(self) -> str:
        """Register the segment; from then on its server takes only grants of the master's current run."""
        epoch: str = self.master.call(
            "register_segment",
            self.segment_id,
            self.node_id,
            self.segment.name,
            self.segment.capacity_bytes,
            self.ucx_address,
            self._page_bytes,
        )
        self.gate.epoch = epoch
        return epoch

    def _heartbeat_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                epoch = self.master.call("heartbeat", self.segment_id, timeout_s=30)
                if epoch is None or epoch != self._epoch:  # master restarted, perhaps re-created
                    self.master.refresh_auth()
                    self._epoch = self._register()
                    adopted = self.master.call("advertise", self.segment_id, self.held.items())
                    logger.info("kv master restarted; re-advertised %d objects", adopted)
            except Exception as err:  # the master may be restarting: keep trying
                logger.debug("kv heartbeat failed: %s", err)

    def _on_remote_write(self, keys: list[bytes], ranges: list[tuple[int, int]], tenant: str) -> None:
        for key, (offset, num_bytes) in zip(keys, ranges):
            self.held.record(key, tenant, offset, num_bytes)
        self.metrics.bytes_in(sum(n for _, n in ranges))

    def _peer(self, segment_id: str) -> _Peer | None:
        if segment_id not in self._peers:
            directory = self.master.call("segment_directory")
            for sid, info in directory.items():
                self._peers[sid] = _Peer(info["node_id"], info["shm_name"], parse_address(info["ucx_address"]))
        return self._peers.get(segment_id)

    def _tenant(self, tenant: str | None) -> str:
        """The tenant a call acts for: the one it names, else (None or "") the client's own."""
        return tenant or self.tenant

    # -- puts -------------------------------------------------------------

    def put(self, key: bytes, value: Any, tenant: str | None = None) -> bool:
        return self.put_batch([key], [value], tenant=tenant)[0]

    def put_batch(
        self,
        keys: Sequence[bytes],
        values: Sequence[Any],
        replicas: int = 1,
        pin_ttl_s: float | None = None,
        tenant: str | None = None,
    ) -> list[bool]:
        """Store values (bytes-like, numpy or CPU tensors) as ``tenant``'s (default: the client's); True per
        key stored (or already there)."""
        _check_keys(keys)
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        owner = self._tenant(tenant)
        views = [as_bytes_view(v) for v in values]
        started: PutStart = self.master.call(
            "put_start", list(keys), [v.nbytes for v in views], owner, replicas, self.segment_id, pin_ttl_s
        )
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
        if failed:
            self.master.call("put_revoke", failed)
        committed = dict(zip(written, self.master.call("put_end", written))) if written else {}
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
        peer = self._peer(segment_id)
        if peer is None or peer.ucx_address is None:
            raise TransportError(f"segment {segment_id} is unknown or has no UCX address")
        ranges = [(location.offset, location.num_bytes) for _, location in items]
        self._remote.write(peer.ucx_address, keys, ranges, [views[i] for i, _ in items], tenant, grant)
        self.metrics.bytes_out(sum(n for _, n in ranges))

    # -- gets -------------------------------------------------------------

    def get(self, key: bytes, tenant: str | None = None) -> bytes | None:
        return self.get_batch([key], tenant)[0]

    def get_batch(self, keys: Sequence[bytes], tenant: str | None = None) -> list[bytes | None]:
        """The values of ``tenant``'s objects (default: the client's); None for a miss."""
        _check_keys(keys)
        located = self._locate(keys, tenant)
        buffers = [np.empty(max(size, 0), dtype=np.uint8) for size in located.best[:, 2].tolist()]
        landed = self._read(keys, tenant, located, Targets(buffers, len(keys)))
        return [buf.tobytes() if ok else None for buf, ok in zip(buffers, landed)]

    def get_into(self, keys: Sequence[bytes], buffers: Any, tenant: str | None = None) -> list[bool]:
        """Land each of ``tenant``'s objects (default: the client's) in the caller's buffer; False for a miss.

        ``buffers``: one writable buffer per key (numpy arrays, CPU tensors,
        bytearrays), or one C-contiguous array or CPU tensor whose first
        dimension indexes the keys (row i receives key i; the cheapest form
        for large batches).
        """
        _check_keys(keys)
        targets = Targets(buffers, len(keys))
        located = self._locate(keys, tenant)
        best = located.best
        wrong = np.flatnonzero((best[:, 0] >= 0) & (best[:, 2] != targets.sizes))
        if wrong.size:
            i = int(wrong[0])
            raise ValueError(f"buffer {i} has {targets.sizes[i]} bytes; object {keys[i].hex()[:16]} has {best[i, 2]}")
        return self._read(keys, tenant, located, targets)

    def _locate(self, keys: Sequence[bytes], tenant: str | None) -> _Located:
        segment_ids, best, more, grants = self.master.call(
            "get_locations", list(keys), self.node_id, self._tenant(tenant)
        )
        rows = np.frombuffer(best, dtype=np.int64).reshape(len(keys), 3)
        read_grants = [ReadGrant.from_wire(grant) for grant in grants]
        return _Located(segment_ids, rows, {entry[0]: entry[1:] for entry in more}, read_grants)

    def _read(self, keys: Sequence[bytes], tenant: str | None, located: _Located, targets: Targets) -> list[bool]:
        """Land every object the master located; asks once more, for what is left, when the attempts outlived
        the grants (a dead owner costs a connect timeout), so the other replicas are read under fresh ones."""
        done = np.zeros(len(keys), dtype=bool)
        self._read_replicas(located, targets, done)
        if not done.all() and located.expired() and (located.best[~done, 0] >= 0).any():
            self._read_replicas(self._locate(keys, tenant), targets, done)
        return done.tolist()

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
            if segment_id == self.segment_id:
                copy_out(self.segment, ranges, targets.addresses[indices])
                return True
            peer = self._peer(segment_id)
            if peer is None:
                return False
            if self.transport == "auto" and peer.node_id == self.node_id:
                shared = self._attach(segment_id, peer)
                if shared is not None:
                    copy_out(shared, ranges, targets.addresses[indices])
                    self.metrics.bytes_in(num_bytes)
                    return True
            if peer.ucx_address is None:
                return False
            pairs = [(offset, size) for offset, size in ranges.tolist()]
            grant = located.grants[segment_index]
            self._remote.read(peer.ucx_address, pairs, [targets.array(i) for i in indices.tolist()], grant)
            self.metrics.bytes_in(num_bytes)
            return True
        except PeerUnreachable as err:
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

    def _attach(self, segment_id: str, peer: _Peer) -> Segment | None:
        """The peer's shared memory, if its owner process is alive (a dead owner's pages are lost)."""
        if not owner_alive(peer.shm_name):
            self._attached.pop(segment_id, None)
            self.master.notify("drop_segment", segment_id)
            return None
        if segment_id not in self._attached:
            self._attached[segment_id] = Segment.attach(peer.shm_name)
        return self._attached[segment_id]

    # -- the rest ---------------------------------------------------------

    def exists(self, keys: Sequence[bytes], tenant: str | None = None) -> list[bool]:
        """Whether each key is a stored object of ``tenant`` (default: the client's)."""
        _check_keys(keys)
        result: list[bool] = self.master.call("exists", list(keys), self._tenant(tenant))
        return result

    def longest_prefix(self, keys: Sequence[bytes], tenant: str | None = None) -> int:
        """How many leading keys are stored objects of ``tenant`` (default: the client's)."""
        _check_keys(keys)
        count: int = self.master.call("longest_prefix", list(keys), self._tenant(tenant))
        return count

    def remove(self, keys: Sequence[bytes]) -> int:
        _check_keys(keys)
        removed: int = self.master.call("remove", list(keys))
        return removed

    def pin(self, keys: Sequence[bytes], ttl_s: float | None) -> None:
        """Keep objects from eviction for ``ttl_s`` seconds (None: until ``unpin``)."""
        _check_keys(keys)
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 or None, got {ttl_s}")
        self.master.call("pin", list(keys), ttl_s)

    def unpin(self, keys: Sequence[bytes]) -> None:
        _check_keys(keys)
        self.master.call("unpin", list(keys))

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = self.master.call("stats")
        stats["client"] = {
            "segment_id": self.segment_id,
            "held_objects": len(self.held),
            "ucx_address": list(self.ucx_address),
            **self.metrics.totals(),
        }
        return stats

    def close(self) -> None:
        """Leave the store: stop serving, release the segment (its objects become misses)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._heartbeat.join(timeout=5)
        try:
            self.master.call("drop_segment", self.segment_id, timeout_s=10)
        except Exception as err:
            logger.debug("kv drop_segment on close failed: %s", err)
        self._server.stop()
        self._remote.close()
        segments = [*self._attached.values(), self.segment]
        self._attached.clear()
        for segment in segments:
            try:
                segment.close()
            except BufferError as err:  # a caller still holds a view: unmapped when it is dropped
                logger.debug("kv segment close deferred: %s", err)


@dataclass(frozen=True, slots=True)
class _Located:
    """The master's answer for a batch: see ``KVMaster.get_locations``."""

    segment_ids: list[str]
    best: np.ndarray  # [n, 3] int64: segment index (-1: miss), offset, num_bytes
    more: dict[int, list[int]]  # key index -> further replicas, flat triples
    grants: list[ReadGrant]  # per segment index: the read grant for its ranges

    def expired(self) -> bool:
        """Whether a grant of this answer has run out (its leases are then about to)."""
        return any(grant.expires_at < time.time() for grant in self.grants)


def _check_keys(keys: Sequence[bytes]) -> None:
    for i, key in enumerate(keys):
        if not isinstance(key, bytes) or not key:
            raise ValueError(f"key {i} must be non-empty bytes, got {type(key).__name__}")
