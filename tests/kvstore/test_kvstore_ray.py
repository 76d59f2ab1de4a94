"""The KV store with real Ray actors in separate processes, real shared memory and real UCX."""

from __future__ import annotations

import dataclasses
import os
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest

ray = pytest.importorskip("ray")

from rayturn.kvstore import (  # noqa: E402
    KVStoreClient,
    MasterConfig,
    start_master,
    start_store_nodes,
    wire,
)
from rayturn.kvstore.access import StoreAuth  # noqa: E402
from rayturn.kvstore.connection import RayMaster  # noqa: E402
from rayturn.kvstore.lookup_client import LookupClient  # noqa: E402
from rayturn.kvstore.master_lookup import frame  # noqa: E402
from rayturn.kvstore.ucx_transport import TransportError, UcxClient  # noqa: E402

PAGE = 32 << 10
SEGMENT = 4 << 20
CONFIG = MasterConfig(heartbeat_timeout_s=3.0, lease_ttl_s=2.0)


@pytest.fixture(scope="module", autouse=True)
def ray_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="kvstore-tests")
    yield
    ray.shutdown()


@ray.remote(num_cpus=0.1)
class StoreWorker:
    def __init__(
        self,
        master_name: str,
        transport: str = "auto",
        segment_bytes: int = SEGMENT,
        ucx_config: dict[str, str] | None = None,
    ) -> None:
        self.client = KVStoreClient.connect(
            master_name,
            segment_bytes,
            transport=transport,
            heartbeat_interval_s=0.5,
            page_bytes=PAGE,
            ucx_config=ucx_config,
        )

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.client, method)(*args, **kwargs)

    def get_into_numpy(self, keys: list[bytes], num_bytes: int) -> tuple[list[bool], list[bytes]]:
        buffers = [np.zeros(num_bytes, dtype=np.uint8) for _ in keys]
        landed = self.client.get_into(keys, buffers)
        return landed, [b.tobytes() for b in buffers]

    def load_prefix_numpy(self, keys: list[bytes], count: int) -> tuple[int, list[bool], list[bytes]]:
        """Locate the held prefix of ``keys`` and land its first ``count`` objects: (held, landed, bytes)."""
        prefix = self.client.locate_prefix(keys)
        rows = np.zeros((count, PAGE), dtype=np.uint8)
        landed = self.client.get_prefix_into(prefix, rows)
        return prefix.num_keys, landed, [row.tobytes() for row in rows]

    def put_float_array(self, key: bytes, seed: int) -> bytes:
        array = np.random.default_rng(seed).standard_normal(PAGE // 4).astype(np.float32)
        assert self.client.put(key, array)
        return array.tobytes()

    def lookup_counts(self) -> tuple[int, int]:
        """(calls the master's lookup socket answered, calls Ray answered after a socket failure)."""
        lookup = self.client.master.lookup  # type: ignore[attr-defined]
        return lookup.calls, lookup.fallbacks

    def pid(self) -> int:
        return os.getpid()

    def env(self, name: str) -> str | None:
        return os.environ.get(name)


def page(seed: int, num_bytes: int = PAGE) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8).tobytes()


def keys_for(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(n)]


def until(predicate: Any, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.2)


@pytest.mark.parametrize("transport", ["auto", "ucx"])
def test_put_get_across_two_processes(transport: str) -> None:
    master_name = f"kv-basic-{transport}"
    start_master(master_name, config=CONFIG)
    writer = StoreWorker.remote(master_name, transport)
    reader = StoreWorker.remote(master_name, transport)
    assert ray.get(writer.pid.remote()) != ray.get(reader.pid.remote())
    keys = keys_for("basic", 8)
    values = [page(i) for i in range(8)]
    assert ray.get(writer.call.remote("put_batch", keys, values)) == [True] * 8
    assert ray.get(writer.call.remote("put", b"single", page(99)))
    assert ray.get(reader.call.remote("get_batch", keys)) == values
    assert ray.get(reader.call.remote("get", b"single")) == page(99)
    assert ray.get(reader.call.remote("get", b"missing")) is None
    landed, copies = ray.get(reader.get_into_numpy.remote(keys[:3] + [b"missing"], PAGE))
    assert landed == [True, True, True, False] and copies[:3] == values[:3]
    assert ray.get(reader.call.remote("exists", [keys[0], b"missing"])) == [True, False]
    assert ray.get(reader.call.remote("longest_prefix", keys[:4] + [b"missing"] + keys[4:])) == 4
    # The same count and the pages' places in one lookup, over the master's socket; the load asks nothing more.
    before = ray.get(reader.lookup_counts.remote())
    held, landed, copies = ray.get(reader.load_prefix_numpy.remote(keys[:4] + [b"missing"] + keys[4:], 3))
    assert (held, landed, copies) == (4, [True] * 3, values[:3])
    assert ray.get(reader.lookup_counts.remote()) == (before[0] + 1, before[1])
    expected = ray.get(writer.put_float_array.remote(b"floats", 7))
    assert ray.get(reader.call.remote("get", b"floats")) == expected
    assert ray.get(reader.call.remote("remove", keys[:2])) == 2
    assert ray.get(reader.call.remote("get_batch", keys[:3])) == [None, None, values[2]]
    stats = ray.get(reader.call.remote("stats"))
    assert stats["hits"] >= 13 and stats["misses"] >= 3 and stats["client"]["bytes_in"] >= 12 * PAGE
    # Each segment is advertised at its node's Ray address, the one a reader on another node can reach.
    directory = ray.get(ray.get_actor(master_name).segment_directory.remote())
    assert {info["ucx_address"][0] for info in directory.values()} == {ray.util.get_node_ip_address()}


def test_a_second_replica_survives_its_owner_and_a_lost_page_is_a_miss() -> None:
    master_name = "kv-replicas"
    start_master(master_name, config=CONFIG)
    owner = StoreWorker.remote(master_name, "ucx")
    other = StoreWorker.remote(master_name, "ucx")
    reader = StoreWorker.remote(master_name, "ucx", SEGMENT)
    ray.get([owner.pid.remote(), other.pid.remote(), reader.pid.remote()])
    twice, once = keys_for("twice", 4), keys_for("once", 4)
    assert ray.get(owner.call.remote("put_batch", twice, [page(i) for i in range(4)], replicas=2)) == [True] * 4
    assert ray.get(owner.call.remote("put_batch", once, [page(10 + i) for i in range(4)])) == [True] * 4
    ray.kill(owner)
    assert ray.get(reader.call.remote("get_batch", twice)) == [page(i) for i in range(4)]
    assert ray.get(reader.call.remote("get_batch", once)) == [None] * 4
    until(lambda: ray.get(reader.call.remote("exists", once)) == [False] * 4)


def test_concurrent_puts_of_one_key_both_succeed_with_one_value() -> None:
    master_name = "kv-concurrent"
    start_master(master_name, config=CONFIG)
    a, b, reader = (StoreWorker.remote(master_name) for _ in range(3))
    first, second = page(1), page(2)
    results = ray.get([a.call.remote("put", b"same", first), b.call.remote("put", b"same", second)])
    assert results == [True, True]
    until(lambda: ray.get(reader.call.remote("get", b"same")) is not None)
    assert ray.get(reader.call.remote("get", b"same")) in (first, second)


def test_interrupted_put_is_reclaimed() -> None:
    master_name = "kv-reclaim"
    master = start_master(master_name, config=dataclasses.replace(CONFIG, put_timeout_s=2.0))
    worker = StoreWorker.remote(master_name)
    ray.get(worker.pid.remote())
    started = ray.get(master.put_start.remote([b"orphan"], [PAGE], "default"))
    assert started.plans[0].status == "write"  # a writer that dies before put_end
    until(lambda: ray.get(master.stats.remote())["reclaimed_puts"] == 1)
    assert ray.get(worker.call.remote("exists", [b"orphan"])) == [False]
    assert ray.get(worker.call.remote("put", b"orphan", page(5)))  # the key is free again


def test_watermark_eviction_keeps_puts_succeeding_and_pins_hold() -> None:
    master_name = "kv-evict"
    start_master(master_name, config=CONFIG)
    worker = StoreWorker.remote(master_name, "auto", 16 * PAGE)
    pinned = keys_for("pinned", 2)
    assert ray.get(worker.call.remote("put_batch", pinned, [page(i) for i in range(2)], pin_ttl_s=60.0)) == [True] * 2
    for round_index in range(4):  # 4 x 8 pages into a 16-page segment
        keys = keys_for(f"fill{round_index}", 8)
        assert ray.get(worker.call.remote("put_batch", keys, [page(i) for i in range(8)])) == [True] * 8
    assert ray.get(worker.call.remote("exists", pinned)) == [True, True]
    stats = ray.get(worker.call.remote("stats"))
    assert stats["evictions"] >= 16
    assert max(seg["usage"] for seg in stats["segments"].values()) <= 0.9


def test_master_restart_finds_keys_again(tmp_path: Any) -> None:
    master_name = "kv-restart"
    master = start_master(master_name, snapshot_dir=str(tmp_path), config=CONFIG, snapshot_interval_s=0.5)
    writer = StoreWorker.remote(master_name)
    reader = StoreWorker.remote(master_name)
    early, late = keys_for("early", 4), keys_for("late", 4)
    assert ray.get(writer.call.remote("put_batch", early, [page(i) for i in range(4)])) == [True] * 4
    ray.get(master.snapshot_now.remote())
    # Written after the last snapshot: only the owner's re-advertisement can bring these back.
    assert ray.get(writer.call.remote("put_batch", late, [page(10 + i) for i in range(4)])) == [True] * 4
    epoch = ray.get(master.ready.remote())
    ray.kill(master, no_restart=False)
    until(lambda: _epoch_changed(master, epoch), timeout_s=60)
    until(lambda: ray.get(reader.call.remote("exists", early + late)) == [True] * 8, timeout_s=30)
    assert ray.get(reader.call.remote("get_batch", early + late)) == [page(i) for i in range(4)] + [
        page(10 + i) for i in range(4)
    ]


def _epoch_changed(master: Any, old_epoch: str) -> bool:
    try:
        return bool(ray.get(master.ready.remote(), timeout=5) != old_epoch)
    except Exception:
        return False


def test_bad_input_is_refused_clearly() -> None:
    master_name = "kv-bad"
    master = start_master(master_name, config=CONFIG)
    worker = StoreWorker.remote(master_name)
    assert ray.get(worker.call.remote("put", b"k", page(1)))
    with pytest.raises(ray.exceptions.RayTaskError, match="buffer 0 has 100 bytes"):
        ray.get(worker.get_into_numpy.remote([b"k"], 100))
    with pytest.raises(ray.exceptions.RayTaskError, match="unknown segment 'no-such-segment'"):
        ray.get(master.advertise.remote("no-such-segment", [(b"k", "default", 0, PAGE)]))
    with pytest.raises(ray.exceptions.RayTaskError, match="key 0 must be non-empty bytes"):
        ray.get(worker.call.remote("get_batch", ["not-bytes"]))
    with pytest.raises(ray.exceptions.RayTaskError, match="2 keys but 1 values"):
        ray.get(worker.call.remote("put_batch", [b"a", b"b"], [page(1)]))
    assert ray.get(worker.call.remote("get", b"k")) == page(1)  # still serving


def test_ucx_settings_come_from_the_caller() -> None:
    master_name = "kv-ucx-config"
    start_master(master_name, config=CONFIG)
    tcp_only = {"TLS": "tcp,self"}
    writer = StoreWorker.remote(master_name, "ucx", SEGMENT, tcp_only)
    reader = StoreWorker.remote(master_name, "ucx", SEGMENT, tcp_only)
    assert ray.get(reader.env.remote("UCX_TLS")) == "tcp,self"
    assert ray.get(writer.call.remote("put", b"over-tcp", page(11)))
    assert ray.get(reader.call.remote("get", b"over-tcp")) == page(11)


def test_puts_spill_to_a_store_node_before_evicting() -> None:
    master_name = "kv-store-node"
    master = start_master(master_name, config=CONFIG)
    (node,) = start_store_nodes(master_name, 1, 64 * PAGE, namespace="kvstore-tests", page_bytes=PAGE)
    worker = StoreWorker.remote(master_name, "auto", 10 * PAGE)
    keys = keys_for("spill", 30)  # three times the worker's own segment
    assert ray.get(worker.call.remote("put_batch", keys, [page(i) for i in range(30)])) == [True] * 30
    assert ray.get(master.stats.remote())["evictions"] == 0
    assert ray.get(node.held_objects.remote()) == 21  # 9 stay home (90%), the rest go through the node's server
    reader = StoreWorker.remote(master_name)
    assert ray.get(reader.call.remote("get_batch", keys)) == [page(i) for i in range(30)]


def test_lookups_take_the_masters_socket_and_answer_as_ray_does() -> None:
    master_name = "kv-lookup"
    master = start_master(master_name, config=CONFIG)
    writer, reader = StoreWorker.remote(master_name), StoreWorker.remote(master_name)
    keys = keys_for("lookup", 6)
    assert ray.get(writer.call.remote("put_batch", keys[:4], [page(i) for i in range(4)])) == [True] * 4
    assert ray.get(reader.call.remote("exists", keys)) == [True] * 4 + [False] * 2
    assert ray.get(reader.call.remote("longest_prefix", keys)) == 4
    assert ray.get(reader.call.remote("get_batch", keys)) == [page(i) for i in range(4)] + [None, None]
    calls, fallbacks = ray.get(reader.lookup_counts.remote())
    assert (calls, fallbacks) == (3, 0)  # all three went over the socket
    socket_answer = RayMaster(master).call("get_locations", keys, None, "default")
    ray_answer = RayMaster(master, lookups=False).call("get_locations", keys, None, "default")
    assert socket_answer[:3] == ray_answer[:3] and socket_answer[0]  # same segments, offsets, misses
    # The same grants too (epoch, ranges), but for their expiry: each signed when asked.
    assert [(grant[0], grant[2]) for grant in socket_answer[3]] == [(grant[0], grant[2]) for grant in ray_answer[3]]


def test_lookup_socket_refuses_bad_frames_and_stays_up() -> None:
    master = start_master("kv-lookup-bad", config=CONFIG)
    address = tuple(ray.get(master.lookup_address.remote()))

    def ask(payload: bytes, conn: socket.socket) -> dict[str, Any]:
        conn.sendall(payload)
        return _read_frame(conn, "master_lookup_reply")

    with socket.create_connection(address, timeout=10) as conn:
        _prove(conn, ray.get(master.store_secret.remote()))
        garbage = b"\xc1not msgpack"
        reply = ask(struct.pack(">I", len(garbage)) + garbage, conn)
        assert not reply["ok"] and "not valid msgpack" in reply["error"]
        bad_method = {"type": "master_lookup", "request_id": 7, "method": "put_start", "keys": [b"k"], "tenant": "t"}
        body = msgpack.packb(bad_method)
        reply = ask(struct.pack(">I", len(body)) + body, conn)
        assert not reply["ok"] and "lookup method must be one of" in reply["error"]
        good = {"type": "master_lookup", "request_id": 8, "method": "exists", "keys": [b"k"], "tenant": "t"}
        reply = ask(frame(good), conn)  # the same connection still answers
        assert reply == {"type": "master_lookup_reply", "request_id": 8, "ok": True, "result": [False]}
    with socket.create_connection(address, timeout=10) as conn:
        _prove(conn, ray.get(master.store_secret.remote()))
        reply = ask(struct.pack(">I", 1 << 30), conn)  # a length no frame may have: refused, then hung up
        assert not reply["ok"] and "refused" in reply["error"]
        assert conn.recv(1) == b""
    # The master is still up for everyone else.
    assert RayMaster(master).call("exists", [b"k"], "t") == [False]


def test_lookups_fall_back_to_ray_when_the_socket_is_gone() -> None:
    master = start_master("kv-lookup-gone", config=CONFIG)
    gone = RayMaster(master)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # nothing listens here once this closes
    gone.lookup = LookupClient(lambda: ("127.0.0.1", port), gone.auth)
    assert gone.call("longest_prefix", [b"a", b"b"], "t") == 0
    assert gone.lookup is not None and (gone.lookup.calls, gone.lookup.fallbacks) == (0, 1)


def _read_frame(conn: socket.socket, expected_type: str) -> dict[str, Any]:
    (length,) = struct.unpack(">I", _recv(conn, 4))
    return wire.decode(_recv(conn, length), expected_type)


def _prove(conn: socket.socket, secret: bytes) -> dict[str, Any]:
    """Answer the lookup socket's challenge with a proof of ``secret``; the master's verdict (its own proof
    checked when it accepts)."""
    auth = StoreAuth(secret)
    server_nonce = _read_frame(conn, "challenge")["nonce"]
    client_nonce, proof = auth.answer(server_nonce)
    conn.sendall(frame({"type": "auth", "nonce": client_nonce, "proof": proof}))
    verdict = _read_frame(conn, "master_lookup_reply")
    if verdict["ok"]:
        auth.check_server(server_nonce, client_nonce, verdict["proof"])
    return verdict


def _lookup(conn: socket.socket, request_id: int, method: str, keys: list[bytes], tenant: str) -> dict[str, Any]:
    conn.sendall(
        frame({"type": "master_lookup", "request_id": request_id, "method": method, "keys": keys, "tenant": tenant})
    )
    return _read_frame(conn, "master_lookup_reply")


def test_the_stores_sockets_refuse_strangers_and_answer_each_tenant_only_about_its_own_pages() -> None:
    """What an attacker on the network tries with a plain socket and a plain UCX client, and a
    member asking on behalf of the wrong tenant."""
    master_name = "kv-doors"
    master = start_master(master_name, config=CONFIG)
    owner = StoreWorker.remote(master_name)
    keys = keys_for("alices-prompt", 4)
    assert ray.get(owner.call.remote("put_batch", keys, [page(i) for i in range(4)], tenant="alice")) == [True] * 4
    address = tuple(ray.get(master.lookup_address.remote()))
    secret = ray.get(master.store_secret.remote())
    # A plain socket that skips the proof, or proves another secret, learns nothing and is hung up on.
    for proof in (None, b"another cluster's store secret!!"):
        with socket.create_connection(address, timeout=10) as conn:
            if proof is None:
                _read_frame(conn, "challenge")
                reply = _lookup(conn, 1, "exists", keys, "alice")
            else:
                reply = _prove(conn, proof)
            assert not reply["ok"] and reply["error"].startswith("authentication refused")
            assert "result" not in reply and conn.recv(1) == b""
    # A member proving the secret hears about alice's pages only when asking for alice.
    with socket.create_connection(address, timeout=10) as conn:
        assert _prove(conn, secret)["ok"]
        assert _lookup(conn, 2, "exists", keys, "alice")["result"] == [True] * 4
        assert _lookup(conn, 3, "exists", keys, "bob")["result"] == [False] * 4
        assert _lookup(conn, 4, "longest_prefix", keys, "bob")["result"] == 0
        segment_ids, best, _, grants, _ = _lookup(conn, 5, "get_locations", keys, "bob")["result"]
        assert (segment_ids, grants) == ([], []) and set(np.frombuffer(best, dtype=np.int64)) == {-1}
    # The owner's segment over UCX: no secret, no bytes; the secret but no grant from the master, no bytes.
    directory = ray.get(master.segment_directory.remote())
    (segment_id,) = [sid for sid, info in directory.items() if info["ucx_address"]]
    ucx_address = tuple(directory[segment_id]["ucx_address"])
    stolen = bytearray(1 << 20)
    epoch = ray.get(master.ready.remote())
    stranger = StoreAuth(b"another cluster's store secret!!")
    with UcxClient(auth=stranger, timeout_s=10) as outsider:
        grant = stranger.read_grant(segment_id, epoch, np.array([[0, 1 << 20]]), 60)
        with pytest.raises(TransportError, match="authentication refused"):
            outsider.read(ucx_address, [(0, 1 << 20)], [stolen], grant)
        with pytest.raises(TransportError, match="authentication refused"):
            outsider.write(
                ucx_address,
                [b"evil"],
                [(0, 8)],
                [b"overwrit"],
                "alice",
                stranger.write_grant(segment_id, epoch, "alice", [(b"evil", 0, 8)], 60),
            )
    member = StoreAuth(secret)
    with UcxClient(auth=member, timeout_s=10) as insider:
        unsigned = StoreAuth(b"a grant signed without the key!!").read_grant(
            segment_id, epoch, np.array([[0, 1 << 20]]), 60
        )
        with pytest.raises(TransportError, match="read refused"):
            insider.read(ucx_address, [(0, 1 << 20)], [stolen], unsigned)
        elsewhere = member.read_grant("some-other-segment", epoch, np.array([[0, 1 << 20]]), 60)
        with pytest.raises(TransportError, match="read refused"):
            insider.read(ucx_address, [(0, 1 << 20)], [stolen], elsewhere)
    assert stolen == bytearray(1 << 20)
    # The owner's pages are intact and still served to alice.
    assert ray.get(owner.call.remote("get_batch", keys, tenant="alice")) == [page(i) for i in range(4)]


def _recv(conn: socket.socket, num_bytes: int) -> bytes:
    data = b""
    while len(data) < num_bytes:
        chunk = conn.recv(num_bytes - len(data))
        assert chunk, "connection closed early"
        data += chunk
    return data
