"""How each transport of ``transports`` reaches another owner's segment on the reader's own node."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .segment import Segment, owner_alive
from .transports import Transport
from .ucx_client import PeerUnreachable

if TYPE_CHECKING:
    from .connection import MasterConnection
    from .peers import Peer


class SharedMemoryTransport(Transport):
    """``auto``: a segment whose owner runs on this node is mapped once and copied out of directly."""

    def __init__(self, master: MasterConnection, node_id: str) -> None:
        self._master = master
        self._node_id = node_id
        self.attached = {}

    def shared_segment(self, segment_id: str, peer: Peer) -> Segment | None:
        """The peer's shared memory, if it is on this node; PeerUnreachable if its owner process is gone (a
        dead owner's pages are lost, and asking its UCX port would only cost a timeout)."""
        if peer.node_id != self._node_id:
            return None
        if not owner_alive(peer.shm_name):
            self.attached.pop(segment_id, None)
            self._master.notify("drop_segment", segment_id)
            raise PeerUnreachable(f"the owner of segment {segment_id} on this node is gone")
        if segment_id not in self.attached:
            self.attached[segment_id] = Segment.attach(peer.shm_name)
        return self.attached[segment_id]


class UcxOnlyTransport(Transport):
    """``ucx``: nothing is mapped; every other owner's segment is read over UCX."""

    def __init__(self) -> None:
        self.attached = {}

    def shared_segment(self, segment_id: str, peer: Peer) -> Segment | None:
        return None
