"""The master's lookup channel: read-path calls over a plain TCP socket instead of a Ray actor call.

Every call a worker makes on a request's critical path asks the master one
question about keys: where are they (``get_locations``), are they there
(``exists``), how much of a prefix is there (``longest_prefix``). Through Ray
each costs an actor call, ~1.5-2 ms here even for one key, and a thousand
keys' arguments and answer cost as much again in Ray's serialisation. The
master also listens on a socket for exactly these calls: length-prefixed
msgpack frames, validated by ``wire`` like every control message (so no
network bytes are unpickled and oversized or malformed frames are refused), a
round trip of ~0.1-0.3 ms. Everything else (puts, pins, membership) stays on
Ray.

The server runs on the master actor's event loop, so a lookup sees the same
state as the actor's methods and never interleaves with one. The client side
lives in ``RayMaster``: it asks the actor for the address once, keeps one
connection (calls from several threads take turns), and on any failure (the
master restarted elsewhere, a frame it refused) answers that call through Ray
and tries the socket again after a pause that grows while failures repeat.
Every connection starts with the store's challenge-response (``access``):
a peer that cannot prove the store secret gets a refusal and a hang-up, and
never a lookup; a client asks nothing of a server that cannot prove it
back. Every lookup names the tenant it is for, and the master answers only
with that tenant's objects.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from . import wire
from .access import HANDSHAKE_TIMEOUT_S, AccessDenied, StoreAuth, refused_peer
from .wire import WireError

logger = logging.getLogger(__name__)

LOOKUP_METHODS = ("get_locations", "exists", "longest_prefix")
_LENGTH = struct.Struct(">I")
# The client's patience (see LookupClient).
CONNECT_TIMEOUT_S = 0.5
CALL_TIMEOUT_S = 2.0
LOCK_WAIT_S = 0.05
RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 60.0


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
    return _LENGTH.pack(len(body)) + body


# -- server (inside the master actor) -------------------------------------------------------


class LookupServer:
    """Answers lookups with ``answer(method, keys, node_id, tenant)`` on the running event loop, to peers
    that proved the store secret on connect."""

    def __init__(self, answer: Callable[[str, list[bytes], str | None, str], Any], auth: StoreAuth) -> None:
        self.answer = answer
        self.auth = auth
        self.address: tuple[str, int] | None = None
        self._server: asyncio.Server | None = None

    async def start(self, host: str) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._serve, host, 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = (host, port)
        return self.address

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if not await self._authenticate(reader, writer):
                return
            while True:
                try:
                    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
                except asyncio.IncompleteReadError:
                    return  # the client hung up
                if length == 0 or length > wire.MAX_CONTROL_BYTES:
                    # The stream cannot be resynchronised after a bad length: say why, then hang up.
                    writer.write(frame(_refusal(0, f"frame of {length} bytes refused")))
                    await writer.drain()
                    return
                writer.write(frame(self._reply(await reader.readexactly(length))))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    async def _authenticate(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Challenge the peer; whether it proved the secret (if not, it was told why, and is hung up on)."""
        nonce = self.auth.challenge()
        writer.write(frame({"type": "challenge", "nonce": nonce}))
        await writer.drain()
        try:
            (length,) = _LENGTH.unpack(await asyncio.wait_for(reader.readexactly(_LENGTH.size), HANDSHAKE_TIMEOUT_S))
            if length == 0 or length > wire.MAX_CONTROL_BYTES:
                raise WireError(f"frame of {length} bytes refused")
            answer = wire.decode(await asyncio.wait_for(reader.readexactly(length), HANDSHAKE_TIMEOUT_S), "auth")
            proof = self.auth.check_answer(nonce, answer["nonce"], answer["proof"])
        except (WireError, AccessDenied, asyncio.TimeoutError) as err:
            reason = "no proof of the store secret in time" if isinstance(err, asyncio.TimeoutError) else str(err)
            refused_peer(logger, "kv master lookup socket", writer.get_extra_info("peername"), reason)
            writer.write(frame(_refusal(0, f"authentication refused: {reason}")))
            await writer.drain()
            return False
        writer.write(frame({"type": "master_lookup_reply", "request_id": 0, "ok": True, "proof": proof}))
        await writer.drain()
        return True

    def _reply(self, body: bytes) -> dict[str, Any]:
        try:
            request = wire.decode(body, "master_lookup")
        except WireError as err:
            return _refusal(0, str(err))
        request_id = request["request_id"]
        try:
            result = self.answer(request["method"], request["keys"], request.get("node_id"), request["tenant"])
            reply = {"type": "master_lookup_reply", "request_id": request_id, "ok": True, "result": result}
            wire.encode(reply)  # an answer too large for one frame is refused, and the client asks Ray
            return reply
        except Exception as err:  # the master's own error for this request: reported, the server stays up
            return _refusal(request_id, f"{type(err).__name__}: {err}")


def _refusal(request_id: int, error: str) -> dict[str, Any]:
    return {"type": "master_lookup_reply", "request_id": request_id, "ok": False, "error": wire.truncate_error(error)}


# -- client (inside RayMaster) --------------------------------------------------------------


class LookupFailed(Exception):
    """The socket could not answer this call; ask Ray instead."""


class LookupClient:
    """One blocking connection to the master's lookup socket, shared by a process's threads.

    A lookup takes a fraction of a millisecond, so the socket never makes a
    caller wait long: connecting has ``CONNECT_TIMEOUT_S``, an answer
    ``CALL_TIMEOUT_S``, and a thread that cannot have the connection within
    ``LOCK_WAIT_S`` (another thread's call is stuck) asks Ray. After a failure
    the socket rests for ``RETRY_AFTER_S``, doubling with every further
    failure up to ``MAX_RETRY_AFTER_S`` (a port the network drops costs a
    timeout once a minute, not every second); a success resets it.
    """

    def __init__(self, resolve: Callable[[], tuple[str, int] | None], auth: StoreAuth) -> None:
        self._resolve = resolve
        self._auth = auth
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._next_id = 0
        self._retry_at = 0.0
        self._failures = 0  # in a row
        self.calls = 0  # answered over the socket
        self.fallbacks = 0  # answered through Ray instead

    def call(self, method: str, keys: list[bytes], tenant: str, node_id: str | None = None) -> Any:
        """The master's answer over the socket; LookupFailed when Ray must answer instead."""
        if not self._lock.acquire(timeout=LOCK_WAIT_S):
            self.fallbacks += 1
            raise LookupFailed("the lookup socket is busy")
        try:
            if time.monotonic() < self._retry_at:
                self.fallbacks += 1
                raise LookupFailed("the lookup socket failed recently")
            self._next_id += 1
            request: dict[str, Any] = {
                "type": "master_lookup",
                "request_id": self._next_id,
                "method": method,
                "keys": keys,
                "tenant": tenant,
            }
            if node_id is not None:
                request["node_id"] = node_id
            try:
                payload = frame(request)
            except WireError as err:  # too many keys for one frame: this call goes to Ray, the socket is fine
                self.fallbacks += 1
                raise LookupFailed(str(err)) from err
            try:
                ok, result = self._round_trip(payload)
            except Exception as err:  # the socket, the master's address, a garbled reply: rest the socket
                self._fail(err)
                raise LookupFailed(str(err)) from err
            self._failures = 0
            if not ok:  # the master refused this request (an answer too large for a frame, say)
                self.fallbacks += 1
                raise LookupFailed(result)
            self.calls += 1
            return result
        finally:
            self._lock.release()

    def _round_trip(self, payload: bytes) -> tuple[bool, Any]:
        if self._sock is None:
            address = self._resolve()
            if address is None:
                raise LookupFailed("the master has no lookup socket")
            self._sock = socket.create_connection(address, timeout=CONNECT_TIMEOUT_S)
            self._sock.settimeout(CALL_TIMEOUT_S)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._authenticate()
        self._sock.sendall(payload)
        reply = self._read_frame("master_lookup_reply")
        if reply["request_id"] != self._next_id:
            raise WireError(f"reply to request {reply['request_id']}, expected {self._next_id}")
        if not reply["ok"]:
            return False, reply.get("error", "refused")
        return True, reply.get("result")

    def _authenticate(self) -> None:
        """Answer the master's challenge on a new connection, and check the master's own proof; LookupFailed if
        either side is refused."""
        assert self._sock is not None
        server_nonce = self._read_frame("challenge")["nonce"]
        client_nonce, proof = self._auth.answer(server_nonce)
        self._sock.sendall(frame({"type": "auth", "nonce": client_nonce, "proof": proof}))
        reply = self._read_frame("master_lookup_reply")
        if not reply["ok"]:
            raise LookupFailed(reply.get("error", "authentication refused"))
        try:
            self._auth.check_server(server_nonce, client_nonce, reply.get("proof"))
        except AccessDenied as err:
            raise LookupFailed(str(err)) from None

    def _read_frame(self, expected_type: str) -> dict[str, Any]:
        (length,) = _LENGTH.unpack(self._read(_LENGTH.size))
        if length == 0 or length > wire.MAX_CONTROL_BYTES:
            raise WireError(f"reply frame of {length} bytes refused")
        return wire.decode(self._read(length), expected_type)

    def _read(self, num_bytes: int) -> bytes:
        assert self._sock is not None
        chunks, left = [], num_bytes
        while left:
            chunk = self._sock.recv(left)
            if not chunk:
                raise ConnectionError("the master closed the lookup socket")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def _fail(self, err: Exception) -> None:
        self.fallbacks += 1
        self._failures += 1
        rest_s = min(MAX_RETRY_AFTER_S, RETRY_AFTER_S * 2 ** (self._failures - 1))
        logger.debug("kv master lookup socket failed, answering through Ray for %.0f s: %s", rest_s, err)
        self.close_socket()
        self._retry_at = time.monotonic() + rest_s

    def close_socket(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None
