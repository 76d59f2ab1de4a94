"""The lookup socket's client alone: how long it makes a caller wait when the socket does not answer."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from rayturn.kvstore import master_lookup
from rayturn.kvstore.access import StoreAuth
from rayturn.kvstore.master_lookup import LookupClient, LookupFailed

AUTH = StoreAuth(b"test-store-secret-of-32-bytes...")


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
    monkeypatch.setattr(master_lookup, "CALL_TIMEOUT_S", 0.2)
    monkeypatch.setattr(master_lookup, "RETRY_AFTER_S", 0.3)
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
    monkeypatch.setattr(master_lookup, "CALL_TIMEOUT_S", 1.0)
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
