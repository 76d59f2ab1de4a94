"""Which UCX features this process's ucxx context has: never remote memory access (see ``ucx_runtime``)."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any, Final

__all__ = ["CONTEXT_FEATURES", "UNSAFE_FEATURES", "UnsafeUcxContext", "check_context_features", "context_features"]

CONTEXT_FEATURES: Final = ("TAG", "WAKEUP", "STREAM", "AM")
"""The UCX features of this process's context: tagged and stream messages, active messages, wakeup."""
UNSAFE_FEATURES: Final = ("RMA", "AMO32", "AMO64")
"""Remote memory access and atomics, which a UCX context must not have where strangers can connect.

Without a transport that does them in hardware (TCP, shared memory without RDMA), UCX emulates
remote reads, writes and atomics with active messages whose handler touches whatever address
the message names, checking no key: any process that opens a connection to a listener or a
worker of a context with these features can read and write all of this process's memory,
before and regardless of the store's handshake. ucxx turns on RMA by default."""


class UnsafeUcxContext(RuntimeError):
    """This process's ucxx context has remote memory access on: rayturn will not serve or connect through it."""


def application_context() -> Any:
    """ucxx's application context of this process (its ``context``, ``worker`` and ``progress_mode``), or None
    before it exists. ucxx keeps it in a private attribute: this is the one place that reads it."""
    return getattr(importlib.import_module("ucxx").core, "_ctx", None)


def context_features() -> tuple[str, ...]:
    """The names of the features this process's ucxx context was created with (empty before it exists)."""
    context = getattr(application_context(), "context", None)
    if context is None:
        return ()
    api = importlib.import_module("ucxx._lib.libucxx")
    return tuple(feature.name for feature in api.Feature if context.feature_flags & feature.value)


def check_context_features() -> None:
    """Raise UnsafeUcxContext if this process's ucxx context can serve remote memory access."""
    unsafe = sorted(set(context_features()) & set(UNSAFE_FEATURES))
    if unsafe:
        raise UnsafeUcxContext(
            f"ucxx's context in this process has {', '.join(unsafe)} on: any peer that can connect could read and "
            "write this process's memory without the store secret. It was created before rayturn's (ucxx.init or "
            "another ucxx call first); let rayturn's UCX runtime create it, or create it without those features"
        )


@contextlib.contextmanager
def created_with(names: tuple[str, ...]) -> Iterator[None]:
    """While inside, the ucxx context ucxx.init creates gets exactly the features ``names``.

    ucxx.init takes no features: its application context calls ``UCXContext(config)``, whose
    default includes RMA. For the duration of the call, that module's ``ucx_api`` is a view of
    the real one whose UCXContext passes ``names``.
    """
    module = importlib.import_module("ucxx._lib_async.application_context")
    api: ModuleType = getattr(module, "ucx_api")  # noqa: B009 (mypy sees no such attribute)
    flags = tuple(getattr(api.Feature, name) for name in names)
    setattr(module, "ucx_api", _ApiWithFeatures(api, flags))  # noqa: B010
    try:
        yield
    finally:
        setattr(module, "ucx_api", api)  # noqa: B010


class _ApiWithFeatures(ModuleType):
    """ucxx's libucxx module, except that a UCXContext made through it gets the given features."""

    def __init__(self, api: ModuleType, flags: tuple[Any, ...]) -> None:
        super().__init__(api.__name__)
        self._api = api
        self._flags = flags

    def __getattr__(self, name: str) -> Any:
        return getattr(self._api, name)

    def UCXContext(self, config_dict: Mapping[str, str] | None = None, feature_flags: Any = None) -> Any:
        return self._api.UCXContext(config_dict, self._flags)
