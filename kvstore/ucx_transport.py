"""Moving byte ranges in and out of a worker's KV segment over UCX (UCXX's asyncio API).

:class:`UcxServer` serves one segment: remote :class:`UcxClient` s read ranges out of it and write
ranges into it. Each request names many ``(offset, length)`` ranges; the bytes of all of them
travel as ONE UCX message, so a request costs three or four messages however many pages it names.

This module is the public face of the transport; the parts live in their own modules:

- :mod:`rayturn.kvstore.ucx_runtime`: the per-process UCX event-loop thread that owns every ucxx
  object, UCX settings (:func:`init_ucx`, :func:`shutdown_ucx`, :func:`describe_transports`,
  :func:`run_in_ucx_loop`);
- :mod:`rayturn.kvstore.ucx_framing`: the messages on an endpoint (control frames, data messages)
  and the staging that packs many ranges into one message;
- :mod:`rayturn.kvstore.ucx_server`: :class:`UcxServer` and its per-connection request life cycle;
- :mod:`rayturn.kvstore.ucx_client`: :class:`UcxClient` and :class:`TransportError`.
"""

from __future__ import annotations

from rayturn.kvstore.ucx_client import (
    DEFAULT_CONNECT_TIMEOUT_S,
    PeerTimedOut,
    PeerUnreachable,
    TransportError,
    UcxClient,
)
from rayturn.kvstore.ucx_framing import (
    CONTROL_HEADER,
    CONTROL_MAGIC,
    CONTROL_SLOT_BYTES,
    CONTROL_VERSION,
    DEFAULT_TIMEOUT_S,
    FLAG_BODY_FOLLOWS,
    Address,
)
from rayturn.kvstore.ucx_runtime import describe_transports, init_ucx, run_in_ucx_loop, shutdown_ucx
from rayturn.kvstore.ucx_server import DEFAULT_MAX_STAGING_BYTES, UcxServer, WriteCallback

__all__ = [
    "CONTROL_HEADER",
    "CONTROL_MAGIC",
    "CONTROL_SLOT_BYTES",
    "CONTROL_VERSION",
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_MAX_STAGING_BYTES",
    "DEFAULT_TIMEOUT_S",
    "FLAG_BODY_FOLLOWS",
    "Address",
    "PeerTimedOut",
    "PeerUnreachable",
    "TransportError",
    "UcxClient",
    "UcxServer",
    "WriteCallback",
    "describe_transports",
    "init_ucx",
    "run_in_ucx_loop",
    "shutdown_ucx",
]
