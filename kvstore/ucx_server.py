"""The UCX server of one KV segment: remote clients read ranges out of it and write ranges into it.

Life cycle of requests on one connection, server side (one request at a time per connection,
any number of connections at once)::

         +----------------------------------------------------------------------------+
         v                                                                            |
    WAIT_REQUEST --frame--> VALIDATE --invalid--> REPLY error ----------------------->+
         |                     |                                                      |
         |        read_request | write_request                                        |
         |                     +-------------------------+                            |
         |                     v                         v                            |
         |         REPLY ok + SEND_DATA       REPLY ok "ready" + RECV_DATA            |
         |                     |                         |                            |
         |                     |              scatter, on_write(keys, ranges)         |
         |                     |                         |                            |
         |                     |              REPLY ok "done" / error                 |
         |                     +-------------------------+--------------------------->+
         |
         +-- unusable frame, UCX error, peer gone, I/O timeout
                 --> REPLY error (if still possible) --> CLOSED (this connection only)

Before its first request, a connection proves the store secret (``access``: the server sends a
challenge, the client's answer must carry the proof, else a refusal and the connection closes; the
server's acceptance carries its own proof, which the client checks), and
every request carries the master's grant for its ranges: a read may touch only ranges the master
just leased to a reader, a write only the ranges the master placed those keys at.

"invalid" is a message that is not msgpack or breaks its schema (the reply carries request_id -1),
a range outside the segment, a range its grant does not cover, or a request over the staging limit:
the connection stays in step.
The reply and the data of a read are posted back to back, as are the "ready" reply and the data
receive of a write, so neither waits for the other's completion to reach Python.

The server does no locking of ranges: a read racing a write of the same bytes sees either, as with
any shared memory; which ranges are whose is the master's business, told through the grants.
The UCX listener binds every interface (ucxx offers no bind address); ``host`` is the address the
server advertises. A peer elsewhere can connect, and gets a challenge it cannot answer.

Reads have a faster door: the segment's native reader (:mod:`rayturn.kvstore.ucx_native`),
bound to ``host`` on a port of its own that the accepting reply tells each client (``fast_port``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, TypeAlias

import numpy as np

from rayturn.kvstore import wire
from rayturn.kvstore.access import HANDSHAKE_TIMEOUT_S, AccessDenied, ReadGrant, SegmentGate, WriteGrant, refused_peer
from rayturn.kvstore.bytes_view import as_writable_view
from rayturn.kvstore.ucx_framing import (
    DEFAULT_TIMEOUT_S,
    UNPARSED_REQUEST_ID,
    Address,
    Channel,
    FramingError,
    Range,
    abort_endpoint,
    contiguous_span,
    describe_error,
    gather,
    scatter,
    staging_pool,
)
from rayturn.kvstore.ucx_native import NativeServer
from rayturn.kvstore.ucx_native import library as native_library
from rayturn.kvstore.ucx_runtime import (
    load_ucxx,
    register_for_shutdown,
    run_in_ucx_loop,
    ucx_loop_running,
    unregister_for_shutdown,
)

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["DEFAULT_MAX_STAGING_BYTES", "UcxServer", "WriteCallback"]

logger = logging.getLogger(__name__)

WriteCallback: TypeAlias = Callable[[list[bytes], list[tuple[int, int]], str], None]

DEFAULT_MAX_STAGING_BYTES: Final = 1 << 30
"""Largest non-contiguous request a server stages by default; contiguous requests need no staging."""
_STOP_WAIT_S: Final = 5.0
HANDSHAKE_REQUEST_ID: Final = 0


class _RequestRefused(Exception):
    """The server refuses one request; the connection stays in step and keeps serving."""


class UcxServer:
    """Serves reads and writes of one segment to :class:`UcxClient` s over UCX.

    ``buffer`` is the segment: any writable, C-contiguous buffer (memoryview, numpy array,
    bytearray) of ``capacity`` bytes; the server keeps a view of it, so it must outlive the
    server. ``gate`` authenticates each connection and checks each request's grant.
    ``on_write(keys, ranges, tenant)`` runs on the UCX loop thread after a write's bytes have
    fully landed; if it raises, the client gets a TransportError saying so. Non-contiguous
    requests over ``max_staging_bytes`` are refused; once a request has been accepted, each of
    its data and body transfers, and each reply, must complete within ``io_timeout_s`` or the
    connection closes (a stopped peer costs one connection, never the server's loop).
    """

    def __init__(
        self,
        buffer: memoryview | bytearray | np.ndarray,
        *,
        gate: SegmentGate,
        host: str = "127.0.0.1",
        port: int = 0,
        on_write: WriteCallback | None = None,
        max_staging_bytes: int = DEFAULT_MAX_STAGING_BYTES,
        io_timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if not 0 <= port <= 0xFFFF:
            raise ValueError(f"port must be in 0..65535, got {port}")
        self._segment = as_writable_view(buffer)
        self._gate = gate
        self._host = host
        self._port = port
        self._on_write = on_write
        self._max_staging_bytes = max_staging_bytes
        self._io_timeout_s = io_timeout_s
        self._state = "new"  # new -> running -> stopped
        self._state_lock = threading.Lock()
        self._address: Address | None = None
        # Touched only on the UCX loop:
        self._listener: Any = None
        self._connections: dict[Any, asyncio.Task[Any]] = {}
        self._native: NativeServer | None = None

    @property
    def capacity_bytes(self) -> int:
        return self._segment.nbytes

    @property
    def address(self) -> Address | None:
        """``(host, port)`` while running, else None."""
        return self._address if self._state == "running" else None

    def start(self, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Address:
        """Start listening; returns ``(host, port)`` with the port actually bound. Idempotent while running."""
        with self._state_lock:
            if self._state == "running":
                assert self._address is not None
                return self._address
            if self._state == "stopped":
                raise RuntimeError("a stopped UcxServer cannot be restarted; create a new one")
            self._address = run_in_ucx_loop(self._listen(), timeout_s=timeout_s)
            self._start_native()
            self._state = "running"
            register_for_shutdown(self, UcxServer._close_on_loop)
            return self._address

    def stop(self, *, timeout_s: float = 10.0) -> None:
        """Stop listening and close every connection. Idempotent; a stopped server stays stopped."""
        with self._state_lock:
            was_running, self._state = self._state == "running", "stopped"
        unregister_for_shutdown(self)
        try:
            if was_running and ucx_loop_running():
                run_in_ucx_loop(self._close_on_loop(), timeout_s=timeout_s)
        finally:
            if self._native is not None:
                self._native.stop()
        self._segment = memoryview(b"")  # release the segment's memory so its owner can unmap it

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    def _start_native(self) -> None:
        """The segment's native reader (``ucx_native``), where the library builds; clients read through it."""
        if native_library() is None:
            return
        try:
            self._native = NativeServer(self._segment, self._gate, self._host)
        except Exception as error:  # e.g. an advertised host that is a name: ucxx serves every read
            logger.warning("kv segment %s serves no native reads: %s", self._gate.segment_id, error)

    @property
    def fast_port(self) -> int | None:
        """The native reader's port (told to each client in the handshake), or None without one."""
        return None if self._native is None else self._native.port

    async def _listen(self) -> Address:
        self._listener = load_ucxx().create_listener(
            self._serve_endpoint, port=self._port, connect_timeout=HANDSHAKE_TIMEOUT_S
        )
        return (self._host, int(self._listener.port))

    async def _close_on_loop(self) -> None:
        listener, self._listener = self._listener, None
        tasks = list(self._connections.values())
        for endpoint in list(self._connections):
            abort_endpoint(endpoint)  # first: cancels UCX requests still aimed at the segment
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=_STOP_WAIT_S)
        if listener is not None:
            # ucxx retires a handler a loop turn after it ends, and warns about a listener closed
            # before then: let it catch up (bounded) before closing.
            deadline = time.monotonic() + _STOP_WAIT_S
            while listener.active_clients and time.monotonic() < deadline:
                await asyncio.sleep(0.001)
            listener.close()

    async def _serve_endpoint(self, endpoint: Any) -> None:
        """ucxx's listener callback: serve one connection until it closes."""
        task = asyncio.current_task()
        if self._listener is None or task is None:  # stopping: refuse late connections
            abort_endpoint(endpoint)
            return
        self._connections[endpoint] = task
        # A local, so held until the endpoint is aborted below: a receive into its buffer may still be posted.
        connection = _ServerConnection(endpoint, self)
        try:
            await connection.serve()
        except Exception as error:  # the peer left or broke the protocol: only this connection ends
            logger.debug("UCX connection closed: %s: %s", type(error).__name__, error)
        finally:
            self._connections.pop(endpoint, None)
            abort_endpoint(endpoint)

    def _check_request(self, ranges: list[Range]) -> int:
        """Total bytes of ``ranges``; _RequestRefused if one leaves the segment or staging would be too big."""
        capacity = self._segment.nbytes
        total_bytes = 0
        for index, (offset, length) in enumerate(ranges):
            if offset + length > capacity:
                raise _RequestRefused(
                    f"range {index} [offset {offset}, length {length}] ends at {offset + length}, "
                    f"beyond the {capacity}-byte segment"
                )
            total_bytes += length
        if total_bytes > self._max_staging_bytes and contiguous_span(ranges) is None:
            raise _RequestRefused(
                f"non-contiguous request of {total_bytes} bytes exceeds this server's staging limit of "
                f"{self._max_staging_bytes} bytes; split it"
            )
        return total_bytes

    def _check_grant(self, request: dict[str, Any]) -> None:
        """_RequestRefused unless the request's grant covers its ranges (and, for a write, its keys)."""
        try:
            if request["type"] == "read_request":
                self._gate.check_read(ReadGrant.from_wire(request["grant"]), request["ranges"])
            else:
                grant = WriteGrant.from_wire(request["grant"])
                self._gate.check_write(request["tenant"], grant, request["keys"], request["ranges"])
        except AccessDenied as error:
            raise _RequestRefused(str(error)) from None

    def _notify_write(self, keys: list[bytes], ranges: list[Range], tenant: str) -> None:
        if self._on_write is None:
            return
        try:
            self._on_write(keys, ranges, tenant)
        except Exception as error:
            logger.exception("on_write callback failed")
            raise _RequestRefused(f"bytes landed but the server's on_write failed: {describe_error(error)}") from error


class _ServerConnection:
    """One client connection on the server: one request at a time, in order."""

    def __init__(self, endpoint: Any, server: UcxServer) -> None:
        self._channel = Channel(endpoint)
        self._server = server

    async def serve(self) -> None:
        await self._authenticate()
        while True:
            request = await self._next_request()
            if request is not None:
                await self._handle(request)

    async def _authenticate(self) -> None:
        """The challenge-response every connection starts with; raises (closing it) unless the peer proves
        the store secret in time."""
        gate = self._server._gate
        nonce = gate.auth.challenge()
        try:
            challenge = self._channel.send_control(wire.encode({"type": "challenge", "nonce": nonce}))
            await asyncio.wait_for(challenge, HANDSHAKE_TIMEOUT_S)
            answer = await asyncio.wait_for(self._channel.recv_control(expected_type="auth"), HANDSHAKE_TIMEOUT_S)
            proof = gate.auth.check_answer(nonce, answer["nonce"], answer["proof"])
        except (AccessDenied, wire.WireError, FramingError, asyncio.TimeoutError) as error:
            reason = "no proof of the store secret in time" if isinstance(error, asyncio.TimeoutError) else str(error)
            refused_peer(logger, f"kv segment {gate.segment_id}", None, reason)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    self._channel.send_reply(HANDSHAKE_REQUEST_ID, ok=False, error=f"authentication refused: {reason}"),
                    timeout=1.0,
                )
            raise
        fast_port = self._server.fast_port
        accepted = self._channel.send_reply(HANDSHAKE_REQUEST_ID, ok=True, proof=proof, fast_port=fast_port)
        await asyncio.wait_for(accepted, HANDSHAKE_TIMEOUT_S)

    async def _reply(self, request_id: int, *, ok: bool, total_bytes: int = 0, error: str | None = None) -> None:
        """Send a reply; a peer that does not take it within the I/O timeout loses the connection."""
        reply = self._channel.send_reply(request_id, ok=ok, total_bytes=total_bytes, error=error)
        await asyncio.wait_for(reply, self._server._io_timeout_s)

    async def _next_request(self) -> dict[str, Any] | None:
        try:
            # No timeout: an idle connection may wait for its next request indefinitely.
            return await self._channel.recv_control(body_timeout_s=self._server._io_timeout_s)
        except wire.WireError as error:  # the frame was sound, only its message was not: keep serving
            await self._reply(UNPARSED_REQUEST_ID, ok=False, error=f"malformed request: {error}")
            return None
        except FramingError as error:  # cannot find the next message boundary: say why, then hang up
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    self._channel.send_reply(UNPARSED_REQUEST_ID, ok=False, error=f"closing connection: {error}"),
                    timeout=1.0,
                )
            raise

    async def _handle(self, request: dict[str, Any]) -> None:
        request_id = request.get("request_id", UNPARSED_REQUEST_ID)
        if isinstance(request_id, bool) or not isinstance(request_id, int):
            request_id = UNPARSED_REQUEST_ID  # another module's message type, without an id
        try:
            if request["type"] not in ("read_request", "write_request"):
                raise _RequestRefused(f"this server does not handle {request['type']!r} messages")
            self._server._check_grant(request)
            if request["type"] == "read_request":
                await self._serve_read(request_id, request["ranges"])
            else:
                await self._serve_write(request_id, request["keys"], request["ranges"], request["tenant"])
        except _RequestRefused as error:
            await self._reply(request_id, ok=False, error=str(error))

    async def _serve_read(self, request_id: int, ranges: list[Range]) -> None:
        total_bytes = self._server._check_request(ranges)
        segment = self._server._segment
        span = contiguous_span(ranges)
        if span is not None:
            await self._send_read(request_id, segment[span[0] : span[1]])  # zero copy: straight from the segment
            return
        with staging_pool.borrow(total_bytes) as data:
            gather(segment, ranges, data)
            await self._send_read(request_id, data)

    async def _send_read(self, request_id: int, data: memoryview) -> None:
        # Reply and data are posted at once (UCX keeps their order) and awaited as one: the data
        # does not wait for the reply's completion to make its way back to this loop.
        await self._channel.send_reply_and_data(request_id, data, self._server._io_timeout_s)

    async def _serve_write(self, request_id: int, keys: list[bytes], ranges: list[Range], tenant: str) -> None:
        total_bytes = self._server._check_request(ranges)
        segment = self._server._segment
        span = contiguous_span(ranges)
        if span is not None:
            await self._recv_write(request_id, segment[span[0] : span[1]])  # zero copy: straight into the segment
        else:
            with staging_pool.borrow(total_bytes) as data:
                await self._recv_write(request_id, data)
                scatter(data, ranges, segment)
        self._server._notify_write(keys, ranges, tenant)
        await self._reply(request_id, ok=True, total_bytes=total_bytes)  # "done"

    async def _recv_write(self, request_id: int, into: memoryview) -> None:
        await asyncio.gather(
            self._reply(request_id, ok=True, total_bytes=into.nbytes),  # "ready: send the data"
            self._channel.recv_data(into, self._server._io_timeout_s),
        )
