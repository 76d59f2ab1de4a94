"""ucxx's endpoint handshake, guarded: no timeout or cancellation frees its receive buffer under UCX.

When ucxx connects, or accepts a connection, the two sides swap their message tags: each posts a
receive of the other's 16 bytes into a buffer its handshake coroutine owns, and waits with a
timeout (ucxx's ``exchange_peer_info``). If that wait times out, or the coroutine is cancelled (a
client's request timing out mid-connect), the coroutine ends and frees the buffer, but the
receive stays posted: the peer's 16 bytes, arriving later, land in freed memory and corrupt the
allocator. A stranger could crash a store server that way, by stalling its half of the handshake
past the listener's timeout and then sending it; a client crashed when a read's timeout cut its
own connect short.

:func:`install` puts :func:`guarded_exchange` in the place of ucxx's function, in the listener and
in the client's connect alike: ucxx's exchange runs unchanged as a task of its own, with no timeout
of its own; on a timeout or a cancellation the endpoint is closed first, which makes UCX cancel
the receive, and the task (holding its buffer until then) ends with it. A receive on an endpoint
that had already failed (a server that refused the connection) is never completed, even so: once
the endpoint is closed, nothing can land, and such a task is cancelled after :data:`CLOSED_GRACE_S`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Final

__all__ = ["guarded_exchange", "install", "pending_exchanges"]

logger = logging.getLogger(__name__)

CLOSE_PERIOD_NS: Final = 10**9
"""How long closing an endpoint may wait for ucxx's progress thread: a stalled handshake's here, and a connection's
when the store aborts it (``ucx_framing.abort_endpoint``)."""
CLOSED_GRACE_S: Final = 1.0
"""How long a stalled handshake may take to end once its endpoint is closed, before it is cancelled."""

# The modules of ``ucxx._lib_async`` that look the function up: the listener's handler, and the client's connect.
_CALLERS: Final = ("listener", "application_context")

_Exchange = Callable[..., Coroutine[Any, Any, dict[str, Any]]]
_original: _Exchange | None = None
_exchanges: set[asyncio.Future[dict[str, Any]]] = set()


def pending_exchanges() -> int:
    """Handshakes still running on this process's UCX loop (a stalled one ends once its endpoint is closed)."""
    return len(_exchanges)


async def guarded_exchange(endpoint: Any, msg_tag: int, listener: bool, connect_timeout: float = 5.0) -> dict[str, Any]:
    """ucxx's ``exchange_peer_info`` within ``connect_timeout``, its receive never outliving its buffer."""
    if _original is None:
        raise RuntimeError("ucx_handshake.install() has not run")
    exchange = asyncio.ensure_future(
        _original(endpoint=endpoint, msg_tag=msg_tag, listener=listener, connect_timeout=None)
    )
    _exchanges.add(exchange)
    exchange.add_done_callback(_ended)
    try:
        return await asyncio.wait_for(asyncio.shield(exchange), connect_timeout)
    except BaseException:
        if not exchange.done():  # its receive may still be posted: UCX cancels it when the endpoint closes
            try:
                endpoint.close_blocking(period=CLOSE_PERIOD_NS, max_attempts=1)
            except Exception as error:  # not known to be closed: the exchange keeps its buffer
                logger.debug("closing a stalled UCX handshake's endpoint: %s", error)
            else:  # closed: nothing lands now, yet a receive on an endpoint that had failed is never completed
                asyncio.get_running_loop().call_later(CLOSED_GRACE_S, exchange.cancel)
        raise


def _ended(exchange: asyncio.Future[dict[str, Any]]) -> None:
    _exchanges.discard(exchange)
    _ = exchange.cancelled() or exchange.exception()  # seen: the caller's own error reports a failure


def install(ucxx: Any) -> bool:
    """Put :func:`guarded_exchange` where ucxx calls its exchange; False, with a warning, where this ucxx has none."""
    global _original
    package = getattr(ucxx, "_lib_async", None)
    modules = [getattr(package, name, None) for name in _CALLERS]
    found: list[Any] = [module for module in modules if getattr(module, "exchange_peer_info", None) is not None]
    if len(found) != len(_CALLERS):
        logger.warning("this ucxx has no exchange_peer_info where expected: its handshake is not guarded")
        return False
    for module in found:
        if _original is None and module.exchange_peer_info is not guarded_exchange:
            _original = module.exchange_peer_info
        module.exchange_peer_info = guarded_exchange
    return True
