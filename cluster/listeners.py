"""Where the front door listens: only at ``server.host``, and never on ports another server holds.

Ray Serve's proxies open their ports with ``SO_REUSEPORT``, so a second
``rayturn serve`` on ports a first one holds would start anyway and share
them: two clusters answering at random. ``check_ports_free`` therefore binds
each port at ``server.host`` without ``SO_REUSEPORT`` before anything starts,
and refuses with "address already in use" naming the port.

Serve's gRPC proxy binds ``[::]:<port>`` (every interface) whatever the HTTP
host says. ``proxy_env`` gives Serve's controller, and so the proxies it
starts, a worker setup hook (``bind_grpc_to_configured_host``) that makes the
proxy bind ``<host>:<port>`` instead, and caps gRPC messages at
``server.max_request_bytes`` (Serve's own default is 2 GiB). Since the hook
reaches into Serve's internals, ``check_listening_only_at`` confirms after
start-up that neither port answers on the node's other address.

Serve's HTTP proxy also reads a session header of its own, ``x-session-id`` by
default, the one rayturn's callers send, and decodes it as UTF-8 before any of
rayturn runs: a byte that is not UTF-8 there was a plain-text 500. rayturn
routes sessions itself and uses none of Serve's, so ``proxy_env`` points Serve
at a header no caller sends (``SERVE_SESSION_HEADER``); the ingress reads
``x-session-id`` as it reads every header.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import socket
from collections.abc import Iterable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

GRPC_HOST_ENV = "RAYTURN_GRPC_HOST"
# Ray runs the function this names when each worker process of the runtime environment starts.
SETUP_HOOK_ENV = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"
SETUP_HOOK = "rayturn.cluster.listeners.bind_grpc_to_configured_host"
GRPC_MAX_MESSAGE_ENV = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"
SERVE_SESSION_HEADER_ENV = "RAY_SERVE_SESSION_ID_HEADER_KEY"
SERVE_SESSION_HEADER = "x-ray-serve-session-id-unused"
PROBE_TIMEOUT_S = 1.0


class ListenerError(ValueError):
    """A port cannot listen where the config says, or listens wider than it says."""


def is_wildcard(host: str) -> bool:
    return host in ("0.0.0.0", "::", "")


def check_ports_free(host: str, ports: Mapping[str, int]) -> None:
    """ListenerError naming the first of ``ports`` (config key -> port; 0: any) that ``host`` cannot listen on."""
    for key, port in ports.items():
        if port == 0:
            continue
        try:
            addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except socket.gaierror as err:
            raise ListenerError(f"server.host {host!r} does not resolve: {err.strerror}") from None
        for family, kind, proto, _, address in addresses:
            with socket.socket(family, kind, proto) as probe:
                # SO_REUSEADDR lets the probe past connections of a stopped server still in TIME_WAIT;
                # it never lets two sockets listen on one port.
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    probe.bind(address)
                except OSError as err:
                    if err.errno == errno.EADDRINUSE:
                        raise ListenerError(
                            f"address already in use: {host}:{port} ({key}); another server (another "
                            "`rayturn serve`?) listens there; stop it or choose another port"
                        ) from None
                    raise ListenerError(f"cannot listen on {host}:{port} ({key}): {err.strerror}") from None


def proxy_env(host: str, max_message_bytes: int) -> dict[str, str]:
    """Environment for Serve's controller and proxies: gRPC bound at ``host``, messages capped, Serve's session
    header moved off rayturn's."""
    env = {GRPC_MAX_MESSAGE_ENV: str(max_message_bytes), SERVE_SESSION_HEADER_ENV: SERVE_SESSION_HEADER}
    if not is_wildcard(host):
        env[GRPC_HOST_ENV] = host
        env[SETUP_HOOK_ENV] = SETUP_HOOK
    return env


def grpc_address(host: str, port: int | str) -> str:
    """``host:port`` as gRPC writes it (IPv6 literals in brackets)."""
    try:
        if isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address):
            return f"[{host}]:{port}"
    except ValueError:
        pass  # a host name
    return f"{host}:{port}"


def bind_grpc_to_configured_host() -> None:
    """Worker setup hook: Serve's gRPC proxy binds ``$RAYTURN_GRPC_HOST`` instead of every interface.

    Serve adds its listening address through ``default_impl.add_grpc_address``
    (looked up when the proxy starts its server), always as ``[::]:<port>``.
    """
    host = os.environ.get(GRPC_HOST_ENV)
    if not host:
        return
    from ray.serve._private import default_impl

    original = default_impl.add_grpc_address
    if getattr(original, "rayturn_host", None) == host:
        return

    def add_grpc_address(grpc_server: Any, server_address: str) -> None:
        port = server_address.rpartition(":")[2]
        original(grpc_server, grpc_address(host, port))

    add_grpc_address.rayturn_host = host  # type: ignore[attr-defined]
    default_impl.add_grpc_address = add_grpc_address


def other_addresses(host: str, node_ip: str) -> list[str]:
    """Addresses of this node other than ``host`` where a port bound only at ``host`` must not answer."""
    if is_wildcard(host):
        return []
    candidates = {"127.0.0.1", node_ip}
    with contextlib.suppress(socket.gaierror):
        candidates -= {info[4][0] for info in socket.getaddrinfo(host, None)}
    return sorted(candidates)


def check_listening_only_at(host: str, node_ip: str, ports: Iterable[tuple[str, int]]) -> None:
    """ListenerError when one of ``ports`` (config key, port) answers on an address of this node other than ``host``."""
    for address in other_addresses(host, node_ip):
        for key, port in ports:
            try:
                with socket.create_connection((address, port), timeout=PROBE_TIMEOUT_S):
                    pass
            except OSError:
                continue
            raise ListenerError(
                f"{key} {port} answers on {address}, but server.host is {host}: the port listens on more "
                "interfaces than configured"
            )
