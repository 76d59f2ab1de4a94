"""The client side of the master's lookup channel (``master_lookup``): one blocking connection, inside
``RayMaster``, that answers a read-path lookup in a fraction of a millisecond or hands it to Ray."""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from . import wire
from .access import AccessDenied, StoreAuth
from .master_lookup import LENGTH, frame
from .wire import WireError

logger = logging.getLogger(__name__)

# The client's patience (see LookupClient).
CONNECT_TIMEOUT_S = 0.5
CALL_TIMEOUT_S = 2.0
LOCK_WAIT_S = 0.05
RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 60.0
_FIRST_RECV_BYTES = 64 << 10
REPLY_SPIN_S = 0.0002
"""How long a caller polls for a lookup's answer before it sleeps in ``recv``: a sleeping thread's CPU goes idle,
and waking it costs more than the lookup on a virtual machine (a loopback round trip between two processes here:
~0.1 ms asleep, ~0.025 ms polling). The poll yields the CPU on every turn."""


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
        self._await_reply()
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

    def _await_reply(self) -> None:
        """Poll the socket for up to ``REPLY_SPIN_S``, yielding the CPU between polls; ``recv`` waits the rest."""
        assert self._sock is not None
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        deadline = time.perf_counter() + REPLY_SPIN_S
        while not poller.poll(0) and time.perf_counter() < deadline:
            os.sched_yield()

    def _read_frame(self, expected_type: str) -> dict[str, Any]:
        """The next frame: one ``recv`` for a frame that has arrived whole (a lookup's answer, most often)."""
        assert self._sock is not None
        data = self._sock.recv(_FIRST_RECV_BYTES)
        if not data:
            raise ConnectionError("the master closed the lookup socket")
        if len(data) < LENGTH.size:
            data += self._read(LENGTH.size - len(data))
        (length,) = LENGTH.unpack_from(data)
        if length == 0 or length > wire.MAX_CONTROL_BYTES:
            raise WireError(f"reply frame of {length} bytes refused")
        body = data[LENGTH.size :]
        if len(body) > length:  # the server spoke out of turn: the stream is out of step
            raise WireError(f"{len(body) - length} bytes after a {length}-byte reply frame")
        if len(body) < length:
            body += self._read(length - len(body))
        return wire.decode(body, expected_type)

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
