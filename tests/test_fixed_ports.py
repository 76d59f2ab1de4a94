"""The fixed ports tests and tools listen on stay clear of the ports Ray and the kernel hand out by themselves.

A node started with ``ray start`` (the fake KubeRay cluster, the small test clusters) gives its workers ports
from 10002-19999 by default, and the kernel gives outgoing connections its ephemeral range. A Serve proxy told to
bind a port in either can find it already taken by a worker or a connection ("Failed to bind to address").
"""

from __future__ import annotations

import ast
import functools
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("tests", "bench", "replay")
PORT_NAMES = ("HTTP_PORT", "GRPC_PORT", "RAY_PORT")


@functools.cache
def fixed_ports() -> tuple[tuple[str, str, int], ...]:
    """(file, what, port) for each module-level port constant and each ``--*-port`` option default (the sources
    are read once for all the tests here)."""
    found: list[tuple[str, str, int]] = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            where = str(path.relative_to(ROOT))
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Assign):
                    found.extend((where, name, port) for name, port in _assigned_ports(node))
                elif isinstance(node, ast.Call) and _is_port_option(node):
                    for keyword in node.keywords:
                        if keyword.arg == "default" and _is_int(keyword.value):
                            found.append((where, str(_first_arg(node)), _int(keyword.value)))
    return tuple(found)


def _assigned_ports(node: ast.Assign) -> list[tuple[str, int]]:
    pairs: list[tuple[ast.expr, ast.expr]] = []
    for target in node.targets:
        if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
            pairs.extend(zip(target.elts, node.value.elts, strict=False))
        else:
            pairs.append((target, node.value))
    return [
        (name.id, _int(value))
        for name, value in pairs
        if isinstance(name, ast.Name) and name.id in PORT_NAMES and _is_int(value)
    ]


def _is_int(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int


def _int(node: ast.expr) -> int:
    assert isinstance(node, ast.Constant) and isinstance(node.value, int)
    return node.value


def _first_arg(node: ast.Call) -> object:
    return node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None


def _is_port_option(node: ast.Call) -> bool:
    named = _first_arg(node)
    return (
        isinstance(node.func, ast.Attribute)
        and node.func.attr == "add_argument"
        and isinstance(named, str)
        and named.endswith("-port")
    )


def ray_worker_port_range() -> range:
    scripts = pytest.importorskip("ray.scripts.scripts")
    defaults = {option.name: option.default for option in scripts.start.params}
    return range(int(defaults["min_worker_port"]), int(defaults["max_worker_port"]) + 1)


def test_the_scan_finds_the_test_servers_ports() -> None:
    ports = fixed_ports()
    assert ("tests/cluster/test_independent_scaling.py", "GRPC_PORT", 29671) in ports
    assert ("replay/cli.py", "--http-port", 28080) in ports
    assert len(ports) >= 40


def test_no_fixed_port_is_one_ray_gives_its_workers() -> None:
    workers = ray_worker_port_range()
    assert 19671 in workers  # the gRPC port a test once lost to a worker of its own cluster
    clashes = [entry for entry in fixed_ports() if entry[2] in workers]
    assert not clashes, f"in `ray start`'s worker ports {workers.start}-{workers.stop - 1}: {clashes}"


def test_no_fixed_port_is_an_ephemeral_one() -> None:
    local_range = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if not local_range.exists():
        pytest.skip("no Linux ephemeral port range to read")
    low, high = (int(part) for part in local_range.read_text().split())
    clashes = [entry for entry in fixed_ports() if low <= entry[2] <= high]
    assert not clashes, f"in this host's ephemeral ports {low}-{high}: {clashes}"


def test_each_test_module_serves_on_ports_of_its_own() -> None:
    servers = Counter(port for where, _, port in fixed_ports() if where.startswith("tests/"))
    assert [port for port, count in servers.items() if count > 1] == []
