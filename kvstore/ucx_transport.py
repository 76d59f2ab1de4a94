"""Moving byte ranges in and out of a worker's KV segment over UCX (UCXX's asyncio API).

:class:`UcxServer` serves one segment: remote :class:`UcxClient` s read ranges out of it and write
ranges into it. Each request names many ``(offset, length)`` ranges; the bytes of all of them
travel as ONE UCX message, so a request costs three or four messages however many pages it names.

Messages on one endpoint (both directions use the endpoint's default UCX tag; tag matching keeps
their order)::

    control frame   [16-byte header | msgpack body]   header = magic "RTKV", version, flags, body length
                    (a body over 64 KiB goes as a header with FLAG_BODY_FOLLOWS, then the body alone)
    data message    the raw bytes of all the request's ranges, back to back, in request order

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

"invalid" is a message that is not msgpack or breaks its schema (the reply carries request_id -1),
a range outside the segment, or a request over the staging limit: the connection stays in step.
The reply and the data of a read are posted back to back, as are the "ready" reply and the data
receive of a write, so neither waits for the other's completion to reach Python.

The client side mirrors it: IDLE -> SEND_REQUEST -> WAIT_REPLY -> (read) RECV_DATA / (write)
SEND_DATA -> WAIT_REPLY -> IDLE. A refusal (``ok=False``) leaves the connection usable and becomes
a :class:`TransportError` carrying the server's message; anything else that goes wrong (timeout,
broken connection, malformed reply) also raises TransportError and drops the cached endpoint, so
the next call reconnects instead of reading a stale message from a desynchronised stream.

Zero copy: when a request's ranges are adjacent in the segment (each starts where the previous
ends, the common case for a contiguous object), the server sends straight from, or receives
straight into, a memoryview slice of the segment. Otherwise it gathers into (or receives into and
scatters from) a staging buffer from a per-process pool, reused by later requests. The client
likewise receives straight into the destination when a read has one range and sends straight
from the source when a write has one range, and stages otherwise. Staging costs one memcpy of the
payload; it buys one UCX message per request instead of one per range, which matters far more for
thousands of small pages (each UCX message costs tens of microseconds of Python and protocol work).

Threads and event loops: ucxx keeps one application context per process, and in the mode used
here (a UCX progress thread plus ucxx's "Python future" notifier) request completions are
delivered to the event loop the context was created on. So each process runs ONE dedicated
daemon thread with its own asyncio loop, created on first use, that owns every ucxx object:
UcxServer and UcxClient are synchronous facades submitting coroutines to it
(``asyncio.run_coroutine_threadsafe``), usable from any number of threads, and a process can be
both a server and a client. Without the notifier, ucxx completes requests by spinning on
``asyncio.sleep(0)``, which keeps a core busy for as long as a server waits on an idle connection.
Callbacks (``on_write``) run on that loop thread: keep them short, and never call a UcxClient
from one (that would deadlock; it raises RuntimeError instead).

Transport settings: UCX reads its ``UCX_*`` environment variables (``UCX_TLS``,
``UCX_NET_DEVICES``, ``UCX_RNDV_THRESH``...) when ucxx creates its context, i.e. on the first
UcxServer.start or UcxClient call in the process. :func:`init_ucx` sets them from a dict and must
run before that. Unless set, two defaults apply: ``UCX_TCP_CM_REUSEADDR=y`` (a server process
restarted on a fixed port can bind it at once, despite the old connections' TIME_WAIT) and
``UCX_WARN_UNUSED_ENV_VARS=n``. :func:`describe_transports` reports what UCX made available;
which transport a given transfer used is UCX's per-message-size choice and ucxx does not expose
it (set ``UCX_PROTO_INFO=y`` to have UCX log its selection). One choice worth knowing: ucxx's
listener endpoints always ask for peer-failure error handling, which UCX's shared-memory
transports lack by default, so two processes on one node talk over ``tcp/lo`` (about 1 GB/s
here) unless ``UCX_MM_ERROR_HANDLING=y`` lets UCX use ``sysv``/``posix`` shared memory (several
GB/s); ``cma`` is never eligible. Same-node peers of the KV store normally map each other's
segment directly anyway.
The server does no locking of ranges: a read racing a write of the same bytes sees either, as with
any shared memory; who may touch which range is the store's business, not the transport's.

Limits: a UCX tag receive accepts a message shorter than the posted buffer and ucxx does not
report the received length, so a peer that sends fewer data bytes than the request announced is
not detected; it can only leave stale bytes in ranges it was allowed to write anyway (staging
buffers are zeroed when allocated and only ever hold transfer payloads, so no other memory of the
process can leak in). A longer message is
detected (UCX truncation) and closes the connection. The UCX listener binds every interface
(ucxx offers no bind address); ``host`` is the address the server advertises.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import importlib
import itertools
import logging
import os
import re
import struct
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, Any, Final, TypeAlias, TypeVar

import numpy as np

from rayturn.kvstore import wire
from rayturn.kvstore.segment import as_bytes_view, as_writable_view

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "CONTROL_HEADER",
    "CONTROL_MAGIC",
    "CONTROL_SLOT_BYTES",
    "CONTROL_VERSION",
    "DEFAULT_MAX_STAGING_BYTES",
    "DEFAULT_TIMEOUT_S",
    "FLAG_BODY_FOLLOWS",
    "Address",
    "TransportError",
    "UcxClient",
    "UcxServer",
    "WriteCallback",
    "describe_transports",
    "init_ucx",
    "run_in_ucx_loop",
    "shutdown_ucx",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
Address: TypeAlias = tuple[str, int]
Range: TypeAlias = tuple[int, int]
WriteCallback: TypeAlias = Callable[[list[bytes], list[tuple[int, int]]], None]

DEFAULT_TIMEOUT_S: Final = 30.0
DEFAULT_CONNECT_TIMEOUT_S: Final = 5.0
DEFAULT_MAX_STAGING_BYTES: Final = 1 << 30
"""Largest non-contiguous request a server stages by default; contiguous requests need no staging."""

CONTROL_HEADER: Final = struct.Struct("<4sHHQ")
"""Control frame header: magic, version, flags, body length in bytes (little endian)."""
CONTROL_MAGIC: Final = b"RTKV"
CONTROL_VERSION: Final = 1
FLAG_BODY_FOLLOWS: Final = 1
"""Header flag: the body did not fit the control slot and follows as a message of its own."""
CONTROL_SLOT_BYTES: Final = 64 * 1024
"""Receive buffer for a control frame: a request of ~5000 ranges still fits, in one message."""
_INLINE_BODY_BYTES: Final = CONTROL_SLOT_BYTES - CONTROL_HEADER.size
_ZEROS: Final = bytes(CONTROL_SLOT_BYTES)
_UNPARSED_REQUEST_ID: Final = -1
_KEEP_STAGING_BYTES: Final = 256 << 20  # staging a process keeps for reuse, all connections together
# A blocking call waits this long past its request's own timeout (enforced on the loop, where the
# endpoint can be dropped cleanly) before giving up on the loop itself.
_LOOP_GRACE_S: Final = 5.0
_INIT_TIMEOUT_S: Final = 60.0
_ABORT_PERIOD_NS: Final = 10**9
_STOP_WAIT_S: Final = 5.0


class TransportError(RuntimeError):
    """A transfer failed: the server refused it (its message is included) or the connection broke."""


class _FramingError(Exception):
    """The byte stream cannot be trusted to find the next message: the connection must close."""


class _RequestRefused(Exception):
    """The server refuses one request; the connection stays in step and keeps serving."""


class _ProtocolError(Exception):
    """The peer answered out of protocol (wrong request id, wrong size)."""


def _ucxx() -> ModuleType:
    """ucxx, imported on first use: importing this module must stay cheap and free of UCX side effects."""
    return importlib.import_module("ucxx")


# -- the process's UCX loop ---------------------------------------------------------------------


class _UcxRuntime:
    """The dedicated daemon thread and asyncio loop that own every ucxx object of this process."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="rayturn-ucx-loop", daemon=True)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(_init_ucxx(), self.loop).result(timeout=_INIT_TIMEOUT_S)
        except BaseException:
            self._stop_loop(timeout_s=1.0)
            raise

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, coroutine: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def shutdown(self, timeout_s: float) -> None:
        """Close live servers and clients, stop ucxx's notifier thread, then stop the loop."""
        try:
            self.submit(_close_live_components()).result(timeout=timeout_s)
        except Exception as error:  # shutting down regardless: report, do not raise from atexit
            logger.warning("closing UCX servers and clients at shutdown failed: %s", error)
        _stop_notifier()
        self._stop_loop(timeout_s)

    def _stop_loop(self, timeout_s: float) -> None:
        with contextlib.suppress(RuntimeError):  # the loop may already be closed
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)


async def _init_ucxx() -> None:
    """Create ucxx's context on the UCX loop, so its notifier delivers completions to this loop."""
    ucxx = _ucxx()
    # Python futures: a completed request wakes the loop, instead of the loop polling with sleep(0).
    enable_python_future = None if "UCXPY_ENABLE_PYTHON_FUTURE" in os.environ else True
    try:
        ucxx.init(enable_python_future=enable_python_future)
    except RuntimeError as error:  # "UCX is already initiated": someone used ucxx here before us
        logger.warning("ucxx was initialised outside rayturn's UCX loop (%s); completions may be slow", error)


def _stop_notifier() -> None:
    """Stop ucxx's notifier thread, so it cannot wake up into a finalising interpreter."""
    ucxx = _ucxx()
    # ucxx's notifier blocks in C++ for up to a second per poll before it looks at its stop
    # request; waking it through the worker (not public API, hence the getattr) saves that second
    # at every process exit. Waking it re-arms its state, so it is marked stopped once more after
    # it has exited, or the worker's destructor warns that it is still running.
    worker = getattr(getattr(ucxx.core, "_ctx", None), "worker", None)
    if not getattr(worker, "enable_python_future", False):
        worker = None  # no notifier to wake (and nothing behind the call to wake it with)
    with contextlib.suppress(Exception):
        if worker is not None:
            worker.stop_request_notifier_thread()
        ucxx.stop_notifier_thread()
        if worker is not None:
            worker.stop_request_notifier_thread()


_UCX_DEFAULTS: Final = {
    # ucxx sets UCX_MEMTYPE_CACHE, which this UCX no longer knows: spare every process the warning.
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    # SO_REUSEADDR for listeners: a server restarted on its fixed port must not fail with "address
    # in use" for as long as its previous connections linger in TIME_WAIT.
    "UCX_TCP_CM_REUSEADDR": "y",
}
"""UCX settings this module applies unless the environment (or :func:`init_ucx`) says otherwise."""

_runtime_lock = threading.Lock()
_runtime: _UcxRuntime | None = None
_runtime_was_shut_down = False
_live_components: weakref.WeakSet[UcxServer | UcxClient] = weakref.WeakSet()


def _get_runtime() -> _UcxRuntime:
    global _runtime
    with _runtime_lock:
        if _runtime_was_shut_down:
            raise RuntimeError("the UCX runtime of this process was shut down (shutdown_ucx); it cannot restart")
        if _runtime is None:
            for name, value in _UCX_DEFAULTS.items():
                os.environ.setdefault(name, value)
            _runtime = _UcxRuntime()
            atexit.register(shutdown_ucx)
        elif _runtime.pid != os.getpid():
            raise RuntimeError("UCX was started before this process forked; use the 'spawn' start method")
        return _runtime


def _running_runtime() -> _UcxRuntime | None:
    with _runtime_lock:
        return _runtime if _runtime is not None and _runtime.pid == os.getpid() else None


def run_in_ucx_loop(coroutine: Coroutine[Any, Any, _T], *, timeout_s: float) -> _T:
    """Run ``coroutine`` on this process's UCX loop thread and return its result.

    Every ucxx call must run on that loop (see the module docstring); this is how code outside
    this module gets there. Raises TimeoutError (after cancelling the coroutine) when it takes
    longer than ``timeout_s``, and RuntimeError when called from the loop thread itself, where
    waiting would deadlock.
    """
    try:
        runtime = _get_runtime()
        if runtime.in_loop_thread():
            raise RuntimeError("blocking UCX call made from the UCX loop thread (an on_write callback?)")
    except BaseException:
        coroutine.close()
        raise
    future = runtime.submit(coroutine)
    try:
        return future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"UCX operation did not finish within {timeout_s} s") from None
    except BaseException:
        future.cancel()  # e.g. KeyboardInterrupt: do not leave the coroutine running unobserved
        raise


def init_ucx(config: Mapping[str, str] | None = None) -> None:
    """Set UCX options for this process, as ``UCX_*`` environment variables; run it before first use.

    Keys are UCX option names with or without the ``UCX_`` prefix (``{"TLS": "tcp,self"}`` and
    ``{"UCX_TLS": "tcp,self"}`` are the same), or ucxx's own ``UCXPY_*`` variables; they override
    the environment. UCX reads them once, when the process's UCX context is created on the first
    :meth:`UcxServer.start` or :class:`UcxClient` call, so this raises RuntimeError if UCX is
    already running here. Processes started afterwards inherit them.
    """
    updates: dict[str, str] = {}
    for key, value in (config or {}).items():
        name = key if key.startswith(("UCX_", "UCXPY_")) else f"UCX_{key}"
        if not re.fullmatch(r"UCX(PY)?_[A-Z0-9_]+", name):
            raise ValueError(f"{key!r} is not a UCX option name (expected e.g. 'TLS' or 'UCX_TLS')")
        updates[name] = str(value)
    with _runtime_lock:
        if _runtime is not None or _runtime_was_shut_down:
            raise RuntimeError("init_ucx must run before the first UcxServer/UcxClient use in this process")
        os.environ.update(updates)


def shutdown_ucx(timeout_s: float = 5.0) -> None:
    """Close every live UcxServer and UcxClient and stop this process's UCX loop; idempotent.

    Runs automatically at interpreter exit. UCX cannot be used again in this process afterwards
    (ucxx's context stays bound to the stopped loop).
    """
    global _runtime, _runtime_was_shut_down
    with _runtime_lock:
        if _runtime is not None and _runtime.in_loop_thread():
            raise RuntimeError("shutdown_ucx cannot run on the UCX loop thread it would stop")
        runtime, _runtime = _runtime, None
        if runtime is None:
            return
        _runtime_was_shut_down = True
    if runtime.pid == os.getpid():
        runtime.shutdown(timeout_s)


async def _close_live_components() -> None:
    for component in list(_live_components):
        try:
            await component._close_on_loop()
        except Exception:  # shutting down regardless: one broken component must not keep the rest open
            logger.exception("closing %r at UCX shutdown failed", component)


def describe_transports(*, timeout_s: float = 10.0) -> str:
    """UCX's version, its transport setting and the transport resources it made available (best effort).

    Before UCX has started in this process this says so and reports the environment's setting.
    """
    runtime = _running_runtime()
    if runtime is None:
        tls = os.environ.get("UCX_TLS", "all (default)")
        return f"UCX not started in this process yet (starts on first use); UCX_TLS={tls}"
    return run_in_ucx_loop(_describe_transports(), timeout_s=timeout_s)


async def _describe_transports() -> str:
    ucxx = _ucxx()
    resources = re.findall(r"resource\s+\d+\s*:.*flags\s+\S+\s+(\S+)", ucxx.get_ucp_context_info())
    tls = ucxx.get_config().get("TLS", "?")
    shared_memory = (
        "posix/sysv eligible (UCX_MM_ERROR_HANDLING=y)"
        if os.environ.get("UCX_MM_ERROR_HANDLING", "n").lower() in ("y", "yes", "on", "1", "true")
        else "shared memory NOT eligible for these error-handling endpoints (set UCX_MM_ERROR_HANDLING=y), "
        "so same-node peers use tcp"
    )
    return (
        f"UCX {ucxx.__ucx_version__} (ucxx {ucxx.__version__}); UCX_TLS={tls}; "
        f"transports available: {', '.join(sorted(ucxx.get_active_transports()))} "
        f"(resources: {', '.join(resources)}); {shared_memory}; UCX picks one per transfer by size and "
        "peer and ucxx does not report which: set UCX_PROTO_INFO=y to log UCX's choices"
    )


# -- framing and helpers shared by both sides ---------------------------------------------------


async def _within(awaitable: Awaitable[_T], timeout_s: float | None) -> _T:
    if timeout_s is None:
        return await awaitable
    return await asyncio.wait_for(awaitable, timeout_s)


def _is_truncation(error: BaseException) -> bool:
    return isinstance(error, _ucxx().exceptions.UCXMessageTruncatedError)


def _abort(endpoint: Any) -> None:
    """Close an endpoint now; UCX cancels its outstanding requests, so no late write lands in a buffer."""
    try:
        endpoint.abort(period=_ABORT_PERIOD_NS)
    except Exception as error:  # already closed or broken: nothing left to release
        logger.debug("aborting UCX endpoint: %s", error)


class _Channel:
    """Control frames and data messages on one ucxx endpoint."""

    def __init__(self, endpoint: Any) -> None:
        self.endpoint = endpoint
        self._slot = bytearray(CONTROL_SLOT_BYTES)
        self._dirty_bytes = 0

    async def send_control(self, body: bytes) -> None:
        if len(body) <= _INLINE_BODY_BYTES:
            await self.endpoint.send(CONTROL_HEADER.pack(CONTROL_MAGIC, CONTROL_VERSION, 0, len(body)) + body)
            return
        await self.endpoint.send(CONTROL_HEADER.pack(CONTROL_MAGIC, CONTROL_VERSION, FLAG_BODY_FOLLOWS, len(body)))
        await self.endpoint.send(body)

    async def send_reply(self, request_id: int, *, ok: bool, total_bytes: int = 0, error: str | None = None) -> None:
        message: dict[str, Any] = {"type": "reply", "request_id": request_id, "ok": ok, "total_bytes": total_bytes}
        if error is not None:
            message["error"] = wire.truncate_error(error)
        await self.send_control(wire.encode(message))

    async def recv_control(
        self, *, expected_type: str | None = None, body_timeout_s: float | None = None
    ) -> dict[str, Any]:
        """The next control message: _FramingError if the frame is unusable, WireError if only its body is."""
        self._clear_slot()
        try:
            await self.endpoint.recv(self._slot)
        except Exception as error:
            if _is_truncation(error):
                raise _FramingError(f"control frame larger than the {CONTROL_SLOT_BYTES}-byte slot") from None
            raise
        magic, version, flags, body_bytes = CONTROL_HEADER.unpack_from(self._slot)
        self._dirty_bytes = CONTROL_HEADER.size + min(body_bytes, _INLINE_BODY_BYTES)
        _check_header(magic, version, flags, body_bytes)
        if flags & FLAG_BODY_FOLLOWS:
            return wire.decode(await self._recv_body(body_bytes, body_timeout_s), expected_type)
        with memoryview(self._slot) as slot:
            return wire.decode(slot[CONTROL_HEADER.size : CONTROL_HEADER.size + body_bytes], expected_type)

    def _clear_slot(self) -> None:
        # A frame shorter than its header announces leaves the rest of the slot as it was: zeros
        # there make msgpack report trailing bytes instead of decoding the previous message's tail.
        if self._dirty_bytes:
            self._slot[: self._dirty_bytes] = memoryview(_ZEROS)[: self._dirty_bytes]
            self._dirty_bytes = 0

    async def _recv_body(self, body_bytes: int, timeout_s: float | None) -> bytearray:
        body = bytearray(body_bytes)
        try:
            await _within(self.endpoint.recv(body), timeout_s)
        except Exception as error:
            if _is_truncation(error):
                raise _FramingError(f"control body longer than the {body_bytes} bytes announced") from None
            raise
        return body

    async def send_data(self, data: memoryview, timeout_s: float | None = None) -> None:
        await _within(self.endpoint.send(data), timeout_s)

    async def recv_data(self, into: memoryview, timeout_s: float | None = None) -> None:
        try:
            await _within(self.endpoint.recv(into), timeout_s)
        except Exception as error:
            if _is_truncation(error):
                raise _FramingError(f"data message longer than the {into.nbytes} bytes announced") from None
            raise


def _check_header(magic: bytes, version: int, flags: int, body_bytes: int) -> None:
    if magic != CONTROL_MAGIC:
        raise _FramingError(f"not a control frame (magic {magic!r}, expected {CONTROL_MAGIC!r})")
    if version != CONTROL_VERSION:
        raise _FramingError(f"control frame version {version}, this side speaks {CONTROL_VERSION}")
    if flags & ~FLAG_BODY_FOLLOWS:
        raise _FramingError(f"unknown control frame flags {flags:#x}")
    if flags & FLAG_BODY_FOLLOWS and body_bytes > wire.MAX_CONTROL_BYTES:
        raise _FramingError(f"announced control message of {body_bytes} bytes exceeds {wire.MAX_CONTROL_BYTES}")
    if not flags & FLAG_BODY_FOLLOWS and body_bytes > _INLINE_BODY_BYTES:
        raise _FramingError(f"inline control body of {body_bytes} bytes cannot fit the {CONTROL_SLOT_BYTES}-byte frame")


class _StagingPool:
    """Reusable gather/scatter buffers shared by every connection of the process.

    Shared rather than per connection, so that what is kept between requests is bounded per
    process (``keep_bytes``), not multiplied by the number of peers. Used only on the UCX loop
    thread, hence no lock.
    """

    def __init__(self, keep_bytes: int) -> None:
        self._free: list[np.ndarray] = []
        self._keep_bytes = keep_bytes

    @contextlib.contextmanager
    def borrow(self, num_bytes: int) -> Iterator[memoryview]:
        """``num_bytes`` of staging for the duration of one transfer.

        The buffer goes back to the pool only if the block ends normally: after a failure UCX may
        still be writing into it (until the endpoint's abort has cancelled the receive).
        """
        array = self._take(num_bytes)
        yield array.data[:num_bytes]
        self._give_back(array)

    def _take(self, num_bytes: int) -> np.ndarray:
        fitting = [index for index, array in enumerate(self._free) if array.nbytes >= num_bytes]
        if fitting:
            return self._free.pop(min(fitting, key=lambda index: self._free[index].nbytes))
        # Zeroed, not np.empty: a peer that sends fewer bytes than announced (undetectable, see
        # the module docstring) must find zeros here, never leftovers of this process's heap.
        return np.zeros(num_bytes, dtype=np.uint8)

    def _give_back(self, array: np.ndarray) -> None:
        self._free.append(array)
        self._free.sort(key=lambda kept: kept.nbytes)
        while sum(kept.nbytes for kept in self._free) > self._keep_bytes:
            self._free.pop()  # the largest goes first


_staging_pool = _StagingPool(keep_bytes=_KEEP_STAGING_BYTES)


def _contiguous_span(ranges: Sequence[Range]) -> Range | None:
    """``(start, end)`` when every range starts where the previous ended, else None."""
    start = end = ranges[0][0]
    for offset, length in ranges:
        if offset != end:
            return None
        end += length
    return (start, end)


def _gather(source: memoryview, ranges: Sequence[Range], out: memoryview) -> None:
    position = 0
    for offset, length in ranges:
        out[position : position + length] = source[offset : offset + length]
        position += length


def _scatter(data: memoryview, ranges: Sequence[Range], target: memoryview) -> None:
    position = 0
    for offset, length in ranges:
        target[offset : offset + length] = data[position : position + length]
        position += length


def _gather_views(views: Sequence[memoryview], out: memoryview) -> None:
    position = 0
    for view in views:
        out[position : position + view.nbytes] = view
        position += view.nbytes


def _scatter_views(data: memoryview, views: Sequence[memoryview]) -> None:
    position = 0
    for view in views:
        view[:] = data[position : position + view.nbytes]
        position += view.nbytes


# -- server -----------------------------------------------------------------------------------


class UcxServer:
    """Serves reads and writes of one segment to :class:`UcxClient` s over UCX.

    ``buffer`` is the segment: any writable, C-contiguous buffer (memoryview, numpy array,
    bytearray) of ``capacity`` bytes; the server keeps a view of it, so it must outlive the
    server. ``on_write(keys, ranges)`` runs on the UCX loop thread after a write's bytes have
    fully landed; if it raises, the client gets a TransportError saying so. Non-contiguous
    requests over ``max_staging_bytes`` are refused; once a request has been accepted, each of
    its data and body transfers must arrive within ``io_timeout_s`` or the connection closes.
    """

    def __init__(
        self,
        buffer: memoryview | bytearray | np.ndarray,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        on_write: WriteCallback | None = None,
        max_staging_bytes: int = DEFAULT_MAX_STAGING_BYTES,
        io_timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if not 0 <= port <= 0xFFFF:
            raise ValueError(f"port must be in 0..65535, got {port}")
        self._segment = as_writable_view(buffer)
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
            self._state = "running"
            _live_components.add(self)
            return self._address

    def stop(self, *, timeout_s: float = 10.0) -> None:
        """Stop listening and close every connection. Idempotent; a stopped server stays stopped."""
        with self._state_lock:
            was_running, self._state = self._state == "running", "stopped"
        _live_components.discard(self)
        if was_running and _running_runtime() is not None:
            run_in_ucx_loop(self._close_on_loop(), timeout_s=timeout_s)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    async def _listen(self) -> Address:
        self._listener = _ucxx().create_listener(self._serve_endpoint, port=self._port)
        return (self._host, int(self._listener.port))

    async def _close_on_loop(self) -> None:
        listener, self._listener = self._listener, None
        tasks = list(self._connections.values())
        for endpoint in list(self._connections):
            _abort(endpoint)  # first: cancels UCX requests still aimed at the segment
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
            _abort(endpoint)
            return
        self._connections[endpoint] = task
        try:
            await _ServerConnection(endpoint, self).serve()
        except Exception as error:  # the peer left or broke the protocol: only this connection ends
            logger.debug("UCX connection closed: %s: %s", type(error).__name__, error)
        finally:
            self._connections.pop(endpoint, None)
            _abort(endpoint)

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
        if total_bytes > self._max_staging_bytes and _contiguous_span(ranges) is None:
            raise _RequestRefused(
                f"non-contiguous request of {total_bytes} bytes exceeds this server's staging limit of "
                f"{self._max_staging_bytes} bytes; split it"
            )
        return total_bytes

    def _notify_write(self, keys: list[bytes], ranges: list[Range]) -> None:
        if self._on_write is None:
            return
        try:
            self._on_write(keys, ranges)
        except Exception as error:
            logger.exception("on_write callback failed")
            raise _RequestRefused(f"bytes landed but the server's on_write failed: {_describe_error(error)}") from error


class _ServerConnection:
    """One client connection on the server: one request at a time, in order."""

    def __init__(self, endpoint: Any, server: UcxServer) -> None:
        self._channel = _Channel(endpoint)
        self._server = server

    async def serve(self) -> None:
        while True:
            request = await self._next_request()
            if request is not None:
                await self._handle(request)

    async def _next_request(self) -> dict[str, Any] | None:
        try:
            # No timeout: an idle connection may wait for its next request indefinitely.
            return await self._channel.recv_control(body_timeout_s=self._server._io_timeout_s)
        except wire.WireError as error:  # the frame was sound, only its message was not: keep serving
            await self._channel.send_reply(_UNPARSED_REQUEST_ID, ok=False, error=f"malformed request: {error}")
            return None
        except _FramingError as error:  # cannot find the next message boundary: say why, then hang up
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    self._channel.send_reply(_UNPARSED_REQUEST_ID, ok=False, error=f"closing connection: {error}"),
                    timeout=1.0,
                )
            raise

    async def _handle(self, request: dict[str, Any]) -> None:
        request_id = request.get("request_id", _UNPARSED_REQUEST_ID)
        if isinstance(request_id, bool) or not isinstance(request_id, int):
            request_id = _UNPARSED_REQUEST_ID  # another module's message type, without an id
        try:
            if request["type"] == "read_request":
                await self._serve_read(request_id, request["ranges"])
            elif request["type"] == "write_request":
                await self._serve_write(request_id, request["keys"], request["ranges"])
            else:
                raise _RequestRefused(f"this server does not handle {request['type']!r} messages")
        except _RequestRefused as error:
            await self._channel.send_reply(request_id, ok=False, error=str(error))

    async def _serve_read(self, request_id: int, ranges: list[Range]) -> None:
        total_bytes = self._server._check_request(ranges)
        segment = self._server._segment
        span = _contiguous_span(ranges)
        if span is not None:
            await self._send_read(request_id, segment[span[0] : span[1]])  # zero copy: straight from the segment
            return
        with _staging_pool.borrow(total_bytes) as data:
            _gather(segment, ranges, data)
            await self._send_read(request_id, data)

    async def _send_read(self, request_id: int, data: memoryview) -> None:
        # Reply and data are posted back to back (UCX keeps their order): the data does not wait
        # for the reply's completion to make its way back to this loop.
        await asyncio.gather(
            self._channel.send_reply(request_id, ok=True, total_bytes=data.nbytes),
            self._channel.send_data(data, self._server._io_timeout_s),
        )

    async def _serve_write(self, request_id: int, keys: list[bytes], ranges: list[Range]) -> None:
        total_bytes = self._server._check_request(ranges)
        segment = self._server._segment
        span = _contiguous_span(ranges)
        if span is not None:
            await self._recv_write(request_id, segment[span[0] : span[1]])  # zero copy: straight into the segment
        else:
            with _staging_pool.borrow(total_bytes) as data:
                await self._recv_write(request_id, data)
                _scatter(data, ranges, segment)
        self._server._notify_write(keys, ranges)
        await self._channel.send_reply(request_id, ok=True, total_bytes=total_bytes)  # "done"

    async def _recv_write(self, request_id: int, into: memoryview) -> None:
        await asyncio.gather(
            self._channel.send_reply(request_id, ok=True, total_bytes=into.nbytes),  # "ready: send the data"
            self._channel.recv_data(into, self._server._io_timeout_s),
        )


# -- client -----------------------------------------------------------------------------------

_Operation: TypeAlias = Callable[[_Channel], Awaitable[None]]


class _ServerRefused(Exception):
    """The server answered ok=False: the request failed, the connection is still in step."""


class _ConnectionFailed(Exception):
    """Connecting or talking to the server failed (its own timeouts included); the endpoint is gone."""


class _ClientConnection:
    """The cached endpoint to one server, with the lock that keeps its requests one at a time."""

    def __init__(self, address: Address, connect_timeout_s: float) -> None:
        self.address = address
        self.lock = asyncio.Lock()
        self._connect_timeout_s = connect_timeout_s
        self._channel: _Channel | None = None

    async def run(self, operation: _Operation) -> None:
        async with self.lock:
            try:
                channel = self._channel or await self._connect()
                await operation(channel)
            except _ServerRefused:
                raise
            except _ConnectionFailed:
                raise
            except Exception as error:  # the stream's state is unknown: never reuse it
                self.drop()
                # Wrapped, so that a TimeoutError from inside ucxx is not taken for the request's own.
                raise _ConnectionFailed(_describe_error(error)) from error
            except BaseException:  # cancelled by the request's timeout, mid-exchange
                self.drop()
                raise

    async def _connect(self) -> _Channel:
        host, port = self.address
        try:
            endpoint = await _ucxx().create_endpoint(host, port, connect_timeout=self._connect_timeout_s)
        except (TimeoutError, asyncio.TimeoutError):  # ucxx's handshake timed out: no UCX listener answered
            raise _ConnectionFailed(f"no UCX handshake from {host}:{port} within {self._connect_timeout_s} s") from None
        except Exception as error:
            raise _ConnectionFailed(f"cannot connect to {host}:{port}: {_describe_error(error)}") from error
        self._channel = _Channel(endpoint)
        return self._channel

    def drop(self) -> None:
        if self._channel is not None:
            _abort(self._channel.endpoint)
            self._channel = None


async def _send_and_expect_ok(channel: _Channel, request_id: int, send: Awaitable[None]) -> int:
    """Run ``send`` and receive the reply that answers it; the reply's ``total_bytes``.

    Both are posted at once, so the reply's receive is waiting before the send has even
    completed. _ServerRefused if the reply is a refusal.
    """
    _, reply = await asyncio.gather(send, channel.recv_control(expected_type="reply"))
    # A refusal of a request the server could not even parse carries id -1; any other stranger
    # means the stream is out of step, and the connection must go.
    if reply["request_id"] not in (request_id, _UNPARSED_REQUEST_ID):
        raise _ProtocolError(f"got the reply to request {reply['request_id']} while waiting for {request_id}")
    if not reply["ok"]:
        raise _ServerRefused(reply.get("error") or "the server refused the request without saying why")
    if reply["request_id"] != request_id:
        raise _ProtocolError(f"got an ok reply with request id {reply['request_id']} while waiting for {request_id}")
    total_bytes: int = reply["total_bytes"]
    return total_bytes


async def _read_exchange(channel: _Channel, request_id: int, body: bytes, views: list[memoryview]) -> None:
    total_bytes = await _send_and_expect_ok(channel, request_id, channel.send_control(body))
    expected_bytes = sum(view.nbytes for view in views)
    if total_bytes != expected_bytes:
        raise _ProtocolError(f"server announced {total_bytes} bytes for a read of {expected_bytes}")
    if len(views) == 1:
        await channel.recv_data(views[0])  # zero copy: straight into the caller's destination
        return
    with _staging_pool.borrow(total_bytes) as data:
        await channel.recv_data(data)
        _scatter_views(data, views)


async def _write_exchange(channel: _Channel, request_id: int, body: bytes, views: list[memoryview]) -> None:
    total_bytes = await _send_and_expect_ok(channel, request_id, channel.send_control(body))
    expected_bytes = sum(view.nbytes for view in views)
    if total_bytes != expected_bytes:
        raise _ProtocolError(f"server announced {total_bytes} bytes for a write of {expected_bytes}")
    if len(views) == 1:
        await _send_and_expect_ok(channel, request_id, channel.send_data(views[0]))  # zero copy: from the source
        return
    with _staging_pool.borrow(total_bytes) as data:
        _gather_views(views, data)
        await _send_and_expect_ok(channel, request_id, channel.send_data(data))


class UcxClient:
    """Reads ranges from and writes ranges to remote :class:`UcxServer` s; a blocking, thread-safe facade.

    One endpoint is cached per server address; requests to one server run one at a time (an
    asyncio lock per endpoint), requests to different servers run concurrently. Every call takes
    ``timeout_s`` (default: the client's) and raises :class:`TransportError` when it expires.
    """

    def __init__(
        self, *, timeout_s: float = DEFAULT_TIMEOUT_S, connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    ) -> None:
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._request_ids = itertools.count(1)
        self._closed = False
        self._connections: dict[Address, _ClientConnection] = {}  # touched only on the UCX loop

    def read(
        self,
        address: Address,
        ranges: Sequence[tuple[int, int]],
        dests: Sequence[Any],
        *,
        timeout_s: float | None = None,
    ) -> None:
        """Copy each range of the server's segment into the destination at the same index.

        Each destination is a writable, C-contiguous buffer (bytearray, numpy array, memoryview)
        of exactly its range's length; ValueError naming the index, before any traffic, if not.
        """
        checked = wire.validate_ranges(list(ranges))
        views = _buffer_views(dests, checked, "dests", as_writable_view)
        request_id = next(self._request_ids)
        body = wire.encode({"type": "read_request", "request_id": request_id, "ranges": [list(r) for r in checked]})
        self._run(
            address,
            lambda channel: _read_exchange(channel, request_id, body, views),
            "read",
            timeout_s,
        )

    def write(
        self,
        address: Address,
        keys: Sequence[bytes],
        ranges: Sequence[tuple[int, int]],
        sources: Sequence[Any],
        *,
        timeout_s: float | None = None,
    ) -> None:
        """Copy each source into the server's segment at the range of the same index; the server's
        ``on_write(keys, ranges)`` has run when this returns.

        Each source is a C-contiguous bytes-like object of exactly its range's length.
        """
        checked = wire.validate_ranges(list(ranges))
        views = _buffer_views(sources, checked, "sources", as_bytes_view)
        request_id = next(self._request_ids)
        body = wire.encode(
            {
                "type": "write_request",
                "request_id": request_id,
                "ranges": [list(r) for r in checked],
                "keys": wire.validate_keys(list(keys)),
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
        _live_components.discard(self)
        if _running_runtime() is not None:
            run_in_ucx_loop(self._close_on_loop(), timeout_s=timeout_s)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    async def _close_on_loop(self) -> None:
        for connection in self._connections.values():
            connection.drop()
        self._connections.clear()

    def _run(self, address: Address, operation: _Operation, what: str, timeout_s: float | None) -> None:
        if self._closed:
            raise TransportError("UcxClient is closed")
        host, port = address
        checked_address = (str(host), int(port))
        _live_components.add(self)
        request_timeout_s = self._timeout_s if timeout_s is None else timeout_s
        try:
            run_in_ucx_loop(
                self._request(checked_address, operation, what, request_timeout_s),
                timeout_s=request_timeout_s + _LOOP_GRACE_S,
            )
        except TimeoutError:  # the loop itself did not answer in time (the request's own timeout is inside)
            raise TransportError(f"{what} {checked_address}: no answer from the UCX loop") from None

    async def _request(self, address: Address, operation: _Operation, what: str, timeout_s: float) -> None:
        connection = self._connections.get(address)
        if connection is None:
            connection = self._connections[address] = _ClientConnection(address, self._connect_timeout_s)
        try:
            await asyncio.wait_for(connection.run(operation), timeout_s)
        except _ServerRefused as error:
            raise TransportError(f"{what} {address} refused by the server: {error}") from None
        except _ConnectionFailed as error:
            raise TransportError(f"{what} {address} failed: {error}") from error.__cause__
        except asyncio.TimeoutError:
            raise TransportError(f"{what} {address} timed out after {timeout_s} s") from None


def _describe_error(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _buffer_views(
    buffers: Sequence[Any], ranges: list[Range], what: str, as_view: Callable[[object], memoryview]
) -> list[memoryview]:
    """Byte views of ``buffers``, each checked against its range's length; errors name the index."""
    if len(buffers) != len(ranges):
        raise ValueError(f"{len(ranges)} ranges but {len(buffers)} {what}")
    views = []
    for index, (buffer, (_, length)) in enumerate(zip(buffers, ranges)):
        try:
            view = as_view(buffer)
        except (TypeError, ValueError) as error:
            raise type(error)(f"{what}[{index}]: {error}") from error
        if view.nbytes != length:
            raise ValueError(f"{what}[{index}] holds {view.nbytes} bytes but range {index} has length {length}")
        views.append(view)
    return views
