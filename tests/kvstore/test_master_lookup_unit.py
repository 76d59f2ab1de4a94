"""The lookup socket's client: how long it makes a caller wait when the socket does not answer; and its server on
a plain event loop: frames however they arrive, strangers refused."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from rayturn.kvstore import lookup_client, master_lookup, wire
from rayturn.kvstore.access import StoreAuth
from rayturn.kvstore.lookup_client import LookupClient, LookupFailed
from rayturn.kvstore.master_lookup import LookupServer, frame

AUTH = StoreAuth(b"test-store-secret-of-32-bytes...")
SLOW_ANSWER_S = 0.05


@pytest.fixture
def silent_listener() -> Iterator[tuple[str, int]]:
    """A port that accepts connections and never answers (a master loop stuck, a network that drops replies)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        accepted: list[socket.socket] = []
        stop = threading.Event()

        def accept() -> None:
            server.settimeout(0.1)
            while not stop.is_set():
                try:
                    accepted.append(server.accept()[0])
                except OSError:
                    continue

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        yield server.getsockname()
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()


def test_a_silent_socket_costs_one_short_timeout_then_rests_longer_each_time(
    silent_listener: tuple[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lookup_client, "CALL_TIMEOUT_S", 0.2)
    monkeypatch.setattr(lookup_client, "RETRY_AFTER_S", 0.3)
    client = LookupClient(lambda: silent_listener, AUTH)
    started = time.monotonic()
    with pytest.raises(LookupFailed):
        client.call("exists", [b"k"], "t")
    assert 0.15 < time.monotonic() - started < 1.0  # the call timeout, not longer
    started = time.monotonic()
    with pytest.raises(LookupFailed, match="failed recently"):
        client.call("exists", [b"k"], "t")  # resting: straight to Ray, no wait
    assert time.monotonic() - started < 0.05
    time.sleep(0.35)
    with pytest.raises(LookupFailed):
        client.call("exists", [b"k"], "t")  # tried again, failed again: now it rests twice as long
    time.sleep(0.35)
    with pytest.raises(LookupFailed, match="failed recently"):
        client.call("exists", [b"k"], "t")
    assert (client.calls, client.fallbacks) == (0, 4)


def test_a_thread_does_not_queue_behind_a_stuck_call(
    silent_listener: tuple[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lookup_client, "CALL_TIMEOUT_S", 1.0)
    client = LookupClient(lambda: silent_listener, AUTH)
    failures: list[Exception] = []

    def stuck_call() -> None:
        try:
            client.call("exists", [b"k"], "t")
        except LookupFailed as err:
            failures.append(err)

    stuck = threading.Thread(target=stuck_call)
    stuck.start()
    time.sleep(0.2)  # the first call now holds the connection, waiting for an answer that never comes
    started = time.monotonic()
    with pytest.raises(LookupFailed, match="busy"):
        client.call("exists", [b"k"], "t")
    assert time.monotonic() - started < 0.5
    stuck.join()
    assert len(failures) == 1  # the stuck call itself timed out and went to Ray


def test_a_request_too_large_for_a_frame_goes_to_ray_without_resting_the_socket() -> None:
    resolved: list[int] = []
    client = LookupClient(lambda: resolved.append(1) or None, AUTH)  # type: ignore[func-returns-value]
    with pytest.raises(LookupFailed, match="control message limit"):
        client.call("exists", [b"k" * 4096] * 300, "t")  # 1.2 MB of keys
    assert resolved == []  # nothing was sent, nothing resolved
    with pytest.raises(LookupFailed, match="no lookup socket"):
        client.call("exists", [b"k"], "t")  # the next call still tries the socket
    assert resolved == [1]


def test_a_resolver_error_is_a_fallback_not_a_crash() -> None:
    def broken() -> tuple[str, int]:
        raise AttributeError("this master has no lookup_address")

    client = LookupClient(broken, AUTH)
    with pytest.raises(LookupFailed, match="no lookup_address"):
        client.call("longest_prefix", [b"k"], "t")


def test_a_server_that_cannot_prove_the_secret_gets_no_lookups(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stranger on the master's port (one that took it after a master moved) accepts anyone: the client checks
    the server's proof, and asks Ray instead."""
    asked: list[bytes] = []
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()

        def impostor() -> None:
            conn, _ = server.accept()
            with conn:
                conn.sendall(master_lookup.frame({"type": "challenge", "nonce": b"s" * 32}))
                asked.append(conn.recv(4096))  # the client's answer
                reply = {"type": "master_lookup_reply", "request_id": 0, "ok": True, "proof": b"\x00" * 32}
                conn.sendall(master_lookup.frame(reply))
                asked.append(conn.recv(4096))  # nothing more comes: the client hung up

        thread = threading.Thread(target=impostor, daemon=True)
        thread.start()
        client = LookupClient(lambda: server.getsockname(), AUTH)
        with pytest.raises(LookupFailed, match="the server does not hold the store secret"):
            client.call("exists", [b"a-prompt-page"], "t")
        thread.join(timeout=5)
    assert asked[-1] == b""  # the lookup itself never went to the impostor
    assert b"a-prompt-page" not in b"".join(asked)


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[LookupServer, list[tuple[str, list[bytes]]]]]:
    """A LookupServer on its own event loop thread, answering ``exists`` with one True per key; the calls it
    answered. A peer has 0.5 s to prove the secret."""
    monkeypatch.setattr(master_lookup, "HANDSHAKE_TIMEOUT_S", 0.5)
    asked: list[tuple[str, list[bytes]]] = []

    def answer(method: str, keys: list[bytes], node_id: str | None, tenant: str) -> Any:
        asked.append((method, keys))
        if b"slow" in keys:  # a master busy with something else for a while
            time.sleep(SLOW_ANSWER_S)
        return [True] * len(keys)

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = LookupServer(answer, AUTH)
    asyncio.run_coroutine_threadsafe(server.start("127.0.0.1"), loop).result(timeout=10)
    yield server, asked
    loop.call_soon_threadsafe(server.close)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)


@pytest.fixture
def lookup_server(served: tuple[LookupServer, Any]) -> tuple[tuple[str, int], list[tuple[str, list[bytes]]]]:
    """The served LookupServer's address, and the calls it answered."""
    server, asked = served
    assert server.address is not None
    return server.address, asked


def _read_frame(conn: socket.socket, expected_type: str) -> dict[str, Any]:
    def exactly(num_bytes: int) -> bytes:
        data = conn.recv(num_bytes, socket.MSG_WAITALL)
        assert len(data) == num_bytes, "the server hung up"
        return data

    (length,) = struct.unpack(">I", exactly(4))
    return wire.decode(exactly(length), expected_type)


def _proven(address: tuple[str, int]) -> socket.socket:
    conn = socket.create_connection(address, timeout=10)
    nonce = _read_frame(conn, "challenge")["nonce"]
    client_nonce, proof = AUTH.answer(nonce)
    conn.sendall(frame({"type": "auth", "nonce": client_nonce, "proof": proof}))
    verdict = _read_frame(conn, "master_lookup_reply")
    assert verdict["ok"]
    AUTH.check_server(nonce, client_nonce, verdict["proof"])
    return conn


def _request(request_id: int, keys: list[bytes]) -> bytes:
    return frame({"type": "master_lookup", "request_id": request_id, "method": "exists", "keys": keys, "tenant": "t"})


def test_the_server_answers_frames_however_the_bytes_arrive(lookup_server: Any) -> None:
    """Byte by byte, several frames in one send, and many frames sent before any answer is read: every request
    answered once, in order."""
    address, asked = lookup_server
    with _proven(address) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for byte in _request(1, [b"a", b"b"]):
            conn.sendall(bytes([byte]))
            time.sleep(0.0005)
        assert _read_frame(conn, "master_lookup_reply") == {
            "type": "master_lookup_reply",
            "request_id": 1,
            "ok": True,
            "result": [True, True],
        }
        conn.sendall(_request(2, [b"c"]) + _request(3, [b"d"] * 3) + _request(4, [b"e"])[:5])
        conn.sendall(_request(4, [b"e"])[5:])
        assert [_read_frame(conn, "master_lookup_reply")["request_id"] for _ in range(3)] == [2, 3, 4]
        many = 3000  # thousands of requests sent before any answer is read
        conn.sendall(b"".join(_request(100 + i, [b"k" * 64] * 8) for i in range(many)))
        replies = [_read_frame(conn, "master_lookup_reply") for _ in range(many)]
        assert [reply["request_id"] for reply in replies] == list(range(100, 100 + many))
        assert all(reply["result"] == [True] * 8 for reply in replies)
    assert len(asked) == 4 + many


def test_a_caller_polls_for_its_answer_only_briefly_then_sleeps_until_it_comes(
    lookup_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller polls (yielding the CPU each turn) for ``REPLY_SPIN_S`` and then sleeps in ``recv``: a slow
    answer still lands, and costs no core while it is awaited; a socket made again after a failure is polled
    as the first was."""
    address, _ = lookup_server
    client = LookupClient(lambda: address, AUTH)
    assert client.call("exists", [b"warm"], "t") == [True]
    yields: list[float] = []
    monkeypatch.setattr(lookup_client.os, "sched_yield", lambda: yields.append(time.perf_counter()))
    # The window opens once the request is sent (not before the new socket's connection and handshake).
    awaited: list[float] = []
    await_reply = LookupClient._await_reply

    def timed_await_reply(self: LookupClient) -> None:
        awaited.append(time.perf_counter())
        await_reply(self)

    monkeypatch.setattr(LookupClient, "_await_reply", timed_await_reply)
    for _ in range(2):
        yields.clear()
        awaited.clear()
        start = time.perf_counter()
        assert client.call("exists", [b"slow"], "t") == [True]
        assert time.perf_counter() - start >= SLOW_ANSWER_S
        assert yields, "the caller never polled for its answer"
        assert len(awaited) == 1 and yields[0] >= awaited[0]
        assert yields[-1] - awaited[0] < lookup_client.REPLY_SPIN_S + SLOW_ANSWER_S / 2, "it polled past its window"
        client.close_socket()  # the next call connects again, and polls its new socket
    assert (client.calls, client.fallbacks) == (3, 0)


def test_the_server_answers_a_client_and_hangs_up_on_strangers(lookup_server: Any) -> None:
    address, asked = lookup_server
    client = LookupClient(lambda: address, AUTH)
    assert client.call("exists", [b"x", b"y"], "t") == [True, True]
    assert (client.calls, client.fallbacks) == (1, 0)
    wrong = StoreAuth(b"another-store-secret-of-32-bytes")
    stranger = LookupClient(lambda: address, wrong)
    with pytest.raises(LookupFailed, match="authentication refused"):
        stranger.call("exists", [b"x"], "t")
    # A peer that never answers the challenge is told so and hung up on once its time is up.
    with socket.create_connection(address, timeout=10) as conn:
        _read_frame(conn, "challenge")
        verdict = _read_frame(conn, "master_lookup_reply")
        assert not verdict["ok"] and "no proof of the store secret in time" in verdict["error"]
        assert conn.recv(1) == b""
    # A request instead of a proof, and a length no frame may have before one: refused, hung up on.
    with socket.create_connection(address, timeout=10) as conn:
        _read_frame(conn, "challenge")
        conn.sendall(_request(1, [b"x"]))
        verdict = _read_frame(conn, "master_lookup_reply")
        assert not verdict["ok"] and verdict["error"].startswith("authentication refused")
        assert conn.recv(1) == b""
    with socket.create_connection(address, timeout=10) as conn:
        _read_frame(conn, "challenge")
        conn.sendall(struct.pack(">I", 1 << 30))
        verdict = _read_frame(conn, "master_lookup_reply")
        assert verdict["error"] == f"authentication refused: frame of {1 << 30} bytes refused"
        assert conn.recv(1) == b""
    assert asked == [("exists", [b"x", b"y"])]  # only the client that proved the secret was answered
    assert client.call("exists", [b"z"], "t") == [True]  # and it still is


def test_a_stranger_announcing_a_large_frame_is_hung_up_on_before_its_body(
    lookup_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frame longer than an ``auth`` message is refused on its length alone: the master holds no stranger's
    megabyte waiting for the handshake to time out. A proven peer still sends frames up to the control limit."""
    monkeypatch.setattr(master_lookup, "HANDSHAKE_TIMEOUT_S", 30.0)  # the refusal cannot be the timeout's
    address, asked = lookup_server
    with socket.create_connection(address, timeout=1.0) as conn:
        _read_frame(conn, "challenge")
        started = time.monotonic()
        conn.sendall(struct.pack(">I", wire.MAX_CONTROL_BYTES))  # no body follows
        verdict = _read_frame(conn, "master_lookup_reply")
        assert verdict["error"] == f"authentication refused: frame of {wire.MAX_CONTROL_BYTES} bytes refused"
        assert conn.recv(1) == b""
        assert time.monotonic() - started < 1.0
    keys = [b"k" * 1024] * 256  # a 260 KB request, after the proof
    with _proven(address) as conn:
        conn.sendall(_request(1, keys))
        assert _read_frame(conn, "master_lookup_reply")["result"] == [True] * 256
    assert LookupClient(lambda: address, AUTH).call("exists", [b"x"], "t") == [True]
    assert asked == [("exists", keys), ("exists", [b"x"])]


def _fill_unproven(server: LookupServer) -> list[socket.socket]:
    """As many connections as may wait to prove the secret, each challenged; the next one is hung up on at once."""
    assert server.address is not None
    idle = []
    for _ in range(master_lookup.MAX_UNPROVEN_CONNECTIONS):
        idle.append(socket.create_connection(server.address, timeout=1.0))
        _read_frame(idle[-1], "challenge")
    assert server.num_unproven == master_lookup.MAX_UNPROVEN_CONNECTIONS
    with socket.create_connection(server.address, timeout=1.0) as extra:
        assert extra.recv(1) == b""  # no challenge: closed
    return idle


def _eventually(check: Callable[[], bool], within_s: float = 2.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_strangers_past_the_cap_are_hung_up_on_at_once_and_every_way_out_frees_a_place(
    served: tuple[LookupServer, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only peers still to prove the secret count; one leaves the count exactly once, whether proven, refused,
    timed out or gone."""
    monkeypatch.setattr(master_lookup, "HANDSHAKE_TIMEOUT_S", 30.0)
    server, asked = served
    address = server.address
    assert address is not None
    proven = _proven(address)  # counted while challenged, not once proven
    assert server.num_unproven == 0
    idle = _fill_unproven(server)
    with pytest.raises(LookupFailed):
        LookupClient(lambda: address, AUTH).call("exists", [b"x"], "t")  # the cap holds a member out too
    half = len(idle) // 2
    for conn in idle[:half]:  # refused: a frame too long for an auth message
        conn.sendall(struct.pack(">I", 1 << 16))
        assert not _read_frame(conn, "master_lookup_reply")["ok"]
    for conn in idle[half:]:  # refused: a wrong proof
        nonce, proof = StoreAuth(b"another-store-secret-of-32-bytes").answer(b"s" * 32)
        conn.sendall(frame({"type": "auth", "nonce": nonce, "proof": proof}))
        assert not _read_frame(conn, "master_lookup_reply")["ok"]
    assert server.num_unproven == 0
    for conn in idle:
        conn.close()
    monkeypatch.setattr(master_lookup, "HANDSHAKE_TIMEOUT_S", 0.2)
    slow = [socket.create_connection(address, timeout=1.0) for _ in range(3)]
    for conn in slow:  # timed out
        _read_frame(conn, "challenge")
        assert "no proof of the store secret in time" in _read_frame(conn, "master_lookup_reply")["error"]
        conn.close()
    assert server.num_unproven == 0
    monkeypatch.setattr(master_lookup, "HANDSHAKE_TIMEOUT_S", 30.0)
    for conn in _fill_unproven(server):  # gone without a word: the master sees each hang-up a moment later
        conn.close()
    _eventually(lambda: server.num_unproven == 0)
    assert LookupClient(lambda: address, AUTH).call("exists", [b"y"], "t") == [True]
    for conn in _fill_unproven(server):  # exactly the cap again: no connection above left the count twice
        conn.close()
    _eventually(lambda: server.num_unproven == 0)
    with proven:
        proven.sendall(_request(7, [b"z"]))
        assert _read_frame(proven, "master_lookup_reply")["result"] == [True]
    assert asked == [("exists", [b"y"]), ("exists", [b"z"])]
