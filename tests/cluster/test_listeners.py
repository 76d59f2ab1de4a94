"""Where the front door listens: busy ports refused, gRPC bound at the configured host (no cluster needed)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from rayturn.cluster import listeners
from rayturn.cluster.listeners import (
    GRPC_HOST_ENV,
    GRPC_MAX_MESSAGE_ENV,
    SERVE_SESSION_HEADER,
    SERVE_SESSION_HEADER_ENV,
    SETUP_HOOK,
    SETUP_HOOK_ENV,
    ListenerError,
    check_listening_only_at,
    check_ports_free,
    grpc_address,
    other_addresses,
    proxy_env,
)


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port held the way Ray Serve's proxies hold theirs: listening, with SO_REUSEPORT."""
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_a_port_another_server_holds_is_refused_naming_it(held_port: int) -> None:
    for host in ("127.0.0.1", "0.0.0.0", "localhost"):
        with pytest.raises(ListenerError, match=rf"address already in use: {host}:{held_port} \(server\.grpc_port\)"):
            check_ports_free(host, {"server.http_port": 0, "server.grpc_port": held_port})


def test_free_ports_and_port_zero_pass() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    check_ports_free("127.0.0.1", {"server.http_port": free, "server.grpc_port": 0})


def test_a_host_that_does_not_resolve_is_named() -> None:
    with pytest.raises(ListenerError, match=r"server\.host 'no-such-host\.invalid' does not resolve"):
        check_ports_free("no-such-host.invalid", {"server.http_port": 8000})


def test_the_proxies_bind_grpc_at_a_specific_host_only() -> None:
    env = proxy_env("127.0.0.1", 1 << 20)
    session = {SERVE_SESSION_HEADER_ENV: SERVE_SESSION_HEADER}  # Serve's session header, off rayturn's
    assert env == {
        GRPC_MAX_MESSAGE_ENV: str(1 << 20),
        GRPC_HOST_ENV: "127.0.0.1",
        SETUP_HOOK_ENV: SETUP_HOOK,
        **session,
    }
    # Every interface: Serve's own binding.
    assert proxy_env("0.0.0.0", 4096) == {GRPC_MAX_MESSAGE_ENV: "4096", **session}
    assert grpc_address("::1", 9000) == "[::1]:9000" and grpc_address("10.0.0.7", "9000") == "10.0.0.7:9000"
    assert grpc_address("localhost", 9000) == "localhost:9000"


def test_the_setup_hook_turns_servers_every_interface_binding_into_the_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.serve._private import default_impl

    added: list[str] = []
    monkeypatch.setattr(default_impl, "add_grpc_address", lambda server, address: added.append(address))
    monkeypatch.setenv(GRPC_HOST_ENV, "127.0.0.1")
    listeners.bind_grpc_to_configured_host()
    listeners.bind_grpc_to_configured_host()  # a second run wraps nothing twice
    default_impl.add_grpc_address(object(), "[::]:9000")
    assert added == ["127.0.0.1:9000"]


def test_the_setup_hook_does_nothing_without_a_host(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.serve._private import default_impl

    original: Any = default_impl.add_grpc_address
    monkeypatch.delenv(GRPC_HOST_ENV, raising=False)
    listeners.bind_grpc_to_configured_host()
    assert default_impl.add_grpc_address is original


def test_a_port_answering_beyond_its_host_is_caught() -> None:
    assert other_addresses("0.0.0.0", "10.0.0.7") == []
    assert other_addresses("127.0.0.1", "10.0.0.7") == ["10.0.0.7"]
    with socket.socket() as everywhere:
        everywhere.bind(("0.0.0.0", 0))
        everywhere.listen()
        port = everywhere.getsockname()[1]
        # Bound to every interface, so it answers on loopback too, though the config names another host.
        with pytest.raises(ListenerError, match=rf"server.grpc_port {port} answers on 127.0.0.1"):
            check_listening_only_at("192.0.2.123", "192.0.2.123", [("server.grpc_port", port)])
