"""KVStoreClient logic in one process: the real master code on a local loop, the in-process transport.

Integration tests (``test_kvstore_ray.py``) cover the same paths with real Ray
actors and UCX; these pin down the client's own decisions quickly: which path
a read takes, what a write records, how a restart is survived.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from rayturn import kvstore
from rayturn.kvstore.client import KVStoreClient
from rayturn.kvstore.connection import InProcessClient, InProcessServer, LocalMaster, MasterUnavailable
from rayturn.kvstore.master import KVMaster
from rayturn.kvstore.master_lookup import LOOKUP_METHODS
from rayturn.kvstore.master_types import MasterConfig
from rayturn.kvstore.segment import Segment

PAGE = 4096
SEGMENT = 64 * PAGE


def page(seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, PAGE, dtype=np.uint8).tobytes()


@pytest.fixture
def master() -> Iterator[LocalMaster]:
    local = LocalMaster(KVMaster(MasterConfig(heartbeat_timeout_s=2.0)))
    yield local
    local.close()


@pytest.fixture
def make_client(master: LocalMaster) -> Iterator[Callable[..., KVStoreClient]]:
    clients: list[KVStoreClient] = []

    def make(
        node_id: str, transport: str = "auto", connection: LocalMaster | None = None, tenant: str = "default"
    ) -> KVStoreClient:
        client = KVStoreClient(
            connection or master,
            Segment.create(SEGMENT),
            tenant,
            node_id,
            transport=transport,
            page_bytes=PAGE,
            heartbeat_interval_s=0.2,
            server_factory=lambda buffer, on_write, gate: InProcessServer(buffer, gate=gate, on_write=on_write),
            remote_client=InProcessClient(),
        )
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def test_same_node_reads_come_from_shared_memory(make_client: Callable[..., KVStoreClient]) -> None:
    writer, reader = make_client("node-a"), make_client("node-a")
    assert writer.put_batch([b"k0", b"k1"], [page(0), page(1)]) == [True, True]
    assert reader.get_batch([b"k0", b"k1", b"nope"]) == [page(0), page(1), None]
    assert writer.segment.name in {s.name for s in reader._attached.values()}
    assert reader.stats()["client"]["bytes_in"] == 2 * PAGE


def test_cross_node_reads_and_replica_writes_use_the_remote_transport(
    make_client: Callable[..., KVStoreClient],
) -> None:
    writer, other, reader = make_client("node-a"), make_client("node-b"), make_client("node-c")
    assert writer.put_batch([b"r"], [page(3)], replicas=2) == [True]
    # The second replica went to the other node through its owner, who recorded it.
    assert [key for key, *_ in other.held.items()] == [b"r"]
    assert [key for key, *_ in writer.held.items()] == [b"r"]
    assert writer.stats()["client"]["bytes_out"] == PAGE
    buffer = np.zeros(PAGE, dtype=np.uint8)
    assert reader.get_into([b"r"], [buffer]) == [True]
    assert buffer.tobytes() == page(3)
    assert reader._attached == {}  # nothing on node-c was mapped


def test_forced_ucx_path_never_maps_peers(make_client: Callable[..., KVStoreClient]) -> None:
    writer, reader = make_client("node-a"), make_client("node-a", transport="ucx")
    writer.put(b"x", page(4))
    assert reader.get(b"x") == page(4)
    assert reader._attached == {}


def test_reads_fall_back_to_the_next_replica(make_client: Callable[..., KVStoreClient]) -> None:
    first, second, reader = make_client("node-a"), make_client("node-b"), make_client("node-c")
    first.put_batch([b"two"], [page(5)], replicas=2)
    assert [key for key, *_ in second.held.items()] == [b"two"]
    first._server.stop()  # its owner stops answering before the master notices
    assert reader.get(b"two") == page(5)


def test_closed_owner_makes_its_pages_misses(make_client: Callable[..., KVStoreClient]) -> None:
    owner, reader = make_client("node-a"), make_client("node-b")
    owner.put(b"gone", page(6))
    owner.close()
    assert reader.get(b"gone") is None
    assert reader.exists([b"gone"]) == [False]


def test_wrong_buffer_and_bad_keys_are_value_errors(make_client: Callable[..., KVStoreClient]) -> None:
    client = make_client("node-a")
    client.put(b"k", page(7))
    with pytest.raises(ValueError, match="buffer 0 has 10 bytes"):
        client.get_into([b"k"], [np.zeros(10, dtype=np.uint8)])
    with pytest.raises(ValueError, match="key 1 must be non-empty bytes"):
        client.exists([b"k", b""])
    with pytest.raises(ValueError, match="transport must be one of"):
        make_client("node-a", transport="carrier-pigeon")
    assert client.get(b"k") == page(7)


def test_owner_readvertises_after_a_master_restart(
    master: LocalMaster, make_client: Callable[..., KVStoreClient]
) -> None:
    owner = make_client("node-a")
    owner.put_batch([b"a", b"b"], [page(8), page(9)])
    # A new master with no snapshot: only the owner's re-advertisement can bring the keys back.
    master.master = KVMaster(MasterConfig(heartbeat_timeout_s=2.0))
    deadline = time.monotonic() + 10
    while owner.exists([b"a", b"b"]) != [True, True]:
        assert time.monotonic() < deadline, "owner did not re-advertise"
        time.sleep(0.1)
    assert owner.get_batch([b"a", b"b"]) == [page(8), page(9)]


def test_each_call_sees_only_its_tenants_pages(make_client: Callable[..., KVStoreClient]) -> None:
    alice, same_node, far = make_client("node-a", tenant="alice"), make_client("node-a"), make_client("node-b")
    assert alice.put_batch([b"shared-prompt"], [page(10)]) == [True]
    for reader in (same_node, far):  # shared memory and the remote transport alike
        assert reader.get(b"shared-prompt") is None
        assert reader.exists([b"shared-prompt"]) == [False] and reader.longest_prefix([b"shared-prompt"]) == 0
        assert reader.get(b"shared-prompt", tenant="alice") == page(10)  # a server acting for alice's call
        assert reader.longest_prefix([b"shared-prompt"], tenant="alice") == 1
    assert far.put_batch([b"shared-prompt"], [page(11)]) == [False]  # alice's key: not the default tenant's to take
    assert far.put_batch([b"bob-page"], [page(12)], replicas=2, tenant="bob") == [True]
    # The copy placed on another owner's segment (on node-a) is recorded there as bob's, for re-advertising.
    held_on_a = {(key, tenant) for owner in (alice, same_node) for key, tenant, *_ in owner.held.items()}
    assert (b"bob-page", "bob") in held_on_a
    assert alice.get(b"bob-page") is None and alice.get(b"bob-page", tenant="bob") == page(12)


def test_a_pin_acts_for_the_calls_tenant(master: LocalMaster, make_client: Callable[..., KVStoreClient]) -> None:
    alice, server = make_client("node-a", tenant="alice"), make_client("node-a")
    alice.put(b"alice-prompt", page(13))
    objects = master.master.state.objects
    server.pin([b"alice-prompt"], 60.0)  # the server's own tenant: alice's object is not its to pin
    assert objects[b"alice-prompt"].pin_until_s == 0.0
    server.pin([b"alice-prompt"], 60.0, tenant="alice")  # acting for alice's call
    pinned_until_s = objects[b"alice-prompt"].pin_until_s
    assert pinned_until_s > time.monotonic() + 50.0
    server.pin([b"alice-prompt"], 1.0, tenant="alice")
    assert objects[b"alice-prompt"].pin_until_s == pinned_until_s  # a shorter pin never cuts one short
    with pytest.raises(ValueError, match="ttl_s must be > 0"):
        server.pin([b"alice-prompt"], 0.0)


@pytest.mark.parametrize("reader_node", ["node-a", "node-b"])  # shared memory, and the remote transport
def test_bytes_that_are_not_the_objects_own_read_as_a_miss(
    make_client: Callable[..., KVStoreClient], reader_node: str
) -> None:
    writer, reader = make_client("node-a"), make_client(reader_node)
    assert writer.put_batch([b"mine", b"kept"], [page(20), page(21)]) == [True, True]
    ((_, _, offset, _),) = [entry for entry in writer.held.items() if entry[0] == b"mine"]
    # Another page's bytes where the master still places "mine" (an offset reused behind stale metadata).
    writer.segment.write(offset, page(22))
    assert reader.get_batch([b"mine", b"kept"]) == [None, page(21)]
    buffers = np.zeros((2, PAGE), dtype=np.uint8)
    assert reader.get_into([b"mine", b"kept"], buffers) == [False, True]
    assert reader.stats()["client"]["wrong_pages"] == 2


class DownMaster:
    """A master connection that records the methods it is asked and, while ``down``, answers none: its master is
    restarting, and every call times out."""

    def __init__(self, up: LocalMaster) -> None:
        self.auth = up.auth
        self.down = False
        self.calls: list[str] = []  # the methods asked, answered or not
        self._up = up

    def call(self, method: str, *args: object, timeout_s: float | None = None) -> object:
        self.calls.append(method)
        if self.down:
            raise MasterUnavailable(f"the kv master did not answer {method}")
        return self._up.call(method, *args, timeout_s=timeout_s)

    def lookups(self) -> list[str]:
        """The key lookups asked (not membership, heartbeats or the segment directory)."""
        return [method for method in self.calls if method in LOOKUP_METHODS]

    def notify(self, method: str, *args: object) -> None:
        self._up.notify(method, *args)

    def refresh_auth(self) -> None:
        self._up.refresh_auth()


def test_while_the_master_is_away_calls_count_as_misses(
    master: LocalMaster, make_client: Callable[..., KVStoreClient]
) -> None:
    flaky = DownMaster(master)
    client = make_client("node-a", connection=flaky)
    assert client.put_batch([b"before"], [page(30)]) == [True]
    flaky.down = True
    assert client.get_batch([b"before"]) == [None]
    assert client.get_into([b"before"], [np.zeros(PAGE, dtype=np.uint8)]) == [False]
    assert client.put_batch([b"during"], [page(31)]) == [False]
    assert client.exists([b"before"]) == [False] and client.longest_prefix([b"before"]) == 0
    assert client.locate_prefix([b"before"]).num_keys == 0
    flaky.down = False
    assert client.get_batch([b"before", b"during"]) == [page(30), None]


@pytest.mark.parametrize("node_id", ["node-a", "node-b"])  # shared memory, the remote transport
def test_a_located_prefix_lands_without_asking_the_master_again(
    master: LocalMaster, make_client: Callable[..., KVStoreClient], node_id: str
) -> None:
    owner = make_client("node-a")
    keys = [f"k{i}".encode() for i in range(4)]
    assert owner.put_batch(keys, [page(40 + i) for i in range(4)]) == [True] * 4
    assert owner.put_batch([b"alices"], [page(44)], tenant="alice") == [True]
    counting = DownMaster(master)
    reader = make_client(node_id, connection=counting)
    counting.calls.clear()

    prefix = reader.locate_prefix([*keys[:3], b"missing", keys[3]])
    assert (prefix.num_keys, prefix.keys) == (3, keys[:3])  # the leading run only, as longest_prefix counts it
    assert isinstance(prefix, kvstore.LocatedPrefix)  # the package exports the type the client returns
    assert counting.lookups() == ["locate_prefix"]
    rows = np.zeros((2, PAGE), dtype=np.uint8)
    assert reader.get_prefix_into(prefix, rows) == [True, True]  # the start of the prefix: as many as buffers
    assert [bytes(row) for row in rows] == [page(40), page(41)]
    buffers = [bytearray(PAGE) for _ in range(3)]
    assert reader.get_prefix_into(prefix, buffers) == [True] * 3
    assert [bytes(b) for b in buffers] == [page(40 + i) for i in range(3)]
    assert counting.lookups() == ["locate_prefix"]  # both loads used the one answer

    with pytest.raises(ValueError, match="4 buffers for a located prefix of 3 objects"):
        reader.get_prefix_into(prefix, [bytearray(PAGE) for _ in range(4)])
    with pytest.raises(ValueError, match="buffer 1 has 100 bytes"):
        reader.get_prefix_into(prefix, [bytearray(PAGE), bytearray(100)])
    assert reader.get_prefix_into(prefix, []) == []

    # Another tenant's object ends the prefix; the tenant it belongs to sees it.
    assert reader.locate_prefix([b"alices", keys[0]]).num_keys == 0
    theirs = reader.locate_prefix([b"alices", keys[0]], tenant="alice")
    assert theirs.num_keys == 1 and reader.get_prefix_into(theirs, [bytearray(PAGE)]) == [True]


def test_a_located_prefix_whose_grants_ran_out_is_located_again(
    make_client: Callable[..., KVStoreClient],
) -> None:
    # Read grants last half a lease: 1 s here, long enough for a fresh grant to outlast a slow read.
    short = LocalMaster(KVMaster(MasterConfig(heartbeat_timeout_s=2.0, lease_ttl_s=2.0)))
    counting = DownMaster(short)
    owner = make_client("node-a", connection=short)
    reader = make_client("node-b", connection=counting)
    try:
        assert owner.put_batch([b"p0", b"p1"], [page(50), page(51)]) == [True, True]
        prefix = reader.locate_prefix([b"p0", b"p1"])
        time.sleep(1.2)
        counting.calls.clear()
        rows = np.zeros((2, PAGE), dtype=np.uint8)
        assert reader.get_prefix_into(prefix, rows) == [True, True]
        assert [bytes(row) for row in rows] == [page(50), page(51)]
        assert counting.lookups() == ["get_locations"]  # the owner refused the stale grant; fresh ones were asked for
    finally:  # the clients leave before their master stops (the fixture's close is then a no-op)
        owner.close()
        reader.close()
        short.close()
