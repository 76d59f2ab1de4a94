"""The KV transports a client can be told to use, by name (``KVStoreClient(transport=...)``).

A transport decides how a read reaches another owner's segment on the
reader's own node: ``auto`` maps it and copies straight out of shared
memory, ``ucx`` reads it over UCX like any other (for nodes whose processes
do not share ``/dev/shm``, and to exercise UCX on one node). Segments on
other nodes are always read over UCX, and writes to another owner's segment
always go through that owner's UCX server, so that it sees every write.

Importing this module imports neither Ray nor UCX: configuration checks a
transport name against ``TRANSPORTS`` without starting either.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from rayturn.registry import Registry

if TYPE_CHECKING:
    from .connection import MasterConnection
    from .peers import Peer
    from .segment import Segment


class Transport(ABC):
    # Segment id -> another owner's segment mapped into this process; the client closes them when it leaves.
    attached: dict[str, Segment]

    @abstractmethod
    def shared_segment(self, segment_id: str, peer: Peer) -> Segment | None:
        """The peer's segment mapped here to copy out of, or None: read it over UCX. PeerUnreachable when the
        transport knows the peer is gone."""


def _auto(master: MasterConnection, node_id: str) -> Transport:
    from .same_node import SharedMemoryTransport

    return SharedMemoryTransport(master, node_id)


def _ucx(master: MasterConnection, node_id: str) -> Transport:
    from .same_node import UcxOnlyTransport

    return UcxOnlyTransport()


TRANSPORTS: Registry[Transport] = Registry("KV transport")
TRANSPORTS.register("auto", _auto)
TRANSPORTS.register("ucx", _ucx)
