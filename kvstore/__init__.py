"""rayturn.kvstore: a Mooncake-style distributed KV page store on Ray, bytes moved over UCX."""

from .client import KVStoreClient
from .master import KVMaster, start_master
from .master_state import Location, MasterConfig, MasterState
from .store_node import KVStoreNode, start_store_nodes

__all__ = [
    "KVMaster",
    "KVStoreClient",
    "KVStoreNode",
    "Location",
    "MasterConfig",
    "MasterState",
    "start_master",
    "start_store_nodes",
]
