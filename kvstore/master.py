"""The KV store master as a named, restartable Ray actor.

A thin shell over ``MasterState``: it serialises calls (an async actor runs
one method at a time on its event loop), ticks housekeeping, and snapshots to
``snapshot_dir`` so that a restart (Ray restarts it in place: the handle stays
valid) comes back with its keys. Owners then re-advertise what they hold.
It runs on the head node (``start_master``), which scaling never takes away.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import ray

from .access import StoreAuth, new_secret
from .master_lookup import LookupServer
from .master_state import MasterState
from .master_types import MasterConfig, PutStart
from .metrics import MasterMetrics

logger = logging.getLogger(__name__)

SNAPSHOT_FILE = "kv-master.snapshot"
HEAD_NODE_RESOURCE = "node:__internal_head__"  # the resource Ray gives its head node, and no other
TICK_INTERVAL_S = 0.25


class KVMaster:
    def __init__(
        self,
        config: MasterConfig | None = None,
        snapshot_dir: str | None = None,
        snapshot_interval_s: float = 2.0,
        secret: bytes | None = None,
    ) -> None:
        self.state = MasterState(config)
        # The store secret (``access``): given by ``start_master``, so a restart in place keeps it.
        self._secret = secret or new_secret()
        self.auth = StoreAuth(self._secret)
        self.snapshot_path = Path(snapshot_dir) / SNAPSHOT_FILE if snapshot_dir else None
        self.snapshot_interval_s = snapshot_interval_s
        if self.snapshot_path is not None and self.snapshot_path.exists():
            self.state.restore(msgpack.unpackb(self.snapshot_path.read_bytes(), raw=False))
            logger.info("kv master restored %d objects from %s", len(self.state.objects), self.snapshot_path)
        self._housekeeping: asyncio.Task[None] | None = None
        self._lookup: LookupServer | None = None
        self._lookup_start = asyncio.Lock()
        self._metrics = MasterMetrics()
        self._last_snapshot_s = time.monotonic()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(TICK_INTERVAL_S)
            self.state.tick()
            self._metrics.publish(self.state.stats())
            # Workers ask for snapshots in their idle windows (``snapshot_now``); this is the fallback.
            if self.snapshot_path is not None and time.monotonic() - self._last_snapshot_s >= self.snapshot_interval_s:
                self._write_snapshot()

    def _write_snapshot(self) -> None:
        assert self.snapshot_path is not None
        self.snapshot_path.parent.mkdir(parents=True, exist_ok=True)
        staging = self.snapshot_path.with_suffix(".tmp")
        staging.write_bytes(msgpack.packb(self.state.snapshot(), use_bin_type=True))
        os.replace(staging, self.snapshot_path)
        self._last_snapshot_s = time.monotonic()

    def _ensure_started(self) -> None:
        if self._housekeeping is None:
            self._housekeeping = asyncio.get_running_loop().create_task(self._loop())

    async def ready(self) -> str:
        self._ensure_started()
        return self.state.epoch

    async def register_segment(
        self,
        segment_id: str,
        node_id: str,
        shm_name: str,
        capacity_bytes: int,
        ucx_address: tuple[str, int] | None,
        page_bytes: int | None = None,
        held: list[tuple[bytes, str, int, int, int]] | None = None,
    ) -> str:
        """Take a segment in (again) and what it ``held`` (``advertise``), in one step: no put is placed on a
        re-registered segment before the master knows what it holds."""
        self._ensure_started()
        epoch = self.state.register_segment(segment_id, node_id, shm_name, capacity_bytes, ucx_address, page_bytes)
        if held:
            adopted = self.state.advertise(segment_id, held)
            logger.info("kv segment %s registered again; adopted %d of %d objects", segment_id, adopted, len(held))
        return epoch

    async def heartbeat(self, segment_id: str) -> str | None:
        self._ensure_started()
        return self.state.heartbeat(segment_id)

    async def advertise(self, segment_id: str, held: list[tuple[bytes, str, int, int]]) -> int:
        return self.state.advertise(segment_id, held)

    async def drop_segment(self, segment_id: str) -> None:
        self.state.drop_segment(segment_id)

    async def segment_directory(self) -> dict[str, dict[str, Any]]:
        return {sid: s.public() for sid, s in self.state.segments.items()}

    @property
    def secret(self) -> bytes:
        return self._secret

    async def store_secret(self) -> bytes:
        """The store secret, for members joining through Ray (the store's own sockets only carry proofs of it)."""
        return self._secret

    async def put_start(
        self,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        tenant: str,
        replicas: int = 1,
        preferred_segment_id: str | None = None,
        pin_ttl_s: float | None = None,
        digests: Sequence[int] | None = None,
    ) -> PutStart:
        """Placements for each key, and per segment a grant to write exactly those ranges (``access``)."""
        self._ensure_started()
        plans = self.state.put_start(keys, sizes, tenant, replicas, preferred_segment_id, pin_ttl_s, digests)
        entries: dict[str, list[tuple[bytes, int, int]]] = {}
        for key, plan in zip(keys, plans):
            for location in plan.locations:
                entries.setdefault(location.segment_id, []).append((key, location.offset, location.num_bytes))
        ttl_s = self.state.config.put_timeout_s / 2
        epoch = self.state.epoch
        grants = {
            segment_id: self.auth.write_grant(segment_id, epoch, tenant, placed, ttl_s)
            for segment_id, placed in entries.items()
        }
        return PutStart(plans, grants)

    async def put_end(self, keys: Sequence[bytes]) -> list[bool]:
        return self.state.put_end(keys)

    async def put_revoke(self, keys: Sequence[bytes]) -> None:
        self.state.put_revoke(keys)

    async def get_locations(self, keys: Sequence[bytes], reader_node_id: str | None, reader_tenant: str) -> list[Any]:
        self._ensure_started()
        return self._locations(keys, reader_node_id, reader_tenant)

    async def locate_prefix(self, keys: Sequence[bytes], reader_node_id: str | None, reader_tenant: str) -> list[Any]:
        self._ensure_started()
        return self._prefix_locations(keys, reader_node_id, reader_tenant)

    def _prefix_locations(self, keys: Sequence[bytes], reader_node_id: str | None, reader_tenant: str) -> list[Any]:
        """``get_locations`` of the leading keys ``longest_prefix`` counts: the answer has a row per key of that
        prefix and no more, so a reader that loads a prefix asks the master once, not how much and then where."""
        count = self.state.longest_prefix(keys, reader_tenant)
        return self._locations(keys[:count], reader_node_id, reader_tenant)

    def _locations(self, keys: Sequence[bytes], reader_node_id: str | None, reader_tenant: str) -> list[Any]:
        """Replica locations, compact for batches of a thousand keys: ``[segment ids, best, more, grants,
        digests]``.

        ``segment ids`` is a table the rest indexes; ``best`` packs the best
        replica of every key as int64 rows ``(segment index, offset,
        num_bytes)`` in bytes (segment index -1 for a miss); ``more`` lists,
        for keys with further replicas, ``[key index, segment index, offset,
        num_bytes, ...]``; ``grants`` holds, per segment id, the read grant
        (``access.ReadGrant`` on the wire) for every range listed on it;
        ``digests`` packs every key's identity digest as int64 in bytes (-1 for a
        miss, or an object whose digest is not known).
        Bytes and few objects cross Ray, or a socket, several times faster
        than a list per key.
        """
        table: dict[str, int] = {}
        best: list[int] = []
        more: list[list[int]] = []
        granted: list[list[int]] = []  # per segment index: offset, num_bytes, ...
        digests = array("q", (-1,)) * len(keys)  # int64 (as ``best``): for a call's few keys, cheaper than numpy
        objects = self.state.objects
        for i, replicas in enumerate(self.state.leased_replicas(keys, reader_node_id, reader_tenant)):
            if replicas is None:
                best += (-1, -1, -1)
                continue
            digest = objects[keys[i]].digest
            if digest is not None:
                digests[i] = digest
            segment_id, offset, num_bytes = replicas[0]
            index = table.setdefault(segment_id, len(table))
            best += (index, offset, num_bytes)
            _grant_range(granted, index, offset, num_bytes)
            if len(replicas) > 1:
                entry = [i]
                for segment_id, offset, num_bytes in replicas[1:]:
                    index = table.setdefault(segment_id, len(table))
                    entry += (index, offset, num_bytes)
                    _grant_range(granted, index, offset, num_bytes)
                more.append(entry)
        ttl_s = self.state.config.lease_ttl_s / 2
        epoch = self.state.epoch
        grants = [
            self.auth.read_grant(segment_id, epoch, np.array(granted[index], dtype=np.int64), ttl_s).to_wire()
            for segment_id, index in table.items()
        ]
        return [list(table), array("q", best).tobytes(), more, grants, digests.tobytes()]

    async def lookup_address(self) -> tuple[str, int] | None:
        """Where the lookup socket listens (started on first ask); None if it cannot listen."""
        self._ensure_started()
        async with self._lookup_start:  # concurrent first askers: one server
            if self._lookup is None:
                server = LookupServer(self._answer_lookup, self.auth)
                try:
                    await server.start(ray.util.get_node_ip_address())
                except OSError as err:
                    logger.warning("kv master lookup socket unavailable, lookups go through Ray: %s", err)
                    return None
                self._lookup = server
        return self._lookup.address

    def _answer_lookup(self, method: str, keys: list[bytes], node_id: str | None, tenant: str) -> Any:
        self._ensure_started()
        if method == "get_locations":
            return self._locations(keys, node_id, tenant)
        if method == "locate_prefix":
            return self._prefix_locations(keys, node_id, tenant)
        if method == "exists":
            return self.state.exists(keys, tenant)
        return self.state.longest_prefix(keys, tenant)

    async def exists(self, keys: Sequence[bytes], tenant: str) -> list[bool]:
        return self.state.exists(keys, tenant)

    async def longest_prefix(self, keys: Sequence[bytes], tenant: str) -> int:
        return self.state.longest_prefix(keys, tenant)

    async def remove(self, keys: Sequence[bytes]) -> int:
        return self.state.remove(keys)

    async def pin(self, keys: Sequence[bytes], ttl_s: float | None, tenant: str | None = None) -> None:
        self.state.pin(keys, ttl_s, tenant)

    async def unpin(self, keys: Sequence[bytes]) -> None:
        self.state.unpin(keys)

    async def stats(self) -> dict[str, Any]:
        return self.state.stats()

    async def snapshot_now(self, min_interval_s: float = 0.0) -> bool:
        """Write a snapshot unless one was written within ``min_interval_s``; returns whether it wrote."""
        if self.snapshot_path is None or time.monotonic() - self._last_snapshot_s < min_interval_s:
            return False
        self._write_snapshot()
        return True


def _grant_range(granted: list[list[int]], index: int, offset: int, num_bytes: int) -> None:
    if index == len(granted):
        granted.append([])
    granted[index] += (offset, num_bytes)


def start_master(
    name: str = "rayturn-kv",
    snapshot_dir: str | None = None,
    config: MasterConfig | None = None,
    namespace: str | None = None,
    snapshot_interval_s: float = 2.0,
) -> Any:
    """Start (or find) the named master actor inside the current Ray session; returns its handle."""
    actor_cls: Any = ray.remote(KVMaster)
    options = actor_cls.options(
        name=name,
        namespace=namespace,
        get_if_exists=True,
        lifetime="detached",
        max_restarts=-1,
        max_task_retries=-1,
        num_cpus=0,
        resources=_on_head_node(),
        max_concurrency=1000,
        # Every call would leave a task event in the GCS (kept up to Ray's task_events_max_num_task_in_gcs,
        # 100k by default): the master answers several calls per request. Serve leaves them off for its actors.
        enable_task_events=False,
    )
    # The secret only counts when this call creates the master; Ray keeps it for the master's restarts.
    handle = options.remote(config, snapshot_dir, snapshot_interval_s, new_secret())
    ray.get(handle.ready.remote())
    return handle


def _on_head_node() -> dict[str, float]:
    """Where the master runs: on the head node, which an autoscaler never removes. Elsewhere it would keep
    the worker node it landed on (that of the first replica to start) from ever going idle.

    A sliver of the head's own resource rather than a node-affinity strategy: a raylet that has not yet
    heard of the head (a worker node that just joined) would place a soft affinity elsewhere at once and
    fail a hard one, while a resource request waits until some node offers it. A cluster whose head Ray
    cannot see gets a master anywhere.
    """
    for node in ray.nodes():
        if node["Alive"] and HEAD_NODE_RESOURCE in node["Resources"]:
            return {HEAD_NODE_RESOURCE: 0.001}
    return {}
