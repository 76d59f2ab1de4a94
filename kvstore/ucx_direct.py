"""Small reads posted and completed on the calling thread, without a turn through the UCX loop.

A read through the UCX loop costs the caller two thread hand-offs of its own: the request goes to
the loop thread, and its completion comes back from ucxx's notifier through that loop to the
caller. For a read of at most :data:`DIRECT_READ_MAX_BYTES` into one span of memory, on a
connection that is already established (connecting and authenticating stay on the loop), the
calling thread instead posts the request frame and the receives of the reply and the data on the
endpoint itself (ucxx's progress thread sends and receives them, as for any request) and polls the
three for completion. Larger reads stay on the loop, where waiting costs no polling.

Life cycle of one direct read: POSTED -> (all three complete) CHECK_REPLY -> DONE; any failure,
refusal or timeout raises :class:`DirectReadFailed` and the caller drops the connection, which
cancels what is still posted before the destination is handed back.
"""

from __future__ import annotations

import time
from typing import Any, Final

from rayturn.kvstore.ucx_framing import UNPARSED_REQUEST_ID, Channel, describe_error

__all__ = ["DIRECT_READ_MAX_BYTES", "DirectReadFailed", "read_now"]

DIRECT_READ_MAX_BYTES: Final = 256 << 10
"""Largest read that takes the direct path: a handful of KV pages."""
_POLL_INTERVAL_S: Final = 20e-6


class DirectReadFailed(Exception):
    """A direct read did not land: ``kind`` says why ("refused", "timeout" or "broken"); ``requests`` are
    ucxx's requests it posted (their futures complete on the UCX loop, cancelled once the endpoint goes)."""

    def __init__(self, kind: str, message: str, requests: tuple[Any, ...] = ()) -> None:
        super().__init__(message)
        self.kind = kind
        self.requests = requests


def read_now(channel: Channel, request_id: int, request: bytes, into: memoryview, timeout_s: float) -> None:
    """Send the encoded read ``request`` and land its data in ``into``, all on this thread.

    Raises DirectReadFailed; the connection must then be dropped (its data receive may still be
    posted, or the stream be out of step).
    """
    deadline = time.monotonic() + timeout_s
    try:
        send, reply_receive, data_receive = channel.post_read_now(request, into)
    except Exception as error:  # the endpoint is closed or broken
        raise DirectReadFailed("broken", describe_error(error)) from error
    try:
        _complete(channel, (send, reply_receive, data_receive), request_id, into, deadline, timeout_s)
    except DirectReadFailed as error:
        error.requests = (send, reply_receive, data_receive)
        raise


def _complete(
    channel: Channel, requests: tuple[Any, ...], request_id: int, into: memoryview, deadline: float, timeout_s: float
) -> None:
    send, reply_receive, data_receive = requests
    reply: dict[str, Any] | None = None
    while True:
        # The reply is checked as soon as it is in: a refused read gets no data message to wait for.
        if reply is None and reply_receive.completed:
            reply = _checked_reply(channel, reply_receive, request_id)
        if reply is not None and send.completed and data_receive.completed:
            break
        if time.monotonic() > deadline:
            raise DirectReadFailed("timeout", f"no reply within {timeout_s} s")
        time.sleep(_POLL_INTERVAL_S)
    _raise_error_of(send)
    _raise_error_of(data_receive)
    if reply["total_bytes"] != into.nbytes:
        raise DirectReadFailed("broken", f"server announced {reply['total_bytes']} bytes for a read of {into.nbytes}")


def _checked_reply(channel: Channel, reply_receive: Any, request_id: int) -> dict[str, Any]:
    """The ok reply to ``request_id``; DirectReadFailed if it is a refusal, another request's or unusable."""
    _raise_error_of(reply_receive)
    try:
        reply = channel.inline_reply()
    except Exception as error:
        raise DirectReadFailed("broken", f"unusable reply: {describe_error(error)}") from error
    # A refusal of a request the server could not even parse carries id -1 (see the loop path).
    if reply["request_id"] not in (request_id, UNPARSED_REQUEST_ID):
        raise DirectReadFailed("broken", f"got the reply to request {reply['request_id']} waiting for {request_id}")
    if not reply["ok"]:
        raise DirectReadFailed("refused", reply.get("error") or "the server refused the request without saying why")
    if reply["request_id"] != request_id:
        raise DirectReadFailed("broken", f"got an ok reply with request id -1 while waiting for {request_id}")
    return reply


def _raise_error_of(request: Any) -> None:
    try:
        request.check_error()
    except Exception as error:  # truncation, cancellation, a broken endpoint
        raise DirectReadFailed("broken", describe_error(error)) from error
