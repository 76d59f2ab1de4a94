"""rayturn.kvstore: a Mooncake-style distributed KV page store on Ray, bytes moved over UCX."""

from .client import KVStoreClient
from .master import KVMaster, start_master
from .master_state import Location, MasterConfig, MasterState
from .store_node import KVStoreNode, StoreNodeReplica, join_store, start_store_nodes

__all__ = [
    "KVMaster",
    "KVStoreClient",
    "KVStoreNode",
    "Location",
    "MasterConfig",
    "MasterState",
    "StoreNodeReplica",
    "join_store",
    "start_master",
    "start_store_nodes",
]
