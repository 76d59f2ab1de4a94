"""Installing the guarded handshake (``kvstore/ucx_handshake.py``) on stand-ins for ucxx's modules.

What the guard prevents, with real UCX: ``tests/kvstore/test_ucx_transport.py`` (a peer stalling the
handshake past the listener's timeout, and reads whose timeouts cut reconnections short).
"""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from rayturn.kvstore import ucx_handshake


async def _exchange(**kwargs: Any) -> dict[str, Any]:
    return kwargs


def _ucxx(*, listener: bool = True, connect: bool = True) -> Any:
    def module(present: bool) -> Any:
        return SimpleNamespace(exchange_peer_info=_exchange) if present else SimpleNamespace()

    return SimpleNamespace(_lib_async=SimpleNamespace(listener=module(listener), application_context=module(connect)))


def test_install_replaces_the_exchange_in_both_callers_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ucx_handshake, "_original", None)
    ucxx = _ucxx()
    assert ucx_handshake.install(ucxx)
    assert ucx_handshake.install(ucxx)  # again: the original stays the one ucxx had
    assert ucxx._lib_async.listener.exchange_peer_info is ucx_handshake.guarded_exchange
    assert ucxx._lib_async.application_context.exchange_peer_info is ucx_handshake.guarded_exchange
    assert ucx_handshake._original is _exchange


@pytest.mark.parametrize(("listener", "connect"), [(False, True), (True, False)])
def test_a_ucxx_without_the_exchange_is_left_alone_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, listener: bool, connect: bool
) -> None:
    monkeypatch.setattr(ucx_handshake, "_original", None)
    ucxx = _ucxx(listener=listener, connect=connect)
    with caplog.at_level(logging.WARNING, logger=ucx_handshake.__name__):
        assert not ucx_handshake.install(ucxx)
    assert "not guarded" in caplog.text
    present = ucxx._lib_async.listener if listener else ucxx._lib_async.application_context
    assert present.exchange_peer_info is _exchange
    assert ucx_handshake._original is None


def test_the_guarded_exchange_runs_ucxx_own_without_its_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ucx_handshake, "_original", _exchange)
    before = ucx_handshake.pending_exchanges()
    got = asyncio.run(ucx_handshake.guarded_exchange("endpoint", 7, True, connect_timeout=1.0))
    assert got == {"endpoint": "endpoint", "msg_tag": 7, "listener": True, "connect_timeout": None}
    assert ucx_handshake.pending_exchanges() == before


class _StalledEndpoint:
    """An endpoint whose peer never answers. Closing it ends the receive, as UCX's cancellation does, unless
    ``ends_on_close`` is False (an endpoint that had failed before); with ``close_fails``, closing raises."""

    def __init__(self, *, ends_on_close: bool = True, close_fails: bool = False) -> None:
        self.ends_on_close = ends_on_close
        self.close_fails = close_fails
        self.closed = asyncio.Event()
        self.closes: list[dict[str, int]] = []

    def close_blocking(self, **kwargs: int) -> None:
        self.closes.append(kwargs)
        if self.close_fails:
            raise RuntimeError("Endpoint is not connected")
        if self.ends_on_close:
            self.closed.set()


async def _stalled(endpoint: _StalledEndpoint, **kwargs: Any) -> dict[str, Any]:
    await endpoint.closed.wait()
    raise RuntimeError("Request canceled")


async def _turns() -> None:
    """A few turns of the loop: an ended receive wakes its exchange, which then ends."""
    for _ in range(5):
        await asyncio.sleep(0)


async def _give_up_on(endpoint: _StalledEndpoint, how: str) -> None:
    if how == "timeout":
        with pytest.raises(TimeoutError):
            await ucx_handshake.guarded_exchange(endpoint, 7, False, connect_timeout=0.05)
        return
    waiting = asyncio.ensure_future(ucx_handshake.guarded_exchange(endpoint, 7, False, connect_timeout=60.0))
    await asyncio.sleep(0.05)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting


@pytest.mark.parametrize("ends_on_close", [True, False])
@pytest.mark.parametrize("how", ["timeout", "cancel"])
def test_a_stalled_exchange_closes_its_endpoint_and_ends(
    monkeypatch: pytest.MonkeyPatch, how: str, ends_on_close: bool
) -> None:
    monkeypatch.setattr(ucx_handshake, "_original", _stalled)
    monkeypatch.setattr(ucx_handshake, "CLOSED_GRACE_S", 0.05)
    endpoint = _StalledEndpoint(ends_on_close=ends_on_close)
    before = ucx_handshake.pending_exchanges()

    async def run() -> None:
        await _give_up_on(endpoint, how)
        assert endpoint.closes == [{"period": ucx_handshake.CLOSE_PERIOD_NS, "max_attempts": 1}]
        await _turns()
        # Its receive cancelled by the close, the exchange ends at once; else it is cancelled after the grace.
        assert ucx_handshake.pending_exchanges() == before + (0 if ends_on_close else 1)
        await asyncio.sleep(0.2)
        assert ucx_handshake.pending_exchanges() == before

    asyncio.run(run())


def test_an_exchange_whose_endpoint_did_not_close_keeps_its_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ucx_handshake, "_original", _stalled)
    monkeypatch.setattr(ucx_handshake, "CLOSED_GRACE_S", 0.05)
    endpoint = _StalledEndpoint(close_fails=True)
    before = ucx_handshake.pending_exchanges()

    async def run() -> None:
        await _give_up_on(endpoint, "timeout")
        await asyncio.sleep(0.2)
        assert ucx_handshake.pending_exchanges() == before + 1  # left running: its receive may still land
        endpoint.closed.set()  # the receive ends after all
        await _turns()
        assert ucx_handshake.pending_exchanges() == before

    asyncio.run(run())
