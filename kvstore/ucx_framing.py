"""What travels on one UCX endpoint, and the staging that packs many ranges into one message.

Messages on one endpoint (both directions use the endpoint's default UCX tag; tag matching keeps
their order)::

    control frame   [16-byte header | msgpack body]   header = magic "RTKV", version, flags, body length
                    (a body over 64 KiB goes as a header with FLAG_BODY_FOLLOWS, then the body alone)
    data message    the raw bytes of all the request's ranges, back to back, in request order

Zero copy: when a request's ranges are adjacent in the segment (each starts where the previous
ends, the common case for a contiguous object), the server sends straight from, or receives
straight into, a memoryview slice of the segment. Otherwise it gathers into (or receives into and
scatters from) a staging buffer from a per-process pool, reused by later requests. The client
likewise receives straight into the destination when a read has one range and sends straight
from the source when a write has one range, and stages otherwise. Staging costs one memcpy of the
payload; it buys one UCX message per request instead of one per range, which matters far more for
thousands of small pages (each UCX message costs tens of microseconds of Python and protocol work).

Limits: a UCX tag receive accepts a message shorter than the posted buffer and ucxx does not
report the received length, so a peer that sends fewer data bytes than the request announced is
not detected; it can only leave stale bytes in ranges it was allowed to write anyway (staging
buffers are zeroed when allocated and only ever hold transfer payloads, so no other memory of the
process can leak in). A longer message is detected (UCX truncation) and closes the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import struct
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, Final, TypeAlias, TypeVar

import numpy as np

from rayturn.kvstore import wire
from rayturn.kvstore.ucx_handshake import CLOSE_PERIOD_NS
from rayturn.kvstore.ucx_runtime import load_ucxx

__all__ = [
    "CONTROL_HEADER",
    "CONTROL_MAGIC",
    "CONTROL_SLOT_BYTES",
    "CONTROL_VERSION",
    "DEFAULT_TIMEOUT_S",
    "FLAG_BODY_FOLLOWS",
    "INLINE_BODY_BYTES",
    "UNPARSED_REQUEST_ID",
    "Address",
    "Channel",
    "FramingError",
    "Range",
    "StagingPool",
    "abort_endpoint",
    "adjacent_span",
    "buffer_views",
    "contiguous_span",
    "describe_error",
    "gather",
    "gather_views",
    "scatter",
    "scatter_views",
    "staging_pool",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
Address: TypeAlias = tuple[str, int]
Range: TypeAlias = tuple[int, int]

DEFAULT_TIMEOUT_S: Final = 30.0

CONTROL_HEADER: Final = struct.Struct("<4sHHQ")
"""Control frame header: magic, version, flags, body length in bytes (little endian)."""
CONTROL_MAGIC: Final = b"RTKV"
CONTROL_VERSION: Final = 1
FLAG_BODY_FOLLOWS: Final = 1
"""Header flag: the body did not fit the control slot and follows as a message of its own."""
CONTROL_SLOT_BYTES: Final = 64 * 1024
"""Receive buffer for a control frame: a request of ~5000 ranges still fits, in one message."""
UNPARSED_REQUEST_ID: Final = -1
"""The request id of a reply to a request the server could not parse."""
INLINE_BODY_BYTES: Final = CONTROL_SLOT_BYTES - CONTROL_HEADER.size
"""Largest control body that travels inside its frame."""
_ZEROS: Final = bytes(CONTROL_SLOT_BYTES)
_KEEP_STAGING_BYTES: Final = 256 << 20  # staging a process keeps for reuse, all connections together


class FramingError(Exception):
    """The byte stream cannot be trusted to find the next message: the connection must close."""


async def _within(awaitable: Awaitable[_T], timeout_s: float | None) -> _T:
    if timeout_s is None:
        return await awaitable
    return await asyncio.wait_for(awaitable, timeout_s)


def _is_truncation(error: BaseException) -> bool:
    return isinstance(error, load_ucxx().exceptions.UCXMessageTruncatedError)


def abort_endpoint(endpoint: Any) -> None:
    """Close an endpoint now; UCX cancels its outstanding requests, so no late write lands in a buffer."""
    try:
        endpoint.abort(period=CLOSE_PERIOD_NS)
    except Exception as error:  # already closed or broken: nothing left to release
        logger.debug("aborting UCX endpoint: %s", error)


def describe_error(error: BaseException) -> str:
    """``"TypeName: message"`` (just the type's name when the message is empty), for error texts."""
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class Channel:
    """Control frames and data messages on one ucxx endpoint."""

    def __init__(self, endpoint: Any) -> None:
        self.endpoint = endpoint
        self._slot = bytearray(CONTROL_SLOT_BYTES)
        self._dirty_bytes = 0
        self._posted_frame = b""
        self._body_receiving: bytearray | None = None

    async def send_control(self, body: bytes) -> None:
        if len(body) <= INLINE_BODY_BYTES:
            await self.endpoint.send(_inline_frame(body))
            return
        await self.endpoint.send(CONTROL_HEADER.pack(CONTROL_MAGIC, CONTROL_VERSION, FLAG_BODY_FOLLOWS, len(body)))
        await self.endpoint.send(body)

    async def send_reply(
        self,
        request_id: int,
        *,
        ok: bool,
        total_bytes: int = 0,
        error: str | None = None,
        **extra: Any,
    ) -> None:
        """A reply; ``extra``: the optional fields of the accepting reply (``proof``, ``fast_port``)."""
        await self.send_control(_reply_body(request_id, ok=ok, total_bytes=total_bytes, error=error, **extra))

    async def send_reply_and_data(self, request_id: int, data: memoryview, timeout_s: float | None) -> None:
        """An ok reply announcing ``data``, then ``data``: both posted at once (UCX keeps their order) and awaited
        together, within one timeout.

        One completion to wait for instead of two awaited sends, each a task and a timeout of its
        own: a one-page read's reply gets out a loop turn sooner.
        """
        endpoint, array, send_tag, _ = self._raw()
        # Kept by the channel: ucxx's progress thread may still send from it if the wait is cut short.
        self._posted_frame = _inline_frame(_reply_body(request_id, ok=True, total_bytes=data.nbytes))
        requests = (endpoint.tag_send(array(self._posted_frame), send_tag), endpoint.tag_send(array(data), send_tag))
        await _within(asyncio.gather(*(request.future for request in requests)), timeout_s)
        for request in requests:
            request.check_error()

    async def recv_control(
        self, *, expected_type: str | None = None, body_timeout_s: float | None = None
    ) -> dict[str, Any]:
        """The next control message: FramingError if the frame is unusable, WireError if only its body is."""
        self._clear_slot()
        try:
            await self.endpoint.recv(self._slot)
        except Exception as error:
            if _is_truncation(error):
                raise FramingError(f"control frame larger than the {CONTROL_SLOT_BYTES}-byte slot") from None
            raise
        flags, body_bytes = self._check_slot()
        if flags & FLAG_BODY_FOLLOWS:
            return wire.decode(await self._recv_body(body_bytes, body_timeout_s), expected_type)
        return self._decode_slot(body_bytes, expected_type)

    def post_read_now(self, request: bytes, into: memoryview) -> tuple[Any, ...]:
        """Post, from the calling thread, a read's control frame and the receives of its reply and its data.

        ucxx's request objects, in that order; the caller polls them (``completed``) and, once all
        are, takes the reply with :meth:`inline_reply`. For a request with an inline body: the
        direct read path's, see :mod:`rayturn.kvstore.ucx_direct`.
        """
        self._clear_slot()
        endpoint, array, send_tag, recv_tag = self._raw()
        if len(request) > INLINE_BODY_BYTES:
            raise ValueError(f"a request of {len(request)} bytes does not fit an inline control frame")
        # Kept by the channel: ucxx's progress thread sends from this memory after this call returns.
        self._posted_frame = _inline_frame(request)
        return (
            endpoint.tag_send(array(self._posted_frame), send_tag),
            endpoint.tag_recv(array(self._slot), recv_tag),
            endpoint.tag_recv(array(into), recv_tag),
        )

    def _raw(self) -> tuple[Any, Any, Any, Any]:
        """ucxx's low-level endpoint (checked for errors), its buffer type, and the send and receive tags agreed on
        connecting: posting there is what ucxx's asyncio send and recv do, less the awaiting."""
        ucxx = load_ucxx()
        tag, tags = ucxx.types.Tag, self.endpoint._tags
        endpoint = self.endpoint._ep
        endpoint.raise_on_error()
        return endpoint, ucxx._lib.arr.Array, tag(tags["msg_send"]), tag(tags["msg_recv"])

    def inline_reply(self) -> dict[str, Any]:
        """The reply :meth:`post_read_now` received: FramingError unless it is a whole inline frame."""
        flags, body_bytes = self._check_slot()
        if flags & FLAG_BODY_FOLLOWS:
            raise FramingError("a reply's body must be inline")
        return self._decode_slot(body_bytes, "reply")

    def _check_slot(self) -> tuple[int, int]:
        magic, version, flags, body_bytes = CONTROL_HEADER.unpack_from(self._slot)
        self._dirty_bytes = CONTROL_HEADER.size + min(body_bytes, INLINE_BODY_BYTES)
        _check_header(magic, version, flags, body_bytes)
        return flags, body_bytes

    def _decode_slot(self, body_bytes: int, expected_type: str | None) -> dict[str, Any]:
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
        # Kept by the channel until the receive ends: one cut short by its timeout stays posted until the
        # connection's owner aborts the endpoint, and must not land in freed memory meanwhile.
        self._body_receiving = body
        try:
            await _within(self.endpoint.recv(body), timeout_s)
        except Exception as error:
            if _is_truncation(error):
                raise FramingError(f"control body longer than the {body_bytes} bytes announced") from None
            raise
        self._body_receiving = None
        return body

    async def send_data(self, data: memoryview, timeout_s: float | None = None) -> None:
        await _within(self.endpoint.send(data), timeout_s)

    async def recv_data(self, into: memoryview, timeout_s: float | None = None) -> None:
        try:
            await _within(self.endpoint.recv(into), timeout_s)
        except Exception as error:
            if _is_truncation(error):
                raise FramingError(f"data message longer than the {into.nbytes} bytes announced") from None
            raise


def _inline_frame(body: bytes) -> bytes:
    """A control frame carrying ``body`` inside it."""
    return CONTROL_HEADER.pack(CONTROL_MAGIC, CONTROL_VERSION, 0, len(body)) + body


def _reply_body(request_id: int, *, ok: bool, total_bytes: int = 0, error: str | None = None, **extra: Any) -> bytes:
    message: dict[str, Any] = {"type": "reply", "request_id": request_id, "ok": ok, "total_bytes": total_bytes}
    if error is not None:
        message["error"] = wire.truncate_error(error)
    return wire.encode({**message, **{name: value for name, value in extra.items() if value is not None}})


def _check_header(magic: bytes, version: int, flags: int, body_bytes: int) -> None:
    if magic != CONTROL_MAGIC:
        raise FramingError(f"not a control frame (magic {magic!r}, expected {CONTROL_MAGIC!r})")
    if version != CONTROL_VERSION:
        raise FramingError(f"control frame version {version}, this side speaks {CONTROL_VERSION}")
    if flags & ~FLAG_BODY_FOLLOWS:
        raise FramingError(f"unknown control frame flags {flags:#x}")
    if flags & FLAG_BODY_FOLLOWS and body_bytes > wire.MAX_CONTROL_BYTES:
        raise FramingError(f"announced control message of {body_bytes} bytes exceeds {wire.MAX_CONTROL_BYTES}")
    if not flags & FLAG_BODY_FOLLOWS and body_bytes > INLINE_BODY_BYTES:
        raise FramingError(f"inline control body of {body_bytes} bytes cannot fit the {CONTROL_SLOT_BYTES}-byte frame")


class StagingPool:
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


staging_pool: Final = StagingPool(keep_bytes=_KEEP_STAGING_BYTES)
"""The process's staging pool, shared by its servers and clients."""


def contiguous_span(ranges: Sequence[Range]) -> Range | None:
    """``(start, end)`` when every range starts where the previous ended, else None."""
    start = end = ranges[0][0]
    for offset, length in ranges:
        if offset != end:
            return None
        end += length
    return (start, end)


def gather(source: memoryview, ranges: Sequence[Range], out: memoryview) -> None:
    """Copy each range of ``source`` into ``out``, back to back."""
    position = 0
    for offset, length in ranges:
        out[position : position + length] = source[offset : offset + length]
        position += length


def scatter(data: memoryview, ranges: Sequence[Range], target: memoryview) -> None:
    """Copy the back-to-back pieces of ``data`` to their ranges of ``target``."""
    position = 0
    for offset, length in ranges:
        target[offset : offset + length] = data[position : position + length]
        position += length


def gather_views(views: Sequence[memoryview], out: memoryview) -> None:
    """Copy ``views`` into ``out``, back to back."""
    position = 0
    for view in views:
        out[position : position + view.nbytes] = view
        position += view.nbytes


def scatter_views(data: memoryview, views: Sequence[memoryview]) -> None:
    """Fill ``views`` in order from the back-to-back pieces of ``data``."""
    position = 0
    for view in views:
        view[:] = data[position : position + view.nbytes]
        position += view.nbytes


def adjacent_span(views: Sequence[memoryview]) -> memoryview | None:
    """One view over buffers that lie back to back in memory (rows of one array, say), else None.

    Receiving into (or sending from) that span moves a batch as one message
    with no staging copy. The caller keeps ``views`` alive, and so the memory.
    """
    if len(views) == 1:
        return views[0]
    start = np.frombuffer(views[0], dtype=np.uint8).ctypes.data
    end = start
    for view in views:
        if np.frombuffer(view, dtype=np.uint8).ctypes.data != end:
            return None
        end += view.nbytes
    span = np.ctypeslib.as_array((ctypes.c_uint8 * (end - start)).from_address(start))
    return span.data


def buffer_views(
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
