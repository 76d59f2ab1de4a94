"""Dedicated store nodes: actors whose only job is to contribute a large segment.

Workers keep their own pages in their own segments; when those run past the
high watermark, puts spill to store nodes before anything is evicted. The
cluster starts them (placed with Ray resources, e.g. on a store worker group).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ray

from .client import KVStoreClient
from .master import start_master
from .master_types import MasterConfig
from .settings import StoreMembership


class KVStoreNode:
    """Holds a ``KVStoreClient`` (and so a served segment) for as long as the actor lives."""

    def __init__(self, master_name: str, segment_bytes: int, namespace: str | None, options: Mapping[str, Any]) -> None:
        self.client = KVStoreClient.connect(master_name, segment_bytes, namespace=namespace, **options)

    def segment_id(self) -> str:
        return self.client.segment_id

    def held_objects(self) -> int:
        return len(self.client.held)

    def shutdown(self) -> None:
        self.client.close()


def start_store_nodes(
    master_name: str,
    count: int,
    segment_bytes: int,
    *,
    namespace: str | None = None,
    num_cpus: float = 0.1,
    resources: Mapping[str, float] | None = None,
    **client_options: Any,
) -> list[Any]:
    """Start ``count`` store-node actors and wait until their segments are registered."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    actor_cls: Any = ray.remote(KVStoreNode)
    nodes = [
        actor_cls.options(num_cpus=num_cpus, resources=dict(resources or {})).remote(
            master_name, segment_bytes, namespace, client_options
        )
        for _ in range(count)
    ]
    ray.get([node.segment_id.remote() for node in nodes])
    return nodes


def join_store(membership: StoreMembership, segment_bytes: int | None = None) -> KVStoreClient:
    """Start the store's master if nobody has yet, then join the store with a segment (of the configured
    size unless ``segment_bytes`` is given).

    Every worker calls this, so whichever starts first creates the (detached,
    restartable) master and the order in which pools start does not matter.
    """
    store = membership.store
    start_master(
        name=store.master_name,
        namespace=membership.namespace,
        snapshot_dir=store.snapshot_dir,
        snapshot_interval_s=store.snapshot_interval_s,
        config=MasterConfig(high_watermark=store.high_watermark, low_watermark=store.low_watermark),
    )
    return KVStoreClient.connect(
        master_name=store.master_name,
        segment_bytes=store.segment_bytes if segment_bytes is None else segment_bytes,
        tenant=membership.tenant,
        namespace=membership.namespace,
        transport=store.transport,
        ucx_port=store.ucx.port,
        ucx_config=store.ucx_config() or None,
    )


class StoreNodeReplica:
    """A store node as a Ray Serve deployment body: Serve keeps the configured count alive."""

    def __init__(self, membership: StoreMembership, segment_bytes: int) -> None:
        self.client = join_store(membership, segment_bytes)

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "segment_id": self.client.segment_id, "held_objects": len(self.client.held)}

    def __del__(self) -> None:
        # Serve calls this when it stops the replica: leave the store at once
        # and unlink the segment's shared memory.
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
