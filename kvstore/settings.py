"""The KV store's settings (the ``kvstore`` section of the cluster config).

Importing this module imports neither Ray nor UCX, so a config file is checked without starting either.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rayturn.settings import (
    check,
    check_above,
    check_at_least,
    check_choice,
    check_non_empty,
    check_port,
    check_resources,
    frozen_mapping,
)

from .transports import TRANSPORTS


@dataclass(frozen=True, slots=True)
class UCXSettings:
    """UCX options for the store's transfers (``kvstore.ucx``); unset ones keep UCX's own defaults."""

    tls: str | None = None
    net_devices: str | None = None
    port: int = 0

    def __post_init__(self) -> None:
        check_non_empty("tls", self.tls)
        check_non_empty("net_devices", self.net_devices)
        check_port("port", self.port)


@dataclass(frozen=True, slots=True)
class KVStoreSettings:
    """The ``kvstore`` section: the master, every worker's segment, store nodes, eviction, snapshots."""

    enabled: bool = True
    master_name: str = "rayturn-kv"
    segment_bytes: int = field(default=256 << 20, metadata={"size": True})
    store_nodes: int = 0
    store_node_bytes: int = field(default=1 << 30, metadata={"size": True})
    store_node_num_cpus: float = 0.1
    store_node_resources: Mapping[str, float] = field(default_factory=dict, hash=False)
    replicas: int = 1
    high_watermark: float = 0.90
    low_watermark: float = 0.80
    snapshot_dir: str | None = None
    snapshot_interval_s: float = 30.0
    transport: str = "auto"
    ucx: UCXSettings = field(default_factory=UCXSettings)

    def __post_init__(self) -> None:
        object.__setattr__(self, "store_node_resources", frozen_mapping(self.store_node_resources))
        check_non_empty("master_name", self.master_name)
        check_at_least("segment_bytes", self.segment_bytes, 1)
        check_at_least("store_nodes", self.store_nodes, 0)
        check_at_least("store_node_bytes", self.store_node_bytes, 1)
        check_at_least("store_node_num_cpus", self.store_node_num_cpus, 0)
        check_resources("store_node_resources", self.store_node_resources)
        check_at_least("replicas", self.replicas, 1)
        check(0 < self.high_watermark <= 1, "high_watermark", f"must lie in (0, 1], got {self.high_watermark}")
        check(
            0 < self.low_watermark < self.high_watermark,
            "low_watermark",
            f"must lie in (0, high_watermark) = (0, {self.high_watermark}), got {self.low_watermark}",
        )
        check_non_empty("snapshot_dir", self.snapshot_dir)
        check_above("snapshot_interval_s", self.snapshot_interval_s, 0)
        check_choice("transport", self.transport, TRANSPORTS)

    def ucx_config(self) -> dict[str, str]:
        """UCX options as environment variables, only those set (for ``KVStoreClient.connect(ucx_config=...)``)."""
        config = {"UCX_TLS": self.ucx.tls, "UCX_NET_DEVICES": self.ucx.net_devices}
        return {name: value for name, value in config.items() if value is not None}


@dataclass(frozen=True, slots=True)
class StoreMembership:
    """What a worker needs to find (or start) the store's master and join the store with its segment."""

    store: KVStoreSettings
    tenant: str = "default"
    # The Ray namespace the master's named actor lives in.
    namespace: str | None = None
