"""A stop signal abandons a start-up wherever it lands, a blocking Ray call included.

Ray checks for signals inside ``ray.get`` and ends the call early on a ``KeyboardInterrupt``
only: any other exception a signal handler raises there is held until the call returns. A
start-up that waits on something that never comes (a replica no node can hold) would then
never stop. These tests hold ``serve_forever`` inside such a call and signal it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import ray

from rayturn.cluster import runner
from rayturn.cluster.config import ClusterConfig


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
class _Gate:
    """An actor whose ``wait`` returns only once ``open`` is called."""

    def __init__(self) -> None:
        import asyncio

        self._open = asyncio.Event()

    async def wait(self) -> None:
        await self._open.wait()

    async def open(self) -> None:
        self._open.set()


def _signal_in(seconds: float, signum: signal.Signals) -> threading.Timer:
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signum))
    timer.start()
    return timer


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_a_blocking_ray_call_abandons_the_start_up(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], signum: signal.Signals
) -> None:
    gate = _Gate.remote()  # type: ignore[attr-defined]
    torn_down = threading.Event()

    @contextmanager
    def stuck_start_up(config: ClusterConfig, address: str | None, log_level: int) -> Iterator[runner.Endpoints]:
        try:
            ray.get(gate.wait.remote())  # as serve.run's wait for a replica nobody can schedule
            yield runner.Endpoints(http="http://unused", grpc="unused")
        finally:
            torn_down.set()

    monkeypatch.setattr(runner, "running_cluster", stuck_start_up)
    before = signal.getsignal(signum)
    timer = _signal_in(1.0, signum)
    # Opened after 60 s if the signal is lost, so a regression fails below rather than hanging.
    rescue = threading.Timer(60.0, lambda: gate.open.remote())
    rescue.start()
    started = time.monotonic()
    try:
        assert runner.serve_forever(ClusterConfig(), log_level=logging.INFO) == 0
    finally:
        rescue.cancel()
        timer.cancel()
    took = time.monotonic() - started
    assert took < 30.0, f"the stop signal was held until the blocking call returned ({took:.0f} s)"
    assert torn_down.is_set()
    printed = capsys.readouterr().out
    assert "rayturn stopped." in printed and "rayturn is serving" not in printed
    assert signal.getsignal(signum) is before  # serve_forever's handler is gone again


def test_an_interrupt_no_signal_caused_is_not_taken_for_a_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    @contextmanager
    def interrupted(config: ClusterConfig, address: str | None, log_level: int) -> Iterator[runner.Endpoints]:
        raise KeyboardInterrupt
        yield  # pragma: no cover

    monkeypatch.setattr(runner, "running_cluster", interrupted)
    with pytest.raises(KeyboardInterrupt):
        runner.serve_forever(ClusterConfig())
