"""KVMetrics: a read's counts reach Ray's counters in batches (at most FLUSH_EVERY_S late), never lost or doubled."""

from __future__ import annotations

import time

import pytest

from rayturn.kvstore import metrics
from rayturn.kvstore.metrics import KVMetrics


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, str]]] = []

    def inc(self, value: int, tags: dict[str, str]) -> None:
        self.calls.append((value, dict(tags)))


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> tuple[KVMetrics, Recorder, Recorder]:
    made = KVMetrics("seg", "alice")
    bytes_in, pages = Recorder(), Recorder()
    monkeypatch.setattr(made, "_bytes_in", bytes_in)
    monkeypatch.setattr(made, "_pages_read", pages)
    return made, bytes_in, pages


def test_reads_are_counted_at_once_and_given_to_ray_on_flush(counted: tuple[KVMetrics, Recorder, Recorder]) -> None:
    made, bytes_in, pages = counted
    for _ in range(3):
        made.bytes_in(100)
        made.pages_read("remote", 2)
    made.pages_read("node", 1)
    assert made.totals()["bytes_in"] == 300  # the plain totals are exact at once
    assert bytes_in.calls == [] and pages.calls == []  # within FLUSH_EVERY_S: nothing sent yet
    made.flush()
    tags = {"segment": "seg", "tenant": "alice"}
    assert bytes_in.calls == [(300, tags)]
    assert sorted(pages.calls, key=lambda call: call[1]["source"]) == [
        (1, {**tags, "source": "node"}),
        (6, {**tags, "source": "remote"}),
    ]
    made.flush()  # nothing new: nothing sent twice
    assert len(bytes_in.calls) == 1 and len(pages.calls) == 2


def test_a_read_after_the_interval_flushes_by_itself(
    counted: tuple[KVMetrics, Recorder, Recorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    made, bytes_in, _ = counted
    now = [1000.0]

    def clock() -> float:
        return now[0]

    monkeypatch.setattr(metrics.time, "monotonic", clock)
    made.flush()
    made.bytes_in(10)
    assert bytes_in.calls == []
    now[0] += metrics.FLUSH_EVERY_S
    made.bytes_in(5)
    assert [value for value, _ in bytes_in.calls] == [15]


def test_the_clients_heartbeat_gives_ray_what_the_reads_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no read after them, a burst's counts still reach Ray: the client's heartbeat flushes them."""
    from rayturn.kvstore.client import KVStoreClient
    from rayturn.kvstore.connection import InProcessClient, InProcessServer, LocalMaster
    from rayturn.kvstore.master import KVMaster
    from rayturn.kvstore.master_types import MasterConfig
    from rayturn.kvstore.segment import Segment

    monkeypatch.setattr(metrics, "FLUSH_EVERY_S", 3600.0)  # only the heartbeat can flush
    master = LocalMaster(KVMaster(MasterConfig(heartbeat_timeout_s=5.0)))
    clients = []
    try:
        for node in ("node-a", "node-b"):
            clients.append(
                KVStoreClient(
                    master,
                    Segment.create(1 << 20),
                    "t",
                    node,
                    page_bytes=4096,
                    heartbeat_interval_s=0.1,
                    server_factory=lambda buffer, on_write, gate: InProcessServer(buffer, gate=gate, on_write=on_write),
                    remote_client=InProcessClient(),
                )
            )
        owner, reader = clients
        assert owner.put_batch([b"k"], [bytes(4096)]) == [True]
        recorder = Recorder()
        monkeypatch.setattr(reader.metrics, "_pages_read", recorder)
        assert reader.get_into([b"k"], [bytearray(4096)]) == [True]
        deadline = time.monotonic() + 5.0
        while not recorder.calls and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [(value, tags["source"]) for value, tags in recorder.calls] == [(1, "remote")]
    finally:
        for made in clients:
            made.close()
        master.close()
