"""rayturn.kvstore: a Mooncake-style distributed KV page store on Ray, bytes moved over UCX."""

from .client import KVStoreClient
from .master import KVMaster, start_master
from .master_state import Location, MasterConfig, MasterState

__all__ = ["KVMaster", "KVStoreClient", "Location", "MasterConfig", "MasterState", "start_master"]
