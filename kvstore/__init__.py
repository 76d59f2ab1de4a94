"""rayturn.kvstore: a Mooncake-style distributed KV page store on Ray, bytes moved over UCX.

The names below are imported on first use: importing a light submodule
(``transports``, to check a configured transport name) must not import Ray.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .client import KVStoreClient
    from .master import KVMaster, start_master
    from .master_state import MasterState
    from .master_types import Location, MasterConfig
    from .reader import LocatedPrefix
    from .store_node import KVStoreNode, StoreNodeReplica, join_store, start_store_nodes

_HOME_MODULES = {
    "KVMaster": "master",
    "KVStoreClient": "client",
    "KVStoreNode": "store_node",
    "LocatedPrefix": "reader",
    "Location": "master_types",
    "MasterConfig": "master_types",
    "MasterState": "master_state",
    "StoreNodeReplica": "store_node",
    "join_store": "store_node",
    "start_master": "master",
    "start_store_nodes": "store_node",
}

__all__ = [
    "KVMaster",
    "KVStoreClient",
    "KVStoreNode",
    "LocatedPrefix",
    "Location",
    "MasterConfig",
    "MasterState",
    "StoreNodeReplica",
    "join_store",
    "start_master",
    "start_store_nodes",
]


def __getattr__(name: str) -> Any:
    home = _HOME_MODULES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{home}", __name__), name)
