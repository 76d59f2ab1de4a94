"""What every component's frozen settings type uses to check itself.

Each component owns its settings (``rayturn.decode.lifecycle.settings``,
``rayturn.router.settings``, ``rayturn.kvstore.settings``, ...), a frozen
dataclass that checks its own ranges in ``__post_init__`` and names the bad
field relative to itself with ``FieldError``; the cluster's YAML reader
(``rayturn.cluster.config``), which knows where the section sits in the
file, adds the section's prefix.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Mapping


class FieldError(ValueError):
    """A bad value, named relative to the settings type that holds it."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key} {reason}")
        self.key = key
        self.reason = reason


def check(ok: bool, key: str, reason: str) -> None:
    if not ok:
        raise FieldError(key, reason)


def check_at_least(key: str, value: float | None, minimum: float) -> None:
    check(value is None or value >= minimum, key, f"must be >= {minimum}, got {value}")


def check_above(key: str, value: float, bound: float) -> None:
    check(value > bound, key, f"must be > {bound}, got {value}")


def check_non_empty(key: str, value: str | None) -> None:
    check(value is None or value.strip() != "", key, "must not be empty")


def check_port(key: str, port: int) -> None:
    check(0 <= port <= 65535, key, f"must be a port number in 0-65535, got {port}")


def check_choice(key: str, value: str, names: Iterable[str]) -> None:
    """``value`` must be one of ``names`` (a registry's names)."""
    known = list(names)
    check(value in known, key, f"must be one of {', '.join(known)}, got {value!r}")


def frozen_mapping(mapping: Mapping[str, float]) -> Mapping[str, float]:
    """A read-only copy: the caller's dict cannot change a frozen settings object (Ray's cloudpickle carries
    mapping proxies to actors)."""
    return types.MappingProxyType(dict(mapping))


def check_resources(key: str, resources: Mapping[str, float]) -> None:
    for name, amount in resources.items():
        check(name.strip() != "", key, "must not hold an empty resource name")
        check(amount > 0, f"{key}.{name}", f"must be > 0, got {amount}")
