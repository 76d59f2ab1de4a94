"""Other owners' segments as a client sees them: the node each is on, its shared memory, its UCX address."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .master_types import parse_address

if TYPE_CHECKING:
    from .connection import MasterConnection


@dataclass(frozen=True, slots=True)
class Peer:
    node_id: str
    shm_name: str
    ucx_address: tuple[str, int] | None


class PeerDirectory:
    """The master's segment directory, fetched again only when a segment it does not know turns up."""

    def __init__(self, master: MasterConnection) -> None:
        self._master = master
        self._peers: dict[str, Peer] = {}

    def get(self, segment_id: str) -> Peer | None:
        if segment_id not in self._peers:
            directory = self._master.call("segment_directory")
            for sid, info in directory.items():
                self._peers[sid] = Peer(info["node_id"], info["shm_name"], parse_address(info["ucx_address"]))
        return self._peers.get(segment_id)
