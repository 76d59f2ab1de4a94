"""The master's lookup channel: read-path calls over a plain TCP socket instead of a Ray actor call.

Every call a worker makes on a request's critical path asks the master one
question about keys: where are they (``get_locations``), are they there
(``exists``), how much of a prefix is there (``longest_prefix``), how much of
a prefix is there and where (``locate_prefix``). Through Ray
each costs an actor call, ~1.5-2 ms here even for one key, and a thousand
keys' arguments and answer cost as much again in Ray's serialisation. The
master also listens on a socket for exactly these calls: length-prefixed
msgpack frames, validated by ``wire`` like every control message (so no
network bytes are unpickled and oversized or malformed frames are refused), a
round trip of ~0.1-0.3 ms. Everything else (puts, pins, membership) stays on
Ray.

The server runs on the master actor's event loop, so a lookup sees the same
state as the actor's methods and never interleaves with one. The client side
(``lookup_client``) lives in ``RayMaster``: it asks the actor for the address once, keeps one
connection (calls from several threads take turns), and on any failure (the
master restarted elsewhere, a frame it refused) answers that call through Ray
and tries the socket again after a pause that grows while failures repeat.
Every connection starts with the store's challenge-response (``access``):
a peer that cannot prove the store secret gets a refusal and a hang-up, and
never a lookup; a client asks nothing of a server that cannot prove it
back. Before its proof a peer may send one frame no longer than an ``auth``
message needs, and at most ``MAX_UNPROVEN_CONNECTIONS`` such peers are served
at a time (one more is hung up on at once): strangers cannot fill the master's
memory. Every lookup names the tenant it is for, and the master answers only
with that tenant's objects.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable
from typing import Any, cast

from . import wire
from .access import HANDSHAKE_TIMEOUT_S, NONCE_BYTES, PROOF_BYTES, AccessDenied, StoreAuth, refused_peer
from .wire import WireError

logger = logging.getLogger(__name__)

LOOKUP_METHODS = ("get_locations", "locate_prefix", "exists", "longest_prefix")
LOCATING_METHODS = ("get_locations", "locate_prefix")
"""The lookups that answer for a reader's node (its nearest replicas first) and grant it reads."""
LENGTH = struct.Struct(">I")
# The server's limits on peers that have not proven the store secret yet.
MAX_UNPROVEN_CONNECTIONS = 64
MAX_UNPROVEN_FRAME_BYTES = 4 * len(
    wire.encode({"type": "auth", "nonce": bytes(NONCE_BYTES), "proof": bytes(PROOF_BYTES)})
)
"""The ``auth`` message (a type, a nonce and a proof: 91 bytes), with room for fields a newer client may add."""


def _request_fields(message: dict[str, Any]) -> None:
    if message["method"] not in LOOKUP_METHODS:
        raise WireError(f"lookup method must be one of {list(LOOKUP_METHODS)}, got {message['method'][:64]!r}")
    message["keys"] = wire.validate_keys(message["keys"])


wire.register(
    "master_lookup",
    {"request_id": int, "method": str, "keys": list, "tenant": str},
    optional={"node_id": str},
    validators=[_request_fields],
)
wire.register(
    "master_lookup_reply",
    {"request_id": int, "ok": bool},
    optional={"result": (list, int), "error": str, "proof": bytes},  # proof: the master's, on accepting a peer
)


def frame(message: dict[str, Any]) -> bytes:
    body = wire.encode(message)
    return LENGTH.pack(len(body)) + body


# -- server (inside the master actor) -------------------------------------------------------


class LookupServer:
    """Answers lookups with ``answer(method, keys, node_id, tenant)`` on the running event loop, to peers
    that proved the store secret on connect.

    Each connection is an ``asyncio.Protocol``: its frames are cut out of the bytes as they arrive and
    answered in the same callback, with no coroutine or stream buffer between the socket and the
    answer (a stream reader's two awaited reads and a drain per lookup cost as much as the lookup).
    A peer that sends requests faster than it reads answers is not read from until its backlog of
    answers drains.
    """

    def __init__(self, answer: Callable[[str, list[bytes], str | None, str], Any], auth: StoreAuth) -> None:
        self.answer = answer
        self.auth = auth
        self.address: tuple[str, int] | None = None
        self._server: asyncio.Server | None = None
        self.num_unproven = 0  # connections that have still to prove the secret

    async def start(self, host: str) -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _LookupConnection(self), host, 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = (host, port)
        return self.address

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    def _authenticate(self, nonce: bytes, body: bytes | bytearray) -> tuple[bytes | None, str]:
        """The master's proof for a peer whose ``auth`` frame ``body`` answers ``nonce``; (None, why) if it
        does not."""
        try:
            answer = wire.decode(body, "auth")
            return self.auth.check_answer(nonce, answer["nonce"], answer["proof"]), ""
        except (WireError, AccessDenied) as err:
            return None, str(err)

    def _reply(self, body: bytes | bytearray | memoryview) -> bytes:
        """The encoded reply (one frame body) to the request frame ``body``: an answer, or a refusal saying
        why."""
        try:
            request = wire.decode(body, "master_lookup")
        except WireError as err:
            return wire.encode(_refusal(0, str(err)))
        request_id = request["request_id"]
        try:
            result = self.answer(request["method"], request["keys"], request.get("node_id"), request["tenant"])
            # An answer too large for one frame is refused here, and the client asks Ray.
            return wire.encode({"type": "master_lookup_reply", "request_id": request_id, "ok": True, "result": result})
        except Exception as err:  # the master's own error for this request: reported, the server stays up
            return wire.encode(_refusal(request_id, f"{type(err).__name__}: {err}"))


class _LookupConnection(asyncio.Protocol):
    """One peer of the lookup socket: CHALLENGED --proof--> SERVING --hang-up or unusable frame--> CLOSED, or
    CLOSED at once while ``MAX_UNPROVEN_CONNECTIONS`` others are CHALLENGED."""

    def __init__(self, server: LookupServer) -> None:
        self._server = server
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._nonce: bytes | None = None  # set while the peer has still to prove the secret
        self._handshake_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._server.num_unproven >= MAX_UNPROVEN_CONNECTIONS:
            reason = f"{MAX_UNPROVEN_CONNECTIONS} connections are already waiting to prove the store secret"
            refused_peer(logger, "kv master lookup socket", transport.get_extra_info("peername"), reason)
            transport.close()
            return
        # A stream transport (uvloop's, in a Ray actor, does not subclass asyncio.Transport).
        self._transport = cast(asyncio.Transport, transport)
        self._server.num_unproven += 1
        self._nonce = self._server.auth.challenge()
        self._transport.write(frame({"type": "challenge", "nonce": self._nonce}))
        self._handshake_timer = asyncio.get_running_loop().call_later(HANDSHAKE_TIMEOUT_S, self._too_slow)

    def connection_lost(self, exc: Exception | None) -> None:
        self._end_handshake()
        self._transport = None

    def _end_handshake(self) -> None:
        """Proven, refused or gone: the peer no longer waits to prove the secret (a no-op the second time)."""
        if self._nonce is not None:
            self._nonce = None
            self._server.num_unproven -= 1
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()

    def pause_writing(self) -> None:  # answers pile up unread: stop reading requests until they drain
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        if self._transport is not None:
            self._transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self._transport is None:  # hung up on
            return
        self._buffer += data
        while self._transport is not None and len(self._buffer) >= LENGTH.size:
            (length,) = LENGTH.unpack_from(self._buffer)
            max_length = wire.MAX_CONTROL_BYTES if self._nonce is None else MAX_UNPROVEN_FRAME_BYTES
            if length == 0 or length > max_length:  # checked before any of the body is waited for
                # The stream cannot be resynchronised after a bad length: say why, then hang up.
                reason = f"frame of {length} bytes refused"
                if self._nonce is None:
                    self._refuse(reason)
                else:
                    self._refuse(f"authentication refused: {reason}", reason)
                return
            end = LENGTH.size + length
            if len(self._buffer) < end:
                return
            body = self._buffer[LENGTH.size : end]
            del self._buffer[:end]
            if self._nonce is None:
                self._write(self._server._reply(body))
            else:
                self._prove(self._nonce, body)

    def _prove(self, nonce: bytes, body: bytearray) -> None:
        proof, reason = self._server._authenticate(nonce, body)
        if proof is None:
            self._refuse(f"authentication refused: {reason}", reason)
            return
        self._end_handshake()
        self._write(wire.encode({"type": "master_lookup_reply", "request_id": 0, "ok": True, "proof": proof}))

    def _too_slow(self) -> None:
        if self._transport is not None and self._nonce is not None:
            reason = "no proof of the store secret in time"
            self._refuse(f"authentication refused: {reason}", reason)

    def _refuse(self, error: str, logged: str | None = None) -> None:
        """Tell the peer ``error`` and hang up (``logged``: why a peer that never proved the secret was
        refused)."""
        assert self._transport is not None
        if logged is not None:
            refused_peer(logger, "kv master lookup socket", self._transport.get_extra_info("peername"), logged)
        self._end_handshake()
        self._write(wire.encode(_refusal(0, error)))
        self._transport.close()  # after what is written has gone
        self._transport = None
        self._buffer.clear()

    def _write(self, body: bytes) -> None:
        assert self._transport is not None
        self._transport.write(LENGTH.pack(len(body)) + body)


def _refusal(request_id: int, error: str) -> dict[str, Any]:
    return {"type": "master_lookup_reply", "request_id": request_id, "ok": False, "error": wire.truncate_error(error)}
