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


def join_store(settings: Mapping[str, Any], segment_bytes: int | None = None) -> KVStoreClient:
    """Start the store's master if nobody has yet, then join the store with a segment.

    ``settings``: ``{"master": start_master kwargs (name, namespace, snapshot_dir,
    high_watermark, low_watermark), "connect": KVStoreClient.connect kwargs}``.
    Every worker calls this, so whichever starts first creates the (detached,
    restartable) master and the order in which pools start does not matter.
    """
    master = dict(settings["master"])
    config = MasterConfig(
        high_watermark=master.pop("high_watermark", 0.9), low_watermark=master.pop("low_watermark", 0.8)
    )
    start_master(config=config, **master)
    connect = dict(settings["connect"])
    if segment_bytes is not None:
        connect["segment_bytes"] = segment_bytes
    return KVStoreClient.connect(**connect)


class StoreNodeReplica:
    """A store node as a Ray Serve deployment body: Serve keeps the configured count alive."""

    def __init__(self, settings: Mapping[str, Any], segment_bytes: int) -> None:
        self.client = join_store(settings, segment_bytes)

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "segment_id": self.client.segment_id, "held_objects": len(self.client.held)}

    def __del__(self) -> None:
        # Serve calls this when it stops the replica: leave the store at once
        # and unlink the segment's shared memory.
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
