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
``transport="ucx"`` forces UCX for everything not in the client's own segment
(``transports``); the read path itself is ``reader``'s.

A heartbeat thread keeps the segment registered; when the master's epoch
changes (it restarted), the client fetches the store secret again, registers
again and re-advertises what its segment holds (with each object's identity digest,
computed from the segment's bytes).

The store is a cache: while the master does not answer (it restarts in a few
seconds), a lookup or get gives up after ``master_timeout_s`` (a put after
``PUT_TIMEOUT_S``) and its keys count as misses (gets, lookups) or as not
stored (puts), instead of failing or waiting.

Every call acts for one tenant (the client's own unless ``tenant=`` names
another, as a server does for each call's tenant): puts store objects as
that tenant's, and reads and lookups see only that tenant's objects. Reads
and writes of other owners' segments carry the master's grants for exactly
their ranges (``access``).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import ray

from .access import SegmentGate
from .connection import (
    MASTER_TIMEOUT_S,
    MEMBERSHIP_TIMEOUT_S,
    TRANSFER_TIMEOUT_S,
    MasterConnection,
    MasterUnavailable,
    RayMaster,
    RemoteClient,
    RemoteServer,
    WriteCallback,
)
from .digest import page_digests
from .held_index import HeldIndex
from .master_types import check_keys
from .metrics import KVMetrics
from .peers import PeerDirectory
from .reader import LocatedPrefix, Reader
from .segment import Segment, cleanup_stale_segments
from .transports import TRANSPORTS
from .ucx_transport import UcxClient, UcxServer, init_ucx
from .writer import Writer

ServerFactory = Callable[[memoryview, WriteCallback, SegmentGate], RemoteServer]

logger = logging.getLogger(__name__)


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
            raise ValueError(f"transport must be one of {tuple(TRANSPORTS.names())}, got {transport!r}")
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
        self._remote: RemoteClient = remote_client or UcxClient(auth=master.auth, timeout_s=TRANSFER_TIMEOUT_S)
        self._peers = PeerDirectory(master)
        chosen = TRANSPORTS.create(transport, master, node_id)
        self._attached = chosen.attached  # other owners' segments mapped here: closed with the client
        self._reader = Reader(
            master, segment, self.segment_id, node_id, self._peers, chosen, self._remote, self.metrics
        )
        self._writer = Writer(master, segment, self.segment_id, self.held, self._peers, self._remote, self.metrics)
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
        ucx_host: str | None = None,
        ucx_port: int = 0,
        ucx_config: Mapping[str, str] | None = None,
        page_bytes: int | None = None,
        heartbeat_interval_s: float = 1.0,
        master_timeout_s: float = MASTER_TIMEOUT_S,
    ) -> KVStoreClient:
        """Join the store run by the named master (inside a Ray session), contributing a segment.

        ``ucx_host``/``ucx_port`` are where this worker's segment is served (host None: this
        node's Ray address, the one other nodes reach it at; port 0: any free one);
        ``ucx_config`` sets UCX options such as ``{"TLS": "rc,tcp,self", "NET_DEVICES":
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
        host = ray.util.get_node_ip_address() if ucx_host is None else ucx_host
        return cls(
            RayMaster(master, timeout_s=master_timeout_s),
            segment,
            tenant,
            node_id,
            transport=transport,
            page_bytes=page_bytes,
            heartbeat_interval_s=heartbeat_interval_s,
            server_factory=lambda buffer, on_write, gate: UcxServer(
                buffer, gate=gate, host=host, port=ucx_port, on_write=on_write, io_timeout_s=TRANSFER_TIMEOUT_S
            ),
        )

    # -- membership -------------------------------------------------------

    def _register(self, held: list[tuple[bytes, str, int, int, int]] | None = None) -> str:
        """Register the segment with what it ``held``; from then on its server takes only grants of the master's
        current run."""
        epoch: str = self.master.call(
            "register_segment",
            self.segment_id,
            self.node_id,
            self.segment.name,
            self.segment.capacity_bytes,
            self.ucx_address,
            self._page_bytes,
            held,
            timeout_s=MEMBERSHIP_TIMEOUT_S,
        )
        self.gate.epoch = epoch
        return epoch

    def _heartbeat_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.metrics.flush()
            try:
                epoch = self.master.call("heartbeat", self.segment_id, timeout_s=30)
                if epoch is None or epoch != self._epoch:  # master restarted, perhaps re-created
                    self.master.refresh_auth()
                    held = self._held_with_digests()
                    self._epoch = self._register(held)
                    logger.info("kv master restarted; re-advertised %d objects", len(held))
            except Exception as err:  # the master may be restarting: keep trying
                logger.debug("kv heartbeat failed: %s", err)

    def _held_with_digests(self) -> list[tuple[bytes, str, int, int, int]]:
        """What the segment holds, each with the identity digest of its bytes there (``HeldIndex`` keeps them its
        own)."""
        held = self.held.items()
        ranges = np.array([(offset, num_bytes) for _, _, offset, num_bytes in held], dtype=np.int64).reshape(-1, 2)
        digests = page_digests(self.segment.array.ctypes.data + ranges[:, 0], ranges[:, 1]).tolist()
        return [(*entry, digest) for entry, digest in zip(held, digests)]

    def _on_remote_write(self, keys: list[bytes], ranges: list[tuple[int, int]], tenant: str) -> None:
        for key, (offset, num_bytes) in zip(keys, ranges):
            self.held.record(key, tenant, offset, num_bytes)
        self.metrics.bytes_in(sum(n for _, n in ranges))

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
        check_keys(keys)
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        return self._writer.put(keys, values, replicas, pin_ttl_s, self._tenant(tenant))

    # -- gets -------------------------------------------------------------

    def get(self, key: bytes, tenant: str | None = None) -> bytes | None:
        return self.get_batch([key], tenant)[0]

    def get_batch(self, keys: Sequence[bytes], tenant: str | None = None) -> list[bytes | None]:
        """The values of ``tenant``'s objects (default: the client's); None for a miss."""
        check_keys(keys)
        return self._reader.get_batch(keys, self._tenant(tenant))

    def get_into(self, keys: Sequence[bytes], buffers: Any, tenant: str | None = None) -> list[bool]:
        """Land each of ``tenant``'s objects (default: the client's) in the caller's buffer; False for a miss.

        ``buffers``: one writable buffer per key (numpy arrays, CPU tensors,
        bytearrays), or one C-contiguous array or CPU tensor whose first
        dimension indexes the keys (row i receives key i; the cheapest form
        for large batches).
        """
        check_keys(keys)
        return self._reader.get_into(keys, buffers, self._tenant(tenant))

    def locate_prefix(self, keys: Sequence[bytes], tenant: str | None = None) -> LocatedPrefix:
        """How many leading keys are stored objects of ``tenant`` (``num_keys``), and where: what
        ``longest_prefix`` answers, with what ``get_into`` would then ask the master, in one call.

        Pass it to ``get_prefix_into`` to land (the start of) that prefix without asking again. A master that
        does not answer gives an empty prefix.
        """
        check_keys(keys)
        return self._reader.locate_prefix(keys, self._tenant(tenant))

    def get_prefix_into(self, prefix: LocatedPrefix, buffers: Any) -> list[bool]:
        """Land the first ``len(buffers)`` objects of ``prefix`` (at most ``prefix.num_keys``) in ``buffers``, as
        ``get_into`` would; the master is asked again only if the answer's read grants have run out."""
        return self._reader.get_prefix_into(prefix, buffers)

    # -- the rest ---------------------------------------------------------

    def exists(self, keys: Sequence[bytes], tenant: str | None = None) -> list[bool]:
        """Whether each key is a stored object of ``tenant`` (default: the client's)."""
        check_keys(keys)
        try:
            result: list[bool] = self.master.call("exists", list(keys), self._tenant(tenant))
        except MasterUnavailable as err:
            logger.warning("kv exists answered as misses: %s", err)
            return [False] * len(keys)
        return result

    def longest_prefix(self, keys: Sequence[bytes], tenant: str | None = None) -> int:
        """How many leading keys are stored objects of ``tenant`` (default: the client's)."""
        check_keys(keys)
        try:
            count: int = self.master.call("longest_prefix", list(keys), self._tenant(tenant))
        except MasterUnavailable as err:
            logger.warning("kv longest_prefix answered as a miss: %s", err)
            return 0
        return count

    def remove(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)
        removed: int = self.master.call("remove", list(keys))
        return removed

    def pin(self, keys: Sequence[bytes], ttl_s: float | None, tenant: str | None = None) -> None:
        """Keep ``tenant``'s objects (default: the client's) from eviction for ``ttl_s`` seconds (an earlier,
        longer pin stands; None: until ``unpin``); another tenant's keys are left as they are."""
        check_keys(keys)
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 or None, got {ttl_s}")
        self.master.call("pin", list(keys), ttl_s, self._tenant(tenant))

    def unpin(self, keys: Sequence[bytes]) -> None:
        check_keys(keys)
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

    def close(self, hand_off: Callable[[], object] | None = None) -> None:
        """Leave the store: stop serving, release the segment (its objects become misses).

        ``hand_off`` runs once the master has forgotten the segment and before
        this client stops: what it puts again lands on other segments, so
        objects worth keeping outlive this one (a retiring replica's sessions).
        """
        if self._stop.is_set():
            return
        self._stop.set()
        self._heartbeat.join(timeout=5)
        self.metrics.flush()
        try:
            self.master.call("drop_segment", self.segment_id, timeout_s=10)
        except Exception as err:
            logger.debug("kv drop_segment on close failed: %s", err)
        if hand_off is not None:
            try:
                hand_off()
            except Exception as err:  # leaving must not fail: what was not handed off is recomputed
                logger.warning("kv hand-off on close failed: %s", err)
        self._server.stop()
        self._remote.close()
        segments = [*self._attached.values(), self.segment]
        self._attached.clear()
        for segment in segments:
            try:
                segment.close()
            except BufferError as err:  # a caller still holds a view: unmapped when it is dropped
                logger.debug("kv segment close deferred: %s", err)
