"""The UCX client: reads ranges from and writes ranges into the segments of remote UcxServers.

Life cycle of a connection and its requests, client side (it mirrors the server's, see
:mod:`rayturn.kvstore.ucx_server`): CONNECT -> WAIT_CHALLENGE -> SEND_PROOF -> WAIT_OK -> IDLE, then per
request IDLE -> SEND_REQUEST -> WAIT_REPLY -> (read) RECV_DATA / (write) SEND_DATA -> WAIT_REPLY -> IDLE
(a read posts its WAIT_REPLY and RECV_DATA receives at once; a small one into one span, once connected, runs
on the calling thread instead of the loop, with the same messages and checks: :mod:`rayturn.kvstore.ucx_direct`;
once the handshake named the server's native reader, reads go there instead: :mod:`rayturn.kvstore.ucx_native`).
A refusal (``ok=False``) becomes a :class:`TransportError` carrying the server's message and leaves
the connection usable, except a read's (its data receive is already posted: the endpoint is dropped);
anything else that goes wrong (timeout, broken connection, malformed reply) also raises TransportError
and drops the cached endpoint, so the next call reconnects instead of reading a stale message from a
desynchronised stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, TypeAlias

from rayturn.kvstore import wire
from rayturn.kvstore.access import AccessDenied, ReadGrant, StoreAuth, WriteGrant
from rayturn.kvstore.bytes_view import as_bytes_view, as_writable_view
from rayturn.kvstore.ucx_direct import DIRECT_READ_MAX_BYTES, DirectReadFailed, read_now
from rayturn.kvstore.ucx_errors import PeerTimedOut, PeerUnreachable, TransportError
from rayturn.kvstore.ucx_framing import (
    DEFAULT_TIMEOUT_S,
    INLINE_BODY_BYTES,
    UNPARSED_REQUEST_ID,
    Address,
    Channel,
    abort_endpoint,
    adjacent_span,
    buffer_views,
    describe_error,
    gather_views,
    scatter_views,
    staging_pool,
)
from rayturn.kvstore.ucx_native import NativeReads
from rayturn.kvstore.ucx_runtime import (
    by_deadline,
    deadline_after,
    in_ucx_loop_thread,
    load_ucxx,
    register_for_shutdown,
    run_in_ucx_loop,
    ucx_loop_running,
    unregister_for_shutdown,
)

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["DEFAULT_CONNECT_TIMEOUT_S", "PeerTimedOut", "PeerUnreachable", "TransportError", "UcxClient"]

DEFAULT_CONNECT_TIMEOUT_S: Final = 5.0
# A blocking call waits this long past its request's own deadline (kept on the loop) before giving up on the loop.
_LOOP_GRACE_S: Final = 5.0

_Operation: TypeAlias = Callable[[Channel], Awaitable[None]]


class _ProtocolError(Exception):
    """The peer answered out of protocol (wrong request id, wrong size)."""


class _ServerRefused(Exception):
    """The server answered ok=False: the request failed, the connection is still in step."""


class _RefusedOutOfStep(_ServerRefused):
    """The server answered ok=False to a request whose data receive was already posted: the connection must go."""


class _ConnectionFailed(Exception):
    """Connecting or talking to the server failed (its own timeouts included); the endpoint is gone."""


class _ClientConnection:
    """The cached endpoint to one server, with the locks that keep its requests one at a time: ``caller_lock``,
    held by the calling thread for the whole request (loop or direct path), and ``lock`` on the loop."""

    def __init__(self, address: Address, connect_timeout_s: float, auth: StoreAuth) -> None:
        self.address = address
        self._auth = auth
        self.caller_lock = threading.Lock()
        self.lock = asyncio.Lock()
        self._connect_timeout_s = connect_timeout_s
        self.channel: Channel | None = None  # connected and authenticated; None until then and once dropped
        self.fast_port: int | None = None  # the server's native reader, as its handshake said (ucx_native)

    async def run(self, operation: _Operation) -> None:
        async with self.lock:
            try:
                channel = self.channel or await self._connect()
                await operation(channel)
            except _RefusedOutOfStep:
                self.drop()
                raise
            except (_ServerRefused, _ConnectionFailed):
                raise
            except Exception as error:  # the stream's state is unknown: never reuse it
                self.drop()
                # Wrapped, so that a TimeoutError from inside ucxx is not taken for the request's own.
                raise _ConnectionFailed(describe_error(error)) from error
            except BaseException:  # cancelled by the request's timeout, mid-exchange
                self.drop()
                raise

    async def _connect(self) -> Channel:
        host, port = self.address
        try:
            endpoint = await load_ucxx().create_endpoint(host, port, connect_timeout=self._connect_timeout_s)
        except (TimeoutError, asyncio.TimeoutError):  # ucxx's handshake timed out: no UCX listener answered
            raise _ConnectionFailed(f"no UCX handshake from {host}:{port} within {self._connect_timeout_s} s") from None
        except Exception as error:
            raise _ConnectionFailed(f"cannot connect to {host}:{port}: {describe_error(error)}") from error
        channel = Channel(endpoint)
        try:
            await asyncio.wait_for(self._authenticate(channel), self._connect_timeout_s)
        except BaseException:
            abort_endpoint(endpoint)
            raise
        self.channel = channel
        return channel

    async def _authenticate(self, channel: Channel) -> None:
        """Answer the server's challenge with the proof of the store secret and check the server's own;
        _ConnectionFailed if either side is refused."""
        server_nonce = (await channel.recv_control(expected_type="challenge"))["nonce"]
        client_nonce, proof = self._auth.answer(server_nonce)
        await channel.send_control(wire.encode({"type": "auth", "nonce": client_nonce, "proof": proof}))
        reply = await channel.recv_control(expected_type="reply")
        if not reply["ok"]:
            raise _ConnectionFailed(reply.get("error") or "the server refused this peer")
        try:
            self._auth.check_server(server_nonce, client_nonce, reply.get("proof"))
        except AccessDenied as error:
            raise _ConnectionFailed(str(error)) from None
        self.fast_port = reply.get("fast_port")

    async def drop_on_loop(self, posted: tuple[Any, ...]) -> None:
        self.drop()  # after a failed direct read: its ``posted`` requests' futures end cancelled, seen here
        for request in posted:
            request.future.add_done_callback(_observe)

    def drop(self) -> None:
        if self.channel is not None:
            abort_endpoint(self.channel.endpoint)
            self.channel = None


async def _send_and_expect_ok(channel: Channel, request_id: int, send: Awaitable[None]) -> int:
    """Run ``send`` and receive the reply that answers it, posted at once; the reply's ``total_bytes``."""
    return await _expect_ok(request_id, send, channel.recv_control(expected_type="reply"))


async def _expect_ok(request_id: int, send: Awaitable[None], receive: Awaitable[dict[str, Any]]) -> int:
    """The ``total_bytes`` of the reply ``receive`` brings, once ``send`` is done; _ServerRefused if refused."""
    _, reply = await asyncio.gather(send, receive)
    # A refusal of a request the server could not even parse carries id -1; any other stranger
    # means the stream is out of step, and the connection must go.
    if reply["request_id"] not in (request_id, UNPARSED_REQUEST_ID):
        raise _ProtocolError(f"got the reply to request {reply['request_id']} while waiting for {request_id}")
    if not reply["ok"]:
        raise _ServerRefused(reply.get("error") or "the server refused the request without saying why")
    if reply["request_id"] != request_id:
        raise _ProtocolError(f"got an ok reply with request id {reply['request_id']} while waiting for {request_id}")
    total_bytes: int = reply["total_bytes"]
    return total_bytes


async def _read_exchange(channel: Channel, request_id: int, body: bytes, views: list[memoryview]) -> None:
    """Post the request, the reply's receive and the data's, in that order (a tag receive takes the next matching
    message, in posting order): the data lands as it arrives, with no turn of this loop between reply and data.
    A refusal leaves the data's receive posted, so it drops the connection (``_RefusedOutOfStep``)."""
    expected_bytes = sum(view.nbytes for view in views)
    span = adjacent_span(views)
    with contextlib.ExitStack() as staging:
        into = span if span is not None else staging.enter_context(staging_pool.borrow(expected_bytes))
        send = asyncio.ensure_future(channel.send_control(body))
        reply = asyncio.ensure_future(channel.recv_control(expected_type="reply"))
        data = asyncio.ensure_future(channel.recv_data(into))  # zero copy when ``span``: straight into the dests
        try:
            total_bytes = await _expect_ok(request_id, send, reply)
            if total_bytes != expected_bytes:
                raise _ProtocolError(f"server announced {total_bytes} bytes for a read of {expected_bytes}")
            await data
        except _ServerRefused as error:
            raise _RefusedOutOfStep(str(error)) from None
        finally:
            for task in (send, reply, data):
                task.cancel()  # only those not done; the connection then drops, cancelling UCX's requests
                task.add_done_callback(_observe)
        if span is None:
            scatter_views(into, views)


def _observe(task: asyncio.Future[Any]) -> None:
    """Mark a side task's failure as seen: the request's own error (or the dropped connection) reports it."""
    _ = task.cancelled() or task.exception()


async def _write_exchange(channel: Channel, request_id: int, body: bytes, views: list[memoryview]) -> None:
    total_bytes = await _send_and_expect_ok(channel, request_id, channel.send_control(body))
    expected_bytes = sum(view.nbytes for view in views)
    if total_bytes != expected_bytes:
        raise _ProtocolError(f"server announced {total_bytes} bytes for a write of {expected_bytes}")
    span = adjacent_span(views)
    if span is not None:
        await _send_and_expect_ok(channel, request_id, channel.send_data(span))  # zero copy: from the source(s)
        return
    with staging_pool.borrow(total_bytes) as data:
        gather_views(views, data)
        await _send_and_expect_ok(channel, request_id, channel.send_data(data))


class UcxClient:
    """Reads ranges from and writes ranges to remote :class:`UcxServer` s; a blocking, thread-safe facade.

    One endpoint is cached per server address; requests to one server run one at a time (an asyncio lock per
    endpoint), requests to different servers run concurrently. Every call takes ``timeout_s`` (default: the
    client's), counted from the call, and raises :class:`TransportError` when it expires (``by_deadline``).
    """

    def __init__(
        self,
        *,
        auth: StoreAuth,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    ) -> None:
        self._auth = auth
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._request_ids = itertools.count(1)
        self._closed = False
        self._native = NativeReads(auth)
        self._connections: dict[Address, _ClientConnection] = {}  # added to by calling threads, cleared on the loop

    def read(
        self,
        address: Address,
        ranges: Sequence[tuple[int, int]],
        dests: Sequence[Any],
        grant: ReadGrant,
        *,
        timeout_s: float | None = None,
    ) -> None:
        """Copy each range of the server's segment into the destination at the same index.

        ``grant`` is the master's for these ranges. Each destination is a writable, C-contiguous
        buffer (bytearray, numpy array, memoryview) of exactly its range's length; ValueError
        naming the index, before any traffic, if not.
        """
        checked = wire.validate_ranges(list(ranges))
        views = buffer_views(dests, checked, "dests", as_writable_view)
        connection = self._connections.get((str(address[0]), int(address[1])))
        wait_s = self._timeout_s if timeout_s is None else timeout_s
        if self._native.read(connection, checked, grant, views, wait_s):  # no Python between: ucx_native
            return
        small = sum(view.nbytes for view in views) <= DIRECT_READ_MAX_BYTES
        request_id = next(self._request_ids)
        message = {"type": "read_request", "request_id": request_id, "ranges": [list(r) for r in checked]}
        body = wire.encode({**message, "grant": grant.to_wire()})
        span = adjacent_span(views) if small and len(body) <= INLINE_BODY_BYTES else None

        def operation(channel: Channel) -> Awaitable[None]:
            return _read_exchange(channel, request_id, body, views)

        self._run(address, operation, "read", timeout_s, direct=None if span is None else (request_id, body, span))

    def write(
        self,
        address: Address,
        keys: Sequence[bytes],
        ranges: Sequence[tuple[int, int]],
        sources: Sequence[Any],
        tenant: str,
        grant: WriteGrant,
        *,
        timeout_s: float | None = None,
    ) -> None:
        """Copy each source into the server's segment at the range of the same index; the server's
        ``on_write(keys, ranges, tenant)`` has run when this returns.

        ``grant`` is the master's for exactly these keys at these ranges, for ``tenant``. Each
        source is a C-contiguous bytes-like object of exactly its range's length.
        """
        checked = wire.validate_ranges(list(ranges))
        views = buffer_views(sources, checked, "sources", as_bytes_view)
        request_id = next(self._request_ids)
        body = wire.encode(
            {
                "type": "write_request",
                "request_id": request_id,
                "ranges": [list(r) for r in checked],
                "keys": wire.validate_keys(list(keys)),
                "tenant": tenant,
                "grant": grant.to_wire(),
            }
        )
        self._run(
            address,
            lambda channel: _write_exchange(channel, request_id, body, views),
            "write",
            timeout_s,
        )

    def close(self, *, timeout_s: float = 10.0) -> None:
        """Close every cached endpoint. Idempotent; a closed client refuses further calls."""
        if self._closed:
            return
        self._closed = True
        unregister_for_shutdown(self)
        self._native.close()
        if ucx_loop_running():
            run_in_ucx_loop(self._close_on_loop(), timeout_s=timeout_s)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    async def _close_on_loop(self) -> None:
        for connection in list(self._connections.values()):
            connection.drop()
        self._connections.clear()

    def _run(
        self,
        address: Address,
        operation: _Operation,
        what: str,
        timeout_s: float | None,
        direct: tuple[int, bytes, memoryview] | None = None,
    ) -> None:
        """Run ``operation`` on the loop, or ``direct`` (a small read's id, request, span) on this thread."""
        if self._closed:
            raise TransportError("UcxClient is closed")
        checked_address = (str(address[0]), int(address[1]))
        register_for_shutdown(self, UcxClient._close_on_loop)
        request_timeout_s = self._timeout_s if timeout_s is None else timeout_s
        deadline = deadline_after(request_timeout_s)  # from the call: waiting for the lock and the loop counts
        connection = self._connections.get(checked_address)
        if connection is None:  # setdefault: two threads' first calls share one connection
            fresh = _ClientConnection(checked_address, self._connect_timeout_s, self._auth)
            connection = self._connections.setdefault(checked_address, fresh)
        with connection.caller_lock:
            channel = connection.channel
            # (The loop's lock is taken only while a request the caller gave up on still runs there.)
            if direct is not None and channel is not None and not connection.lock.locked() and not in_ucx_loop_thread():
                self._read_direct(connection, channel, direct, request_timeout_s)
                return
            try:
                run_in_ucx_loop(
                    self._request(connection, operation, what, request_timeout_s, deadline),
                    timeout_s=request_timeout_s + _LOOP_GRACE_S,
                )
            except TimeoutError:  # the loop itself did not answer in time (the request's own timeout is inside)
                raise TransportError(f"{what} {checked_address}: no answer from the UCX loop") from None

    def _read_direct(
        self, connection: _ClientConnection, channel: Channel, direct: tuple[int, bytes, memoryview], timeout_s: float
    ) -> None:
        request_id, body, span = direct
        try:
            read_now(channel, request_id, body, span, timeout_s)
        except DirectReadFailed as error:
            # The data's receive may still be posted: the endpoint goes before the destination is handed back.
            with contextlib.suppress(TimeoutError, RuntimeError):
                run_in_ucx_loop(connection.drop_on_loop(error.requests), timeout_s=_LOOP_GRACE_S)
            prefix = f"read {connection.address}"
            if error.kind == "refused":
                raise TransportError(f"{prefix} refused by the server: {error}") from None
            if error.kind == "timeout":
                raise PeerTimedOut(f"{prefix} timed out after {timeout_s} s") from None
            raise PeerUnreachable(f"{prefix} failed: {error}") from error.__cause__

    async def _request(
        self, connection: _ClientConnection, operation: _Operation, what: str, timeout_s: float, deadline: float
    ) -> None:
        address = connection.address
        try:
            await by_deadline(lambda: connection.run(operation), deadline)
        except _ServerRefused as error:
            raise TransportError(f"{what} {address} refused by the server: {error}") from None
        except _ConnectionFailed as error:
            raise PeerUnreachable(f"{what} {address} failed: {error}") from error.__cause__
        except asyncio.TimeoutError:  # a slow transfer, or one waiting its turn: the peer may be fine
            raise PeerTimedOut(f"{what} {address} timed out after {timeout_s} s") from None
