"""What a UCX transfer raises when it fails: the errors of both the ucxx path and the native one."""

from __future__ import annotations

__all__ = ["PeerTimedOut", "PeerUnreachable", "TransportError"]


class TransportError(RuntimeError):
    """A transfer failed: the server refused it (its message is included) or the connection broke."""


class PeerUnreachable(TransportError):
    """The server could not be reached or did not accept this peer, or the connection broke: not worth asking
    again soon."""


class PeerTimedOut(TransportError):
    """The request did not finish within its timeout: the peer is slow, stopped, or busy with earlier requests."""
