"""The per-process UCX runtime: the one event-loop thread that owns every ucxx object, and UCX's settings.

Threads and event loops: ucxx keeps one application context per process, and in the mode used
here (a UCX progress thread, asleep on the worker's events between them, plus ucxx's "Python
future" notifier) request completions are delivered to the event loop the context was created
on. So each process runs ONE dedicated daemon thread with its own asyncio loop, created on first
use, that owns every ucxx object: UcxServer and UcxClient are synchronous facades submitting
coroutines to it (``asyncio.run_coroutine_threadsafe``), usable from any number of threads, and a
process can be both a server and a client. Without the notifier, ucxx completes requests by
spinning on ``asyncio.sleep(0)``, which keeps a core busy for as long as a server waits on an idle
connection.
Callbacks (``on_write``) run on that loop thread: keep them short, and never call a UcxClient
from one (that would deadlock; it raises RuntimeError instead).

Transport settings: UCX reads its ``UCX_*`` environment variables (``UCX_TLS``,
``UCX_NET_DEVICES``, ``UCX_RNDV_THRESH``...) when ucxx creates its context, i.e. on the first
UcxServer.start or UcxClient call in the process. :func:`init_ucx` sets them from a dict and must
run before that. Unless set, these defaults apply: ``UCX_TCP_CM_REUSEADDR=y`` (a server
process restarted on a fixed port can bind it at once, despite the old connections'
TIME_WAIT), ``UCX_WARN_UNUSED_ENV_VARS=n``, 256 KiB TCP segments (``UCX_TCP_TX_SEG_SIZE`` /
``UCX_TCP_RX_SEG_SIZE``) and ``UCX_MM_ERROR_HANDLING=y`` (below). :func:`describe_transports`
reports what UCX made available; which transport a given transfer used is UCX's
per-message-size choice and ucxx does not expose it (set ``UCX_PROTO_INFO=y`` to have UCX log
its selection). One choice worth knowing: ucxx's
listener endpoints always ask for peer-failure error handling, which UCX's shared-memory
transports lack by default, so two processes on one node would talk over ``tcp/lo`` only;
``UCX_MM_ERROR_HANDLING=y`` (a default here) lets UCX use ``sysv``/``posix`` shared memory too;
``cma`` is never eligible. Same-node peers of the KV store normally map each other's
segment directly anyway.

Features: the context is created with tagged and stream messages, active messages and wakeup
only (``ucx_features.CONTEXT_FEATURES``), never remote memory access or atomics (ucxx's default turns RMA
on). Where no transport does RMA in hardware, UCX emulates it with active messages that read or
write whatever address they name, unchecked: a stranger connecting to the store's UCX listener
read any byte of the server process that way, before the store's handshake could refuse it
(``tests/kvstore/test_ucx_features.py`` does exactly that against a context with RMA on). A
context some other code created first with RMA on is refused (``ucx_features.UnsafeUcxContext``). For
the same reason UCX's TCP transport runs without its native puts (``UCX_TCP_PUT_ENABLE=n``,
whatever the environment says), which land at the address the sender names, checking no key.

Handshakes: ucxx's exchange of message tags, on connecting and on accepting, runs guarded
(:mod:`rayturn.kvstore.ucx_handshake`): neither a timeout nor a cancellation frees its receive
buffer while UCX may still write there.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import importlib
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from types import ModuleType
from typing import Any, Final, TypeVar

from rayturn.kvstore import ucx_features, ucx_handshake

__all__ = [
    "describe_transports",
    "in_ucx_loop_thread",
    "init_ucx",
    "load_ucxx",
    "register_for_shutdown",
    "run_in_ucx_loop",
    "shutdown_ucx",
    "ucx_loop_running",
    "unregister_for_shutdown",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_Owner = TypeVar("_Owner")

_INIT_TIMEOUT_S: Final = 60.0

PROGRESS_WAKE_MS: Final = 100
"""How long ucxx's progress thread waits on its worker's events before it progresses the worker anyway.

ucxx starts that thread with a 1 ms wait: ~900 wake-ups a second in every process of the store,
idle or busy, each one a context switch that takes a core from whatever else runs there (on a
small host, a decode replica's engine between two steps). Nothing here depends on the timeout:
every request ucxx submits from another thread signals the worker, and UCX's transports wake the
worker's event descriptor when a message arrives, so the wait is only a backstop."""

_UCX_DEFAULTS: Final = {
    # ucxx sets UCX_MEMTYPE_CACHE, which this UCX no longer knows: spare every process the warning.
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    # SO_REUSEADDR for listeners: a server restarted on its fixed port must not fail with "address
    # in use" for as long as its previous connections linger in TIME_WAIT.
    "UCX_TCP_CM_REUSEADDR": "y",
    # KV pages move in batches of megabytes: UCX's default 8 KiB TCP segments cut every 32 KiB page
    # into four sends. 256 KiB segments moved a 32 MiB batch ~1.7x faster over loopback here.
    "UCX_TCP_TX_SEG_SIZE": "256k",
    "UCX_TCP_RX_SEG_SIZE": "256k",
    # ucxx's endpoints ask for peer-failure handling, which UCX's shared-memory transports lack
    # unless this is set: with it, UCX between two processes of one node can use sysv/posix
    # shared memory instead of tcp/lo.
    "UCX_MM_ERROR_HANDLING": "y",
}
"""UCX settings this module applies unless the environment (or :func:`init_ucx`) says otherwise."""

_UCX_REQUIRED: Final = {
    # UCX's TCP transport writes a "put" straight to the address its sender names, checking no key,
    # whatever the UCP context's features: any peer that can open a TCP connection to this process's
    # UCX could write anywhere in its memory. Nothing here uses puts (rendezvous sends fall back to
    # its other protocols).
    "UCX_TCP_PUT_ENABLE": "n",
}
"""UCX settings every process of the store runs with, whatever the environment says (ucx_features.UNSAFE_FEATURES)."""


def _keeps_required(name: str, value: str) -> bool:
    """Whether ``value`` says what :data:`_UCX_REQUIRED` requires of ``name`` (UCX reads n, no, off and 0 alike)."""
    return value.lower() in (_UCX_REQUIRED[name], "no", "off", "0")


def load_ucxx() -> ModuleType:
    """ucxx, imported on first use: importing the transport must stay cheap and free of UCX side effects."""
    return importlib.import_module("ucxx")


class _UcxRuntime:
    """The dedicated daemon thread and asyncio loop that own every ucxx object of this process."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="rayturn-ucx-loop", daemon=True)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(_init_ucxx(), self.loop).result(timeout=_INIT_TIMEOUT_S)
        except BaseException:
            self._stop_loop(timeout_s=1.0)
            raise

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, coroutine: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def shutdown(self, timeout_s: float) -> None:
        """Close live servers and clients, stop ucxx's notifier thread, then stop the loop."""
        try:
            self.submit(_close_live_components()).result(timeout=timeout_s)
        except Exception as error:  # shutting down regardless: report, do not raise from atexit
            logger.warning("closing UCX servers and clients at shutdown failed: %s", error)
        _stop_notifier()
        self._stop_loop(timeout_s)

    def _stop_loop(self, timeout_s: float) -> None:
        with contextlib.suppress(RuntimeError):  # the loop may already be closed
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)


async def _init_ucxx() -> None:
    """Create ucxx's context on the UCX loop (so its notifier delivers completions to this loop), without RMA."""
    ucxx = load_ucxx()
    ucx_handshake.install(ucxx)
    # Python futures: a completed request wakes the loop, instead of the loop polling with sleep(0).
    enable_python_future = None if "UCXPY_ENABLE_PYTHON_FUTURE" in os.environ else True
    try:
        with ucx_features.created_with(ucx_features.CONTEXT_FEATURES):
            ucxx.init(enable_python_future=enable_python_future)
    except RuntimeError as error:  # "UCX is already initiated": someone used ucxx here before us
        logger.warning("ucxx was initialised outside rayturn's UCX loop (%s); completions may be slow", error)
    else:
        _slow_progress_wakeups()
    ucx_features.check_context_features()


def _slow_progress_wakeups() -> None:
    """Restart ucxx's progress thread with a :data:`PROGRESS_WAKE_MS` wait instead of its 1 ms.

    Only in ucxx's default "thread" mode (``UCXPY_PROGRESS_MODE`` may choose another) and only on
    a context this module created; at this point nothing has been submitted to the worker yet.
    """
    context = ucx_features.application_context()
    if context is None or getattr(context, "progress_mode", None) != "thread":
        return
    context.worker.stop_progress_thread()
    context.worker.start_progress_thread(polling_mode=False, epoll_timeout=PROGRESS_WAKE_MS)


def _stop_notifier() -> None:
    """Stop ucxx's notifier thread, so it cannot wake up into a finalising interpreter."""
    ucxx = load_ucxx()
    # ucxx's notifier blocks in C++ for up to a second per poll before it looks at its stop
    # request; waking it through the worker (not public API, hence the getattr) saves that second
    # at every process exit. Waking it re-arms its state, so it is marked stopped once more after
    # it has exited, or the worker's destructor warns that it is still running.
    worker = getattr(ucx_features.application_context(), "worker", None)
    if not getattr(worker, "enable_python_future", False):
        worker = None  # no notifier to wake (and nothing behind the call to wake it with)
    with contextlib.suppress(Exception):
        if worker is not None:
            worker.stop_request_notifier_thread()
        ucxx.stop_notifier_thread()
        if worker is not None:
            worker.stop_request_notifier_thread()


_runtime_lock = threading.Lock()
_runtime: _UcxRuntime | None = None
_runtime_was_shut_down = False
# Servers and clients that hold ucxx objects, each with the coroutine function that closes it on
# the loop; weak, so that registering never keeps one alive.
_live_components: weakref.WeakKeyDictionary[Any, Callable[[Any], Awaitable[None]]] = weakref.WeakKeyDictionary()


def _get_runtime() -> _UcxRuntime:
    global _runtime
    with _runtime_lock:
        if _runtime_was_shut_down:
            raise RuntimeError("the UCX runtime of this process was shut down (shutdown_ucx); it cannot restart")
        if _runtime is None:
            for name, value in _UCX_DEFAULTS.items():
                os.environ.setdefault(name, value)
            for name, value in _UCX_REQUIRED.items():
                if not _keeps_required(name, given := os.environ.get(name, value)):
                    logger.warning("%s=%s is unsafe where strangers can connect: using %s", name, given, value)
                os.environ[name] = value
            _runtime = _UcxRuntime()
            atexit.register(shutdown_ucx)
        elif _runtime.pid != os.getpid():
            raise RuntimeError("UCX was started before this process forked; use the 'spawn' start method")
        return _runtime


def _running_runtime() -> _UcxRuntime | None:
    with _runtime_lock:
        return _runtime if _runtime is not None and _runtime.pid == os.getpid() else None


def in_ucx_loop_thread() -> bool:
    """Whether the calling thread is this process's UCX loop thread (where blocking on UCX would deadlock)."""
    runtime = _running_runtime()
    return runtime is not None and runtime.in_loop_thread()


def ucx_loop_running() -> bool:
    """Whether this process's UCX loop has started (and not been shut down); starts nothing."""
    return _running_runtime() is not None


def register_for_shutdown(owner: _Owner, close_on_loop: Callable[[_Owner], Awaitable[None]]) -> None:
    """Have :func:`shutdown_ucx` await ``close_on_loop(owner)`` on the loop, if ``owner`` is still alive then.

    ``close_on_loop`` is a plain function (an unbound method), not a bound one: only ``owner`` is
    held, and weakly. Registering the same owner again replaces its entry.
    """
    _live_components[owner] = close_on_loop


def unregister_for_shutdown(owner: object) -> None:
    """Forget ``owner``: it closed itself. A no-op if it was not registered."""
    _live_components.pop(owner, None)


def deadline_after(timeout_s: float) -> float:
    """The ``time.monotonic()`` at which a request given ``timeout_s`` from now expires (``by_deadline``)."""
    return time.monotonic() + timeout_s


async def by_deadline(start: Callable[[], Awaitable[_T]], deadline: float) -> _T:
    """``start()`` awaited on the loop until ``deadline``, else asyncio.TimeoutError: also when the deadline passed
    before it could start (it is not started then: waiting for the loop counts), and when it completed past the
    deadline (a busy host woke the loop late to both events: a result that late is late all the same)."""
    if time.monotonic() >= deadline:
        raise asyncio.TimeoutError
    result = await asyncio.wait_for(start(), deadline - time.monotonic())
    if time.monotonic() > deadline:
        raise asyncio.TimeoutError
    return result


def run_in_ucx_loop(coroutine: Coroutine[Any, Any, _T], *, timeout_s: float) -> _T:
    """Run ``coroutine`` on this process's UCX loop thread and return its result.

    Every ucxx call must run on that loop (see the module docstring); this is how code outside
    this module gets there. Raises TimeoutError (after cancelling the coroutine) when it takes
    longer than ``timeout_s``, and RuntimeError when called from the loop thread itself, where
    waiting would deadlock.
    """
    try:
        runtime = _get_runtime()
        if runtime.in_loop_thread():
            raise RuntimeError("blocking UCX call made from the UCX loop thread (an on_write callback?)")
    except BaseException:
        coroutine.close()
        raise
    future = runtime.submit(coroutine)
    try:
        return future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"UCX operation did not finish within {timeout_s} s") from None
    except BaseException:
        future.cancel()  # e.g. KeyboardInterrupt: do not leave the coroutine running unobserved
        raise


def init_ucx(config: Mapping[str, str] | None = None) -> None:
    """Set UCX options for this process, as ``UCX_*`` environment variables; run it before first use.

    Keys are UCX option names with or without the ``UCX_`` prefix (``{"TLS": "tcp,self"}`` and
    ``{"UCX_TLS": "tcp,self"}`` are the same), or ucxx's own ``UCXPY_*`` variables; they override
    the environment. UCX reads them once, when the process's UCX context is created on the first
    :meth:`UcxServer.start` or :class:`UcxClient` call, so this raises RuntimeError if UCX is
    already running here. Processes started afterwards inherit them.
    """
    updates: dict[str, str] = {}
    for key, value in (config or {}).items():
        name = key if key.startswith(("UCX_", "UCXPY_")) else f"UCX_{key}"
        if not re.fullmatch(r"UCX(PY)?_[A-Z0-9_]+", name):
            raise ValueError(f"{key!r} is not a UCX option name (expected e.g. 'TLS' or 'UCX_TLS')")
        if name in _UCX_REQUIRED and not _keeps_required(name, str(value)):
            raise ValueError(f"{name}={value} would let any peer write into this process's memory; it stays 'n'")
        updates[name] = str(value)
    with _runtime_lock:
        if _runtime is not None or _runtime_was_shut_down:
            raise RuntimeError("init_ucx must run before the first UcxServer/UcxClient use in this process")
        os.environ.update(updates)


def shutdown_ucx(timeout_s: float = 5.0) -> None:
    """Close every live UcxServer and UcxClient and stop this process's UCX loop; idempotent.

    Runs automatically at interpreter exit. UCX cannot be used again in this process afterwards
    (ucxx's context stays bound to the stopped loop).
    """
    global _runtime, _runtime_was_shut_down
    with _runtime_lock:
        if _runtime is not None and _runtime.in_loop_thread():
            raise RuntimeError("shutdown_ucx cannot run on the UCX loop thread it would stop")
        runtime, _runtime = _runtime, None
        if runtime is None:
            return
        _runtime_was_shut_down = True
    if runtime.pid == os.getpid():
        runtime.shutdown(timeout_s)


async def _close_live_components() -> None:
    for component, close_on_loop in list(_live_components.items()):
        try:
            await close_on_loop(component)
        except Exception:  # shutting down regardless: one broken component must not keep the rest open
            logger.exception("closing %r at UCX shutdown failed", component)


def describe_transports(*, timeout_s: float = 10.0) -> str:
    """UCX's version, its transport setting and the transport resources it made available (best effort).

    Before UCX has started in this process this says so and reports the environment's setting.
    """
    if _running_runtime() is None:
        tls = os.environ.get("UCX_TLS", "all (default)")
        return f"UCX not started in this process yet (starts on first use); UCX_TLS={tls}"
    return run_in_ucx_loop(_describe_transports(), timeout_s=timeout_s)


async def _describe_transports() -> str:
    ucxx = load_ucxx()
    resources = re.findall(r"resource\s+\d+\s*:.*flags\s+\S+\s+(\S+)", ucxx.get_ucp_context_info())
    tls = ucxx.get_config().get("TLS", "?")
    shared_memory = (
        "posix/sysv eligible (UCX_MM_ERROR_HANDLING=y)"
        if os.environ.get("UCX_MM_ERROR_HANDLING", "n").lower() in ("y", "yes", "on", "1", "true")
        else "shared memory NOT eligible for these error-handling endpoints (set UCX_MM_ERROR_HANDLING=y), "
        "so same-node peers use tcp"
    )
    return (
        f"UCX {ucxx.__ucx_version__} (ucxx {ucxx.__version__}); UCX_TLS={tls}; "
        f"transports available: {', '.join(sorted(ucxx.get_active_transports()))} "
        f"(resources: {', '.join(resources)}); {shared_memory}; UCX picks one per transfer by size and "
        "peer and ucxx does not report which: set UCX_PROTO_INFO=y to log UCX's choices"
    )
